"""Test set-up: 8 virtual CPU devices and unoptimised XLA:CPU code, forced once before JAX initialises."""
import os

# --xla_backend_optimization_level=0: the tests compile hundreds of programs for tiny models, whose
# run time is small; without LLVM's optimisations XLA:CPU compiles them in about half the time
# (a train step of the tool world's tiny policy: 6.0 s against 11.7 s); with LLVM's default (-O2)
# the real SmolLM2 sampling tests and three tool-world RL runs took 132 s against 119 s. Set
# before JAX starts, so the test processes and the subprocesses they start (which inherit the
# environment) share it.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

# One persistent compilation cache for the session and the subprocesses it starts: the many tiny
# models and real-process tests compile the same programs again and again. The process that makes
# it (pytest's, whose xdist workers inherit the variable) removes it at exit: a cache left behind
# by every run fills the disk.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="steprl_jax_xla_cache_")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

# The longest test files first (seconds over all their tests, 2-core host, `--durations=0`): with
# `--dist loadfile` each worker takes whole files, and a long file handed out last leaves the other
# worker idle at the end of the run. launch/test.sh passes `--no-loadscope-reorder` so that xdist
# keeps this order (by default it sorts files by their number of tests). Files not listed follow
# in their usual order; re-measure when a file's cost changes much.
LONGEST_FILES_FIRST = (
    "test_rollout.py",          # 299 s
    "test_rl_resume.py",        # 258
    "test_multihost.py",        # 179
    "test_kill_anywhere.py",    # 170
    "test_sampling.py",         # 164
    "test_mesh_load.py",        # 109
    "test_train_step.py",       # 103
    "test_models_smollm2.py",   # 92 (with the sampler tests: one transformers reference)
    "test_async_rl.py",         # 91
    "test_main_job.py",         # 76
    "test_flow_grpo.py",        # 70
    "test_swirl.py",            # 68
    "test_pack.py",             # 65
    "test_reproduce.py",        # 61
    "test_tree_attention.py",   # 53
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's tests keep their order
