"""Fail points (steprl_jax/failpoints.py): the armed pass kills the process with SIGKILL, other
passes and unarmed points do nothing; a bad setting is an error naming it. The jobs' kill points
are exercised end to end by test_kill_anywhere.py."""
import os
import signal
import subprocess
import sys

import pytest

from steprl_jax import failpoints

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = """
from steprl_jax import failpoints
for i in range(1, 4):
    print("pass", i, flush=True)
    failpoints.hit("a.b")
    failpoints.hit("other")
print("end", flush=True)
"""


def _run(kill_at: str):
    env = {**os.environ, failpoints.ENV: kill_at}
    return subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)


def test_the_armed_pass_kills_the_process():
    out = _run("a.b:2")
    assert out.returncode == -signal.SIGKILL
    assert out.stdout.split("\n")[:-1] == ["pass 1", "pass 2"]
    assert "fail point a.b:2: SIGKILL" in out.stderr


def test_unarmed_or_never_reached_points_do_nothing():
    for kill_at in ("", "a.b:4", "elsewhere:1"):
        out = _run(kill_at)
        assert out.returncode == 0 and out.stdout.endswith("end\n"), (kill_at, out.stderr)


def test_parse():
    assert failpoints.parse("a:3, b ,") == {"a": 3, "b": 1}
    assert failpoints.parse("") == {}
    for bad in ("a:x", "a:0"):
        with pytest.raises(ValueError, match=failpoints.ENV):
            failpoints.parse(bad)
