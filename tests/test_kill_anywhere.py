"""Kill anywhere, resume exactly: SWiRL (collect, judge, filter, stage 2, SFT in one run) and online
RL (GRPO) run as real `python -m steprl_jax.main` processes, are killed with SIGKILL at chosen
points, restarted on the same workdir until they finish, and end with what an uninterrupted run of
the same seed ends with: the same records and units (every episode exactly once, the same token
ids, tool calls and verdicts; timings aside; the sampled log-probs bit for bit, or to float32
rounding where a collection resumed part way: resume_helpers.SAMPLED_FLOATS), the same final
train states (every array of the last checkpoint: parameters, optimizer, step, RNG) and exported
policies, bit for bit, and the same logged metrics. A checkpoint whose save was interrupted is
never loaded: the restarted run resumes from the last committed step.

Kill points are fail points armed in the process (steprl_jax/failpoints.py: half a record line
written, a checkpoint fully written but not committed, between SWiRL stages, ...) or external
SIGKILLs when the workdir reaches a state (the N-th record line, a checkpoint committed). CI runs
one chain per job: the run is killed at one point, or at a few in turn (each in a later part of
the job), then finishes. The full matrix, each kill point alone on a fresh workdir, runs with
STEPRL_JAX_KILL_MATRIX=1 (launch/kill_matrix.sh). One uninterrupted run per job is shared by all
its cases.

The policy is a tiny random model exported to disk; collect's judges are the rule judges, stage
2's reward model and RL's outcome judge are stub endpoints on 127.0.0.1 answering from a hash of
the request, so every process sees the same rewards.
"""
import dataclasses
import glob
import os
import subprocess
import sys
from typing import Callable

import numpy as np
import pytest
from safetensors.numpy import load_file

from resume_helpers import (KILL_ENV, TMP_SUFFIX, checkpoint_arrays, checkpoint_steps, complete_lines, logged_metrics,
                            record_lines, run_through_kills, same_record, uncommitted_steps)
from rl_helpers import VerdictServer, rl_command
from swirl_helpers import HTTP_REWARD_CONFIG, RewardServer, smol_tokenizer, tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MATRIX = os.environ.get("STEPRL_JAX_KILL_MATRIX", "") == "1"
TIMEOUT_S = 600


# Records of a collection that resumed part way: exactly equal, log-probs too (an interrupted wave
# of episodes runs again whole, with its batch-mates: RolloutEngine.run_in_waves).
RESUMED_COLLECTION = 0.0


@dataclasses.dataclass(frozen=True)
class Job:
    command: Callable  # (assets, workdir) -> argv
    records: dict  # JSONL records and units (globs under the workdir) -> tolerance of sampled floats
    files: tuple  # files compared byte for byte
    checkpoints: dict  # checkpoint folder (and metrics stage) -> its final step
    resumed: str  # the log line of a resume, for `name` and `step`
    exports: tuple  # exported policies


def _swirl(a, w):
    """8 trajectories (4 questions, K = 2), rule judges, every unit kept; stage 2: 3 updates of
    2 states x G = 2, a checkpoint after each; SFT: 8 trajectories, 3 per update, 3 updates."""
    return [sys.executable, "-m", "steprl_jax.main", f"--config={a.reward_config}",
            f"--config.model.source={a.model_dir}", f"--config.workdir={w}",
            "--config.stages=collect,judge,filter,train,sft", f"--config.reward.base_url={a.rewards.base_url}",
            "--config.task.num_tasks=4", "--config.rollout.max_new_tokens=16", "--config.rollout.max_steps=2",
            "--config.swirl.filter=none", "--config.swirl.train.group_size=2", "--config.swirl.train.batch_size=2",
            "--config.swirl.train.updates=3", "--config.swirl.train.save_every=1", "--config.swirl.sft.batch_size=3",
            "--config.swirl.sft.epochs=1", "--config.optimizer.learning_rate=0.001", "--config.progress=False"]


JOBS = {
    "swirl": Job(_swirl, records={"trajectories.jsonl": RESUMED_COLLECTION, "judged.jsonl": RESUMED_COLLECTION,
                                  "units/none_trajectory.jsonl": RESUMED_COLLECTION},
                 files=("units/none_trajectory.stats.json",),
                 checkpoints={"swirl": 3, "sft": 3}, resumed="{name}: resumed at update {step}",
                 exports=("policy/swirl", "policy/sft")),
    # 3 iterations; a held-out evaluation (2 queries, judged records appended) before iterations 0
    # and 2 and after the last
    "grpo": Job(lambda a, w: rl_command("grpo", a.model_dir, w, a.verdicts.base_url, 3, eval_tasks=2),
                # an iteration's rollouts are all redone after a resume: bit for bit
                records={"rollouts/*.jsonl": 0.0, "eval/*.trajectories.jsonl": RESUMED_COLLECTION}, files=(),
                checkpoints={"rl": 3},
                resumed="{name}: resumed at iteration {step}", exports=("policy/rl",)),
}


def lines_at_least(path, n):
    condition = lambda w: complete_lines(os.path.join(w, path)) >= n
    condition.__name__ = f"{path}>={n}"
    return condition


def committed(name, step):
    condition = lambda w: step in checkpoint_steps(w, name)
    condition.__name__ = f"{name}/{step}"
    return condition


# Each kill alone, on a fresh workdir (the matrix). A fail point counts its passes from the process
# start; in the swirl job, 8 trajectories then 8 judged records are appended, then stage 2 saves
# steps 1-3, then SFT steps 1-3.
POINTS = {
    "swirl": [
        "records.append.mid:3",  # collect: the 3rd trajectory's line torn
        "records.append.after:2",  # collect
        lines_at_least("trajectories.jsonl", 5),  # collect, external
        "swirl.stage.before_mark:1",  # every trajectory written, collect not marked
        "swirl.stage.after_mark:1",  # between collect and judge
        "records.append.mid:11",  # judge: the 3rd judged line torn
        "swirl.stage.after_mark:3",  # between filter and stage 2
        "checkpoint.save.mid:1",  # stage 2: its first checkpoint written, not committed: start over
        "checkpoint.save.mid:2",  # stage 2: resume from step 1
        "checkpoint.save.after:2",  # stage 2
        committed("swirl", 2),  # stage 2, external
        "swirl.stage.before_mark:4",  # stage 2 trained and exported, not marked
        "checkpoint.save.mid:6",  # SFT: its 3rd checkpoint (resume from step 2)
        "checkpoint.save.after:4",  # SFT: its first checkpoint
        committed("sft", 2),  # SFT, external
    ],
    "grpo": [
        "checkpoint.save.mid:1",
        "checkpoint.save.mid:2",
        "checkpoint.save.after:1",
        "records.append.mid:3",  # the evaluation before iteration 2: its first episode torn
        "records.append.after:5",  # the final evaluation's first episode
        lines_at_least("rollouts/iter_00001.jsonl", 1),  # external, about iteration 1's checkpoint
    ],
}
# CI: one run per job killed at each of these in turn (each process counts from its start), then finished.
CHAINS = {
    "swirl": ["records.append.mid:3",  # collect: a torn trajectory line
              "checkpoint.save.mid:2",  # the rest collected, judge, filter, stage 2 step 1; step 2 not committed
              committed("sft", 2)],  # stage 2 from step 1 to the end; SFT steps 1 and 2; external
    "grpo": ["checkpoint.save.mid:2"],  # iteration 1 committed, iteration 2's checkpoint not: redo iteration 1
}


def _key(record) -> str:  # a record's episode id; a unit's trajectory and step
    return record["id"] if "id" in record else f"{record['trajectory_id']}/{record['step_index']}"


def _name(kill) -> str:
    return kill if isinstance(kill, str) else "external:" + kill.__name__


CASES = [pytest.param(job, [CHAINS[job]], id=f"{job}-chain") for job in JOBS]
if MATRIX:
    CASES += [pytest.param(job, [[kill]], id=f"{job}-{_name(kill)}") for job in JOBS for kill in POINTS[job]]


@dataclasses.dataclass
class Assets:
    folder: str
    model_dir: str
    reward_config: str
    rewards: object
    verdicts: object


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from steprl_jax.models import export_hf

    folder = tmp_path_factory.mktemp("kill_anywhere")
    tokenizer = smol_tokenizer()
    model_dir = export_hf(tiny_model(tokenizer, seed=11), tokenizer, str(folder / "model"))
    (folder / "swirl_http_reward.py").write_text(HTTP_REWARD_CONFIG)
    rewards, verdicts = RewardServer(), VerdictServer()
    yield Assets(str(folder), model_dir, str(folder / "swirl_http_reward.py"), rewards, verdicts)
    rewards.close()
    verdicts.close()


def _start(assets, job: str, name: str, workdir: str, env: dict, log: str):
    with open(log, "a") as f:
        f.write(f"===== {name}\n")
        f.flush()
        return subprocess.Popen(JOBS[job].command(assets, workdir), cwd=ROOT, env={**os.environ, **env},
                                stdout=f, stderr=subprocess.STDOUT)


def _read_log(log: str, name: str) -> str:
    with open(log) as f:
        text = f.read()
    text = text[text.rindex(f"===== {name}\n"):]
    end = text.find("\n=====", 1)
    return text if end < 0 else text[:end + 1]


@pytest.fixture(scope="module")
def straight(assets):
    """job -> the workdir of its uninterrupted run (run once, on first use)."""
    done = {}

    def workdir(job: str) -> str:
        if job not in done:
            w = os.path.join(assets.folder, job)
            proc = _start(assets, job, "straight", w, {KILL_ENV: ""}, w + ".log")
            try:
                assert proc.wait(timeout=TIMEOUT_S) == 0, _read_log(w + ".log", "straight")[-3000:]
            finally:
                if proc.poll() is None:
                    proc.kill()
            done[job] = w
        return done[job]

    return workdir


def _after_kill(job: Job, kills: list, left: list):
    """Note what each kill left: the committed steps of each checkpoint folder (the next run must
    resume from the last); and check the torn record line or the uncommitted checkpoint that the
    fail point promises is really on disk."""
    def check(i, workdir):
        steps = {name: checkpoint_steps(workdir, name) for name in job.checkpoints}
        left.append(steps)
        point = kills[i] if isinstance(kills[i], str) else ""
        if point.startswith("records.append.mid"):
            torn = [p for pattern in job.records for p in glob.glob(os.path.join(workdir, pattern))
                    if open(p, "rb").read()[-1:] not in (b"\n", b"")]
            assert len(torn) == 1, f"{point}: expected one record file ending in a torn line, found {torn}"
        if point.startswith("checkpoint.save.mid"):
            pending = [(name, step) for name in job.checkpoints for step in uncommitted_steps(workdir, name)
                       if step > max(steps[name], default=0)]
            assert len(pending) == 1, f"{point}: expected one uncommitted step after the last, found {pending}"
            name, step = pending[0]
            folder = os.path.join(workdir, "checkpoints", name, f"{step}{TMP_SUFFIX}")
            assert os.path.isdir(os.path.join(folder, "state")), f"{folder}: the interrupted save wrote no state"
    return check


@pytest.mark.parametrize("job, kills", CASES)
def test_killed_anywhere_resumes_exactly(job, kills, assets, straight, tmp_path):
    kills = kills[0]
    spec = JOBS[job]
    reference = straight(job)
    workdir, log = str(tmp_path / "killed"), str(tmp_path / "killed.log")
    left = []
    names = run_through_kills(lambda name, w, env: _start(assets, job, name, w, env, log), workdir, kills,
                              lambda name: _read_log(log, name), timeout_s=TIMEOUT_S,
                              after_kill=_after_kill(spec, kills, left))

    # Each restart resumed from the last committed checkpoint of the stage in progress, never from
    # a save that was interrupted (a stage already at its last step may be skipped instead).
    for i, steps in enumerate(left):
        text = _read_log(log, names[i + 1])
        for name, final in spec.checkpoints.items():
            if not steps[name]:
                assert spec.resumed.format(name=name, step="") not in text, text[-3000:]
            elif steps[name][-1] < final:
                assert spec.resumed.format(name=name, step=steps[name][-1]) + " " in text, text[-3000:]
    for name, final in spec.checkpoints.items():
        assert checkpoint_steps(workdir, name)[-1] == final and uncommitted_steps(workdir, name) == []
        arrays = {w: checkpoint_arrays(w, name, final) for w in (reference, workdir)}
        assert sorted(arrays[reference]) == sorted(arrays[workdir])
        differ = [k for k, v in arrays[reference].items()
                  if v.dtype != arrays[workdir][k].dtype or v.tobytes() != arrays[workdir][k].tobytes()]
        assert not differ, f"{name}: the final train state differs from the uninterrupted run's in {differ}"

    # Records and units: every episode (unit) exactly once, with the same token ids, log-probs,
    # tool calls and verdicts.
    for pattern, atol in spec.records.items():
        files = sorted(os.path.relpath(p, reference) for p in glob.glob(os.path.join(reference, pattern)))
        assert files and files == sorted(os.path.relpath(p, workdir) for p in glob.glob(os.path.join(workdir, pattern)))
        for name in files:
            a, b = (record_lines(os.path.join(w, name), _key) for w in (reference, workdir))
            assert sorted(a) == sorted(b), f"{name}: {sorted(set(a) ^ set(b))} missing or extra"
            differ = [i for i in a if not same_record(a[i], b[i], atol)]
            assert not differ, f"{name}: {differ} differ"
    for name in spec.files:
        with open(os.path.join(reference, name), "rb") as f, open(os.path.join(workdir, name), "rb") as g:
            assert f.read() == g.read(), f"{name} differs"

    initial = load_file(os.path.join(assets.model_dir, "model.safetensors"))
    for name in spec.exports:
        exported = {w: load_file(os.path.join(w, name, "model.safetensors")) for w in (reference, workdir)}
        assert any(not np.array_equal(exported[reference][k], initial[k]) for k in initial), f"{name}: not trained"
        assert sorted(exported[reference]) == sorted(exported[workdir])
        differ = [k for k in exported[reference] if exported[reference][k].tobytes() != exported[workdir][k].tobytes()]
        assert not differ, f"{name}: the exported policy differs in {differ}"

    # Every step logged, as the uninterrupted run logged it; a step logged again after a resume
    # logged the same.
    for stage, final in spec.checkpoints.items():
        repeats = {}
        rows = {w: logged_metrics(w, repeats=repeats if w == workdir else None, stage=stage)
                for w in (reference, workdir)}
        assert sorted(rows[reference]) == sorted(rows[workdir]) == list(range(1, final + 1))
        assert all(rows[reference][s] == rows[workdir][s] for s in rows[reference]), stage
        assert all(r == rows[workdir][s] for s, repeated in repeats.items() for r in repeated), stage
