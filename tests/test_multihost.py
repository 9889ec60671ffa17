"""Two processes are one: real `python -m steprl_jax.main` processes forming a `jax.distributed`
cluster over 127.0.0.1 (4 virtual CPU devices each, the trainer's mesh data=2 x fsdp=4 over all 8)
give the same rollouts, losses and final parameters as one process with 8 devices and the same
mesh: two iterations of GRPO, two SWiRL stage-2 updates. And a killed process fails the run with
a clear error, not a hang.

Judges and reward models are stub endpoints on 127.0.0.1 whose answers depend only on the
request, so both set-ups see the same rewards.
"""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from safetensors.numpy import load_file

from resume_helpers import logged_metrics
from rl_helpers import TOOLS_FLAG, VerdictServer
from steprl_jax.models import export_hf
from swirl_helpers import RewardServer, hand_units, smol_tokenizer, tiny_config, tiny_model, unused_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MESH = ["--config.mesh.data=2", "--config.mesh.fsdp=-1"]
TOL = 1e-5
# The two set-ups reduce gradients in different orders, and Adam's first step turns those last-bit
# differences into parameter differences of up to ~1% of the learning rate where a gradient is
# near zero (7e-6 at lr 1e-3, measured). The next rollouts sample at temperature 1 from a tiny
# random model, nearly uniform over 49,152 tokens (CDF steps ~2e-5 apart), so at lr 1e-3 a
# draw could land on the other side of a step: a small learning rate keeps the two runs' draws alike.
LR = 1e-5
PARAM_TOL = LR / 20  # a run that sampled or trained differently moves parameters by ~LR


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("multihost")
    tokenizer = smol_tokenizer()
    model_dir = export_hf(tiny_model(tokenizer, seed=5), tokenizer, str(folder / "model"))
    verdicts, rewards = VerdictServer(), RewardServer()
    yield tokenizer, model_dir, verdicts, rewards
    verdicts.close()
    rewards.close()


def _env(devices: int) -> dict:
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                     if not f.startswith("--xla_force_host_platform_device_count"))
    return {**os.environ, "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={devices}".strip()}


def _cluster(port: int, process: int, heartbeat_s: int = 10) -> list:
    return ["--config.distributed.mode=on", f"--config.distributed.coordinator_address=127.0.0.1:{port}",
            "--config.distributed.num_processes=2", f"--config.distributed.process_id={process}",
            "--config.distributed.initialization_timeout_s=60", f"--config.distributed.heartbeat_timeout_s={heartbeat_s}"]


def _run_one_and_two(args: list, workdirs: dict, logs, timeout_s: float = 600) -> None:
    """`args(workdir)`: the command; runs it as one process (8 devices) and as a two-process cluster."""
    one = subprocess.Popen(args(workdirs["one"]) + MESH, cwd=ROOT, env=_env(8),
                           stdout=open(logs / "one.log", "w"), stderr=subprocess.STDOUT)
    assert one.wait(timeout=timeout_s) == 0, (logs / "one.log").read_text()[-3000:]
    port = unused_port()
    procs = [subprocess.Popen(args(workdirs["two"]) + MESH + _cluster(port, k), cwd=ROOT, env=_env(4),
                              stdout=open(logs / f"two{k}.log", "w"), stderr=subprocess.STDOUT) for k in range(2)]
    try:
        for k, proc in enumerate(procs):
            assert proc.wait(timeout=timeout_s) == 0, (logs / f"two{k}.log").read_text()[-3000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    assert "process 1 of 2, 4 local / 8 global devices" in (logs / "two1.log").read_text()


def _close(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for step in a:
        for key, value in a[step].items():
            assert key in b[step], (what, step, key)
            if isinstance(value, str):
                assert value == b[step][key], (what, step, key)
                continue
            assert abs(value - b[step][key]) <= TOL * max(1.0, abs(value)), (what, step, key, value, b[step][key])


def _same_params(path_a: str, path_b: str) -> None:
    a, b = load_file(path_a), load_file(path_b)
    assert a.keys() == b.keys()
    worst = max(float(np.max(np.abs(a[k] - b[k]))) for k in a)
    assert worst <= PARAM_TOL, worst


def _rl_command(model_dir, base_url):
    return lambda workdir: [
        sys.executable, "-m", "steprl_jax.main", "--config=configs/portool_toolworld.py", "--config.algorithm=grpo",
        f"--config.model.source={model_dir}", f"--config.workdir={workdir}", "--config.progress=False",
        "--config.task.num_tasks=4", "--config.rollout.max_new_tokens=12", "--config.rollout.max_steps=2",
        "--config.rollout.max_context=2048", "--config.rollout.tree.n=4", "--config.rollout.temperature=1.0",
        "--config.rl.iterations=2", "--config.rl.queries_per_iteration=2", "--config.rl.eval_every=2",
        "--config.rl.eval.num_tasks=0", f"--config.optimizer.learning_rate={LR}",
        "--config.optimizer.max_grad_norm=0.0", "--config.judge.outcome.kind=http",
        f"--config.judge.outcome.base_url={base_url}", "--config.judge.outcome.model=stub",
        "--config.judge.outcome.retries=0", TOOLS_FLAG]


def _trees(folder: str) -> dict:
    out = {}
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name)) as f:
            for line in f:
                tree = json.loads(line)
                out[tree["id"]] = tree
    return out


def test_grpo_on_two_processes_equals_one_process(setup, tmp_path):
    tokenizer, model_dir, verdicts, _ = setup
    workdirs = {name: str(tmp_path / name) for name in ("one", "two")}
    _run_one_and_two(_rl_command(model_dir, verdicts.base_url), workdirs, tmp_path)
    one, two = workdirs["one"], workdirs["two"]
    # each process wrote its own rollouts; together they are the one process's, token for token
    assert sorted(os.listdir(os.path.join(two, "rollouts"))) == [
        f"iter_0000{i}.process{p}.jsonl" for i in range(2) for p in range(2)]
    trees_one, trees_two = _trees(os.path.join(one, "rollouts")), _trees(os.path.join(two, "rollouts"))
    assert trees_one.keys() == trees_two.keys() and len(trees_one) == 4
    for tree_id, tree in trees_one.items():
        steps = lambda t: [[n["step"]["action_ids"], n["step"].get("observation_ids")] for n in t["nodes"]]
        assert steps(tree) == steps(trees_two[tree_id]), tree_id
        assert tree["leaf_outcomes"] == trees_two[tree_id]["leaf_outcomes"], tree_id
    a, b = logged_metrics(one), logged_metrics(two)
    assert sorted(a) == [1, 2]
    for step in a:  # a rate of each process's own share left out
        a[step] = {k: v for k, v in a[step].items() if k != "tokens_per_s"}
        b[step] = {k: v for k, v in b[step].items() if k != "tokens_per_s"}
    assert any(abs(a[s]["grad_norm"]) > 0 for s in a)  # the groups had different rewards
    _close(a, b, "rl metrics")
    _same_params(os.path.join(one, "policy", "rl", "model.safetensors"),
                 os.path.join(two, "policy", "rl", "model.safetensors"))


def test_swirl_stage2_on_two_processes_equals_one_process(setup, tmp_path):
    from steprl_jax.algorithms.swirl import read_settings
    from steprl_jax.data.units import write_units

    tokenizer, model_dir, _, rewards = setup
    workdirs = {name: str(tmp_path / name) for name in ("one", "two")}
    for workdir in workdirs.values():  # the filtered units stage 2 reads (two trajectories of two steps)
        config = tiny_config(workdir)
        write_units(read_settings(config).units_path, hand_units(config, tokenizer))

    def command(workdir):
        return [sys.executable, "-m", "steprl_jax.main", "--config=configs/swirl_arithmetic.py",
                f"--config.model.source={model_dir}", f"--config.workdir={workdir}", "--config.progress=False",
                "--config.stages=train", "--config.task.num_tasks=2", "--config.rollout.max_new_tokens=16",
                "--config.rollout.max_steps=2", "--config.rollout.max_context=1024",
                "--config.swirl.samples_per_question=2", "--config.swirl.filter=none",
                "--config.swirl.train.group_size=2", "--config.swirl.train.batch_size=2",
                "--config.swirl.train.updates=2", "--config.swirl.train.save_every=1",
                f"--config.optimizer.learning_rate={LR}", "--config.optimizer.max_grad_norm=0.0",
                "--config.reward.kind=http", "--config.reward.scale=graded",
                f"--config.reward.base_url={rewards.base_url}", "--config.reward.model=stub",
                "--config.reward.retries=0"]

    _run_one_and_two(command, workdirs, tmp_path)
    a, b = logged_metrics(workdirs["one"]), logged_metrics(workdirs["two"])
    assert sorted(a) == [1, 2]
    assert any(a[s]["advantage_abs"] > 0 for s in a)
    _close(a, b, "swirl metrics")
    _same_params(os.path.join(workdirs["one"], "policy", "swirl", "model.safetensors"),
                 os.path.join(workdirs["two"], "policy", "swirl", "model.safetensors"))


def test_a_killed_process_fails_the_run_with_a_clear_error(setup, tmp_path):
    tokenizer, model_dir, verdicts, _ = setup
    command = _rl_command(model_dir, verdicts.base_url)
    port = unused_port()
    workdir = str(tmp_path / "killed")
    logs = [tmp_path / f"p{k}.log" for k in range(2)]
    procs = [subprocess.Popen(command(workdir) + MESH + _cluster(port, k, heartbeat_s=5) + ["--config.rl.iterations=50"],
                              cwd=ROOT, env=_env(4), stdout=open(logs[k], "w"), stderr=subprocess.STDOUT)
             for k in range(2)]
    try:
        deadline = time.time() + 300
        while not os.path.exists(os.path.join(workdir, "metrics.jsonl")) and time.time() < deadline:
            assert procs[0].poll() is None and procs[1].poll() is None, logs[0].read_text()[-3000:]
            time.sleep(0.05)
        assert os.path.exists(os.path.join(workdir, "metrics.jsonl")), "the cluster trained no iteration"
        procs[1].send_signal(signal.SIGKILL)
        code = procs[0].wait(timeout=120)  # a hang runs into this timeout (the test fails)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    text = logs[0].read_text()
    assert code != 0, text[-3000:]
    # the survivor says which task went away (JAX's coordination service names it)
    assert "task" in text.lower() and ("heartbeat" in text.lower() or "unavailable" in text.lower()
                                       or "connection" in text.lower()), text[-3000:]
