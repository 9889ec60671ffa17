"""The entry points' re-exec with the huge-page malloc tunable: once, then the command runs."""
import os
import subprocess
import sys

import pytest

SCRIPT = ("import os; from steprl_jax.host import reexec_with_huge_pages; "
          "print('start', os.environ.get('GLIBC_TUNABLES'), flush=True); "
          "reexec_with_huge_pages(); print('run', os.environ.get('GLIBC_TUNABLES'))")


def _run(**env_changes):
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "STEPRL_NO_REEXEC")}
    env.update(env_changes)
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                         check=True, timeout=120)
    return out.stdout.split("\n")[:-1]


@pytest.mark.skipif(sys.platform != "linux", reason="glibc tunable")
def test_reexecutes_once_with_the_tunable_added():
    assert _run() == ["start None", "start glibc.malloc.hugetlb=1", "run glibc.malloc.hugetlb=1"]
    # Other tunables are kept; an already present one means no re-exec.
    assert _run(GLIBC_TUNABLES="glibc.malloc.check=0") == [
        "start glibc.malloc.check=0", "start glibc.malloc.check=0:glibc.malloc.hugetlb=1",
        "run glibc.malloc.check=0:glibc.malloc.hugetlb=1"]
    assert _run(GLIBC_TUNABLES="glibc.malloc.hugetlb=0") == [
        "start glibc.malloc.hugetlb=0", "run glibc.malloc.hugetlb=0"]
    assert _run(STEPRL_NO_REEXEC="1") == ["start None", "run None"]
