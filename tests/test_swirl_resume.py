"""SWiRL stage 2 killed with SIGKILL after a checkpoint and resumed ends with the same parameters,
bit for bit, as an uninterrupted run (real `python -m steprl_jax.main` processes).

The policy is a tiny random model exported with `export_hf` (the processes load it from disk); the
reward model is a stub endpoint on 127.0.0.1 whose graded score is a hash of the request, so the
rewards are the same in every process and the advantages are not all zero.
"""
import os
import subprocess

import numpy as np
import pytest
from safetensors.numpy import load_file

from steprl_jax.algorithms import swirl
from steprl_jax.data.units import write_units
from steprl_jax.models import export_hf
from resume_helpers import checkpoint_steps, logged_metrics, straight_killed_resumed
from swirl_helpers import (HTTP_REWARD_CONFIG, RewardServer, hand_units, smol_tokenizer, stage2_command, tiny_config,
                           tiny_model)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UPDATES = 4


@pytest.fixture(scope="module")
def server():
    stub = RewardServer()
    yield stub
    stub.close()


def test_killed_stage2_resumes_bit_identically(tmp_path, server):
    tokenizer = smol_tokenizer()
    model_dir = export_hf(tiny_model(tokenizer, seed=11), tokenizer, str(tmp_path / "model"))
    config_path = tmp_path / "swirl_http_reward.py"
    config_path.write_text(HTTP_REWARD_CONFIG)
    workdirs = {name: str(tmp_path / name) for name in ("straight", "killed")}
    units = hand_units(tiny_config(tmp_path / "unused"), tokenizer)
    for workdir in workdirs.values():
        write_units(swirl.units_path(tiny_config(workdir)), units)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    logs = {name: open(tmp_path / f"{name}.log", "w") for name in ("straight", "killed", "resumed")}

    def start(name, workdir):
        return subprocess.Popen(stage2_command(config_path, model_dir, workdir, server.base_url, UPDATES), cwd=ROOT,
                                env=env, stdout=logs[name], stderr=subprocess.STDOUT)

    try:
        left = straight_killed_resumed(
            start, lambda w: checkpoint_steps(w, "swirl"), workdirs,
            lambda name: (tmp_path / f"{name}.log").read_text(),
            after_kill=lambda w: not os.path.exists(os.path.join(w, "policy", "swirl"))
            or pytest.fail("exported early"))
    finally:
        for f in logs.values():
            f.close()
    assert left and max(left) < UPDATES, left  # interrupted after a checkpoint, before the end
    assert f"swirl: resumed at update {max(left)}" in (tmp_path / "resumed.log").read_text()

    final = {name: load_file(os.path.join(w, "policy", "swirl", "model.safetensors")) for name, w in workdirs.items()}
    initial = load_file(os.path.join(model_dir, "model.safetensors"))
    assert sorted(final["straight"]) == sorted(final["killed"]) == sorted(initial)
    assert any(not np.array_equal(final["straight"][k], initial[k]) for k in initial)  # it trained
    differ = [k for k in initial if final["straight"][k].dtype != final["killed"][k].dtype
              or final["straight"][k].tobytes() != final["killed"][k].tobytes()]
    assert not differ, f"resumed parameters differ from the uninterrupted run's in {differ}"
    # and so does everything logged after the resume point (rewards, losses, ratios)
    straight_rows, resumed_rows = logged_metrics(workdirs["straight"]), logged_metrics(workdirs["killed"])
    assert sorted(straight_rows) == sorted(resumed_rows) == list(range(1, UPDATES + 1))
    assert all(straight_rows[s] == resumed_rows[s] for s in straight_rows)
