"""The SIGKILL resume dances shared by the resume tests (test helper).

`straight_killed_resumed`: an uninterrupted run and one killed with SIGKILL right after its first
checkpoint, side by side, then the killed one resumed. `run_through_kills`: a run killed again and
again, each time at a chosen point (a fail point armed in the process, steprl_jax/failpoints.py,
or an external SIGKILL when a condition on its workdir holds), restarted on the same workdir until
it finishes. The comparisons that follow: `record_lines`, `checkpoint_arrays`, `logged_metrics`."""
import os
import signal
import time

from steprl_jax.failpoints import ENV as KILL_ENV
from steprl_jax.training.checkpoint import _TMP_SUFFIX as TMP_SUFFIX  # a step folder not (yet) committed


def kill_when(proc, condition, timeout_s: float, read_log) -> None:
    """SIGKILL `proc` as soon as `condition()` holds (polled every 10 ms); fails with its log if
    it ends first or the condition never comes."""
    deadline = time.time() + timeout_s
    while not condition() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    assert proc.poll() is None, "the run ended before the moment to kill it: " + read_log()[-3000:]
    assert condition(), f"no moment to kill the run in {timeout_s} s: " + read_log()[-3000:]
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def run_through_kills(start, workdir, kills, read_log, timeout_s: float = 400, after_kill=None) -> list:
    """Start the job on `workdir` once per kill in `kills` and see it die by SIGKILL, then once
    more unarmed and see it finish. A kill is a fail point armed in the process ("name:N": the
    N-th pass there, counted from the process start) or a callable `condition(workdir)`: an
    external SIGKILL as soon as it returns true. `start(name, workdir, env)` -> Popen with `env`
    set in its environment, for the names "kill0", "kill1", ..., "last"; `read_log(name)`
    returns a run's output; `after_kill(i, workdir)` looks at what kill i left. Returns the
    names in the order they ran."""
    names = []
    for i, kill in enumerate(list(kills) + [None]):
        name = "last" if kill is None else f"kill{i}"
        names.append(name)
        armed = isinstance(kill, str)
        proc = start(name, workdir, {KILL_ENV: kill if armed else ""})  # "": nothing armed
        try:
            if kill is None:
                assert proc.wait(timeout=timeout_s) == 0, read_log(name)[-3000:]
            elif armed:
                rc = proc.wait(timeout=timeout_s)
                assert rc == -signal.SIGKILL, f"fail point {kill} never killed the run (exit {rc}): " \
                    + read_log(name)[-3000:]
                assert f"fail point {kill}: SIGKILL" in read_log(name), read_log(name)[-3000:]
            else:
                kill_when(proc, lambda: kill(workdir), timeout_s, lambda: read_log(name))
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if kill is not None and after_kill is not None:
            after_kill(i, workdir)
    return names


def straight_killed_resumed(start, checkpoints, workdirs: dict, read_log, timeout_s: float = 400,
                            after_kill=None) -> list:
    """`start(name, workdir)` -> Popen for the names "straight", "killed", "resumed";
    `checkpoints(workdir)` lists the saved steps; `read_log(name)` returns a run's output.
    `after_kill(workdir)` checks the killed run's workdir before the resume. Returns the checkpoint
    steps the killed run left; raises with the log of a run that failed."""
    straight = start("straight", workdirs["straight"])
    killed = start("killed", workdirs["killed"])
    resumed = None
    try:
        kill_when(killed, lambda: checkpoints(workdirs["killed"]), timeout_s, lambda: read_log("killed"))
        left = checkpoints(workdirs["killed"])
        if after_kill is not None:
            after_kill(workdirs["killed"])
        resumed = start("resumed", workdirs["killed"])
        assert straight.wait(timeout=timeout_s) == 0, read_log("straight")[-3000:]
        assert resumed.wait(timeout=timeout_s) == 0, read_log("resumed")[-3000:]
    finally:
        for proc in (straight, killed, resumed):
            if proc is not None and proc.poll() is None:
                proc.kill()
    return left


def checkpoint_steps(workdir, name: str) -> list:
    """The steps saved under `workdir/checkpoints/name` (committed ones only)."""
    folder = os.path.join(workdir, "checkpoints", name)
    return sorted(int(n) for n in os.listdir(folder) if n.isdigit()) if os.path.isdir(folder) else []


def uncommitted_steps(workdir, name: str) -> list:
    """The steps whose save began under `workdir/checkpoints/name` and was never committed."""
    folder = os.path.join(workdir, "checkpoints", name)
    names = os.listdir(folder) if os.path.isdir(folder) else []
    return sorted(int(n[:-len(TMP_SUFFIX)]) for n in names if n.endswith(TMP_SUFFIX))


def checkpoint_arrays(workdir, name: str, step: int) -> dict:
    """Every array of the train state saved at `step` (parameters, optimizer, step, RNG), by path."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    tree = ocp.PyTreeCheckpointer().restore(os.path.join(workdir, "checkpoints", name, str(step), "state"))
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def complete_lines(path) -> int:
    """How many newline-terminated lines `path` holds (0 when it does not exist)."""
    try:
        with open(path, "rb") as f:
            return f.read().count(b"\n")
    except FileNotFoundError:
        return 0


def without_timings(value, skip=("time",)):
    """`value` (parsed JSON) without the keys that depend on the machine's state: timings (`*_s`),
    memory (`*_gb`) and those in `skip`."""
    if isinstance(value, dict):
        return {k: without_timings(v, skip) for k, v in value.items()
                if k not in skip and not k.endswith(("_s", "_gb"))}
    if isinstance(value, list):
        return [without_timings(v, skip) for v in value]
    return value


def record_lines(path, key=lambda record: record["id"]) -> dict:
    """key -> the record (one JSONL line) without timings; fails on a key written twice (an
    episode recorded twice) or a line that is not JSON (a torn line left in the file)."""
    import json

    records = {}
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            record = json.loads(line)
            assert key(record) not in records, f"{path}:{number}: {key(record)} written twice"
            records[key(record)] = without_timings(record)
    return records


# The float lists a sampler records: where a test allows it (`same_record`'s atol), these may
# differ in their last bits (a row's numbers depend on its batch-mates: the batch width, the cache
# slots they leave it), everything else must be equal.
SAMPLED_FLOATS = ("action_logprobs", "action_entropies")


def _split_floats(value, floats: list):
    """`value` without its SAMPLED_FLOATS lists, which are appended to `floats` in order."""
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if k in SAMPLED_FLOATS and v is not None:
                floats.append(v)
            else:
                out[k] = _split_floats(v, floats)
        return out
    if isinstance(value, list):
        return [_split_floats(v, floats) for v in value]
    return value


def same_record(a, b, atol: float = 0.0) -> bool:
    """Equal records; with `atol` > 0 their SAMPLED_FLOATS may differ by that much (float32
    rounding of another summation order: ~1e-6 for log-probs of -10), everything else equal."""
    import numpy as np

    fa, fb = [], []
    if _split_floats(a, fa) != _split_floats(b, fb) or len(fa) != len(fb):
        return False
    return all(len(x) == len(y) and np.allclose(x, y, rtol=0.0, atol=atol) for x, y in zip(fa, fb))


def logged_metrics(workdir, skip=("time",), repeats: dict = None, stage: str = None) -> dict:
    """step -> the metrics.jsonl line of that step (of `stage` only, if given), without timings
    (`*_s` and the keys in `skip`); a step logged again by a resumed run keeps its last line (the
    earlier ones go to `repeats`)."""
    import json

    rows = {}
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            if stage is not None and row["stage"] != stage:
                continue
            if repeats is not None and row["step"] in rows:
                repeats.setdefault(row["step"], []).append(rows[row["step"]])
            rows[row["step"]] = without_timings(row, skip)
    return rows
