"""Every online algorithm trains 2 iterations end to end (real `python -m steprl_jax.main`
processes on the tool world, or on the built-in arithmetic with the Python sandbox for the code
and flow formats; a tiny random policy exported to disk, a verdict endpoint on 127.0.0.1), and a
run killed with SIGKILL after its first checkpoint and resumed ends with the same parameters, bit
for bit, and the same logged metrics as the uninterrupted run. Here one killed case per loop
(PORTool synchronous, and PORTool with rollouts one version ahead) and an end-to-end run of a
method per rollout schedule, of DAPO's extra sampling rounds and of Flow-GRPO (AgentFlow's planner
rows with the frozen base model and the sandbox); `launch/rl_resume_matrix.sh` kills and resumes
every registered method, Flow-GRPO included. GRPO's kill and
resume are also tested in test_kill_anywhere.py (its chain); GRPO_fm and ARPO_fm differ from GRPO
and ARPO in their rewards only (tests/test_rl_builders.py).

The verdict stub answers true / false / unable_to_answer from a hash of the request, so rewards
are the same in every process and the advantages are not all zero. Compiled programs are shared
between the processes (and with the other files' runs of the same sizes) through the session's
persistent compilation cache (tests/conftest.py).
"""
import json
import os
import subprocess

import numpy as np
import pytest
from safetensors.numpy import load_file

from resume_helpers import checkpoint_steps, logged_metrics, straight_killed_resumed
from rl_helpers import VerdictServer, rl_command
from steprl_jax.algorithms.base import ALGORITHMS as REGISTERED
from steprl_jax.models import export_hf
from swirl_helpers import smol_tokenizer, tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FULL = os.environ.get("STEPRL_JAX_RESUME_MATRIX") == "1"  # launch/rl_resume_matrix.sh
# GRPO's end-to-end run, killed and resumed, is test_kill_anywhere.py's chain (the same command)
ALGORITHMS = tuple(REGISTERED) if FULL else ("portool", "dapo", "arpo", "gigpo", "tree_grpo", "flow_grpo")
KILLED = ALGORITHMS if FULL else ("portool",)  # the others: an uninterrupted run only
# Asynchronous rollouts one version behind the learner (algorithms/async_loop.py): deterministic,
# so a killed run resumes bit for bit too, its checkpoint holding the iteration rolled out ahead.
ASYNC = "portool+async"
ASYNC_FLAGS = ["--config.rl.asynchronous.max_staleness=1"]
# The code formats: a random policy never boxes an answer (one verdict for a whole group: zero
# advantages, rl_helpers.FORMAT_FLAGS) and writes only void turns, which SimpleTIR masks whole. Their
# updates change nothing; resume is checked on the rest (records, metrics, optimizer state, RNG).
NO_SIGNAL = ("torl", "simpletir")
ITERATIONS = 2
TIMEOUT_S = 400  # a run's wall-clock limit


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    stub = VerdictServer()
    folder = tmp_path_factory.mktemp("rl_resume")
    tokenizer = smol_tokenizer()
    model_dir = export_hf(tiny_model(tokenizer, seed=11), tokenizer, str(folder / "model"))
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}  # and the session's compilation cache (conftest.py)
    yield stub, model_dir, env
    stub.close()


@pytest.mark.parametrize("case", ALGORITHMS + (ASYNC,))
def test_trains_end_to_end_and_killed_runs_resume_bit_identically(case, setup, tmp_path):
    stub, model_dir, env = setup
    algorithm, extra = ("portool", ASYNC_FLAGS) if case == ASYNC else (case, [])
    workdirs = {name: str(tmp_path / name) for name in ("straight", "killed")}
    logs = {name: open(tmp_path / f"{name}.log", "w") for name in ("straight", "killed", "resumed")}

    def start(name, workdir):
        # held-out evaluation in one run (the loop's code is the same for every algorithm)
        command = rl_command(algorithm, model_dir, workdir, stub.base_url, ITERATIONS,
                             eval_tasks=2 if case == "portool" else 0) + extra
        return subprocess.Popen(command, cwd=ROOT, env=env, stdout=logs[name], stderr=subprocess.STDOUT)

    try:
        if case in KILLED + (ASYNC,):
            left = straight_killed_resumed(start, lambda w: checkpoint_steps(w, "rl"), workdirs,
                                           lambda name: (tmp_path / f"{name}.log").read_text(), timeout_s=TIMEOUT_S)
        else:
            assert start("straight", workdirs["straight"]).wait(timeout=TIMEOUT_S) == 0, \
                (tmp_path / "straight.log").read_text()[-3000:]
    finally:
        for f in logs.values():
            f.close()
    if case in KILLED + (ASYNC,):
        assert left == [1], left  # interrupted after the first iteration's checkpoint
        assert "rl: resumed at iteration 1" in (tmp_path / "resumed.log").read_text()
    if case == ASYNC:  # iteration 1 was sampled by the initial policy (version 0), one version behind
        with open(os.path.join(workdirs["straight"], "rollouts", "iter_00001.jsonl")) as f:
            versions = {v for t in map(json.loads, f) for n in t["nodes"] for v in n["step"]["action_versions"]}
        assert versions == {0}
        assert "1 iterations rolled out ahead" in (tmp_path / "resumed.log").read_text()

    # end to end: evaluations before and after, records per iteration, TensorBoard, the export
    w = workdirs["straight"]
    for name in ("rollouts/iter_00000.jsonl", "rollouts/iter_00001.jsonl", "policy/rl/model.safetensors",
                 "summary.json"):
        assert os.path.exists(os.path.join(w, name)), name
    if case == "portool":
        for it in (0, 2):
            with open(os.path.join(w, "eval", f"iter_{it:05d}.metrics.json")) as f:
                assert set(json.load(f)["ci"]) >= {"accuracy", "tool_steps", "unanswerable", "format_reward"}
    assert any(n.startswith("events.out.tfevents") for n in os.listdir(os.path.join(w, "tb", "rl")))
    with open(os.path.join(w, "rollouts", "iter_00000.jsonl")) as f:
        trees = [json.loads(line) for line in f]
    assert len(trees) >= 2 and all(len([n for n in t["leaf_terminations"]]) == 4 for t in trees)

    skip = ("time", "tokens_per_s")
    straight_rows = logged_metrics(w, skip)
    assert sorted(straight_rows) == list(range(1, ITERATIONS + 1))
    for row in straight_rows.values():  # the first update after sampling: the trainer agrees with the sampler
        if algorithm in NO_SIGNAL and row.get("skipped"):
            continue  # SimpleTIR drops every group whose rewards are all equal: no update
        assert row["first_ratio"] == pytest.approx(1.0, abs=1e-5) and row["first_clipfrac"] == 0.0
        if algorithm not in NO_SIGNAL:
            assert row["advantage_abs"] > 0  # not a vacuous update
    final = load_file(os.path.join(w, "policy", "rl", "model.safetensors"))
    initial = load_file(os.path.join(model_dir, "model.safetensors"))
    assert sorted(final) == sorted(initial)
    if algorithm not in NO_SIGNAL:
        assert any(not np.array_equal(final[k], initial[k]) for k in initial)  # it trained
    if case == ASYNC:
        assert [straight_rows[i]["staleness"] for i in (1, 2)] == [0.0, 1.0]
        assert all(row["stale_dropped"] == 0 and 0 < row["is_weight_mean"] <= 2.0 for row in straight_rows.values())
    if case not in KILLED + (ASYNC,):
        return
    resumed_rows = logged_metrics(workdirs["killed"], skip)
    assert sorted(resumed_rows) == sorted(straight_rows)
    assert all(straight_rows[s] == resumed_rows[s] for s in straight_rows)
    resumed = load_file(os.path.join(workdirs["killed"], "policy", "rl", "model.safetensors"))
    differ = [k for k in initial if final[k].tobytes() != resumed[k].tobytes()]
    assert not differ, f"resumed parameters differ from the uninterrupted run's in {differ}"
