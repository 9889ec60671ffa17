import json
import os
import platform
import subprocess
import sys

import pytest

from steprl_jax import malloc

_PROBE = ("from steprl_jax import malloc; malloc.reexec_with_huge_pages(); import json, os, sys; "
          "print(json.dumps([os.environ.get('GLIBC_TUNABLES'), os.getpid(), sys.argv[1:]]))")


def _run(env_changes: dict) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", malloc.OPT_OUT)}
    env.update(env_changes)
    proc = subprocess.Popen([sys.executable, "-c", _PROBE, "a", "--b=1"], env=env, stdout=subprocess.PIPE, text=True)
    tunables, pid, argv = json.loads(proc.communicate(timeout=60)[0])
    assert proc.returncode == 0
    assert pid == proc.pid  # replaced in place: a supervisor's SIGKILL still reaches it
    assert argv == ["a", "--b=1"]
    return tunables


def test_tunable_is_added_beside_others_and_replaces_an_old_value():
    assert malloc.with_huge_pages({})["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
    env = {"GLIBC_TUNABLES": "glibc.malloc.tcache_count=0:glibc.malloc.hugetlb=0", "X": "1"}
    assert malloc.with_huge_pages(env) == {"GLIBC_TUNABLES": "glibc.malloc.tcache_count=0:glibc.malloc.hugetlb=1",
                                           "X": "1"}


def test_only_linux_glibc_and_not_when_set_or_opted_out():
    assert malloc.wanted({}, "Linux", "glibc")
    assert not malloc.wanted({}, "Darwin", "")
    assert not malloc.wanted({}, "Linux", "")  # musl
    assert not malloc.wanted({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, "Linux", "glibc")  # the user's choice
    assert not malloc.wanted({malloc.OPT_OUT: "0"}, "Linux", "glibc")


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_entry_point_reexecutes_itself_once_with_the_tunable():
    assert _run({}) == "glibc.malloc.hugetlb=1"
    assert _run({"GLIBC_TUNABLES": "glibc.malloc.tcache_count=7"}) == "glibc.malloc.tcache_count=7:glibc.malloc.hugetlb=1"
    assert _run({malloc.OPT_OUT: "0"}) is None
