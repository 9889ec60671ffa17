"""The SIGKILL resume dance shared by the resume tests (test helper): an uninterrupted run and one
killed with SIGKILL right after its first checkpoint, side by side, then the killed one resumed."""
import signal
import time


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
        deadline = time.time() + timeout_s
        while not checkpoints(workdirs["killed"]) and killed.poll() is None and time.time() < deadline:
            time.sleep(0.01)
        assert killed.poll() is None, \
            "the run did not stay alive until its first checkpoint: " + read_log("killed")[-3000:]
        killed.send_signal(signal.SIGKILL)
        killed.wait()
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
    """The steps saved under `workdir/checkpoints/name`."""
    import os

    folder = os.path.join(workdir, "checkpoints", name)
    return sorted(int(n) for n in os.listdir(folder) if n.isdigit()) if os.path.isdir(folder) else []


def logged_metrics(workdir, skip=("time",)) -> dict:
    """step -> the metrics.jsonl line of that step, without timings (`*_s` and the keys in `skip`)."""
    import json
    import os

    rows = {}
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            rows[row["step"]] = {k: v for k, v in row.items() if k not in skip and not k.endswith("_s")}
    return rows
