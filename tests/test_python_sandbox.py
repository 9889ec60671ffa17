"""The Python sandbox tool: ordinary snippets give ToRL-style observations, and hostile snippets are
contained. Each hostile case asserts the exact containment (what the snippet saw, what exists on the
host afterwards), the calling process survives it, and a snippet run right after it works.

Most cases run under the strongest isolation this host allows (`isolation()`: on a Linux host with
util-linux, as root, namespaces + a private root + uid 65534); the cases the audit hook alone is
meant to stop also run with `isolation="process"` (rlimits + the hook, no namespaces), so that each
layer is shown to hold on its own. Autouse: no process of uid 65534, no child of this process and no
scratch folder is left behind by any test.
"""
import dataclasses
import glob
import os
import resource
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import pytest

from steprl_jax.tools.protocol import MALFORMED_ARGUMENTS
from steprl_jax.tools.python_sandbox import (
    _OUTER_GRACE_S, NOBODY, Isolation, SandboxSettings, _which, isolation, observation, python_tool, run_python)
from steprl_jax.tools.registry import ToolRegistry

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICK = SandboxSettings(wall_timeout_s=10.0, cpu_s=5)  # ordinary snippets: generous, they end at once
HOSTILE = SandboxSettings(wall_timeout_s=2.0, cpu_s=1)
PROCESS = SandboxSettings(wall_timeout_s=2.0, cpu_s=1, isolation="process")
BOTH = pytest.mark.parametrize("settings", [HOSTILE, PROCESS], ids=["strongest", "process-only"])


def _namespaces_work() -> bool:
    try:
        return subprocess.run(["unshare", "-U", "-r", "-n", "-p", "-f", "--mount-proc", "true"],
                              capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


NAMESPACES = _namespaces_work()
STRONG = isolation(HOSTILE)
needs_namespaces = pytest.mark.skipif(not STRONG.namespaces, reason="no namespaces on this host")
needs_uid_drop = pytest.mark.skipif(STRONG.uid is None, reason="not root: no uid drop")


def _uid_of(pid: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("Uid:"))
    except (OSError, StopIteration, ValueError):
        return None


def _parents() -> dict[int, int]:
    """pid -> parent pid of every live process (a zombie has ended: not listed)."""
    parents = {}
    for p in os.listdir("/proc"):
        try:
            with open(f"/proc/{p}/stat") as f:
                state, parent = f.read().rsplit(")", 1)[1].split()[:2]
            if state != "Z":
                parents[int(p)] = int(parent)
        except (OSError, IndexError, ValueError):
            pass  # ended meanwhile, or not a process
    return parents


def _wait_until_ended(pids) -> None:
    """Block until each of `pids` has exited (a pidfd becomes readable then): no clock involved."""
    for pid in pids:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue  # already gone
        try:
            poll = select.poll()
            poll.register(fd, select.POLLIN)
            poll.poll()
        finally:
            os.close(fd)


def _cwd(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return ""


def _ours(pid: int, parents: dict[int, int], scratch_root: str) -> bool:
    # Another test process (the ToRL, SimpleTIR and flow tests) may run sandboxes meanwhile. A process is
    # this test's when it descends from this process, or from a sandbox started in this test's scratch
    # root (each starts in its scratch folder): that is how one that outlived its caller is still known.
    while pid > 1:
        if pid == os.getpid() or _cwd(pid).startswith(scratch_root + os.sep):
            return True
        pid = parents.get(pid, 0)
    return False


def _leftovers() -> tuple[set, set, set]:
    scratch_root = tempfile.gettempdir()  # this test's own (the autouse fixture)
    parents = _parents()
    nobody = {p for p in parents if _uid_of(str(p)) == NOBODY and _ours(p, parents, scratch_root)}
    children = {p for p, parent in parents.items() if parent == os.getpid()}
    scratch = set(glob.glob(os.path.join(scratch_root, "steprl_sandbox_*")))
    return nobody, children, scratch


@pytest.fixture(autouse=True)
def nothing_left_behind(monkeypatch, tmp_path_factory):
    # The sandboxes' scratch folders go to a folder of this test's own (traversable by uid 65534, the
    # uid-drop mode's working folder is in it), so that only this test's are counted.
    tmp_path_factory.getbasetemp()  # pytest's own folder stays where it was (it is made on first use)
    scratch_root = tempfile.mkdtemp(prefix="sandbox_test_")
    os.chmod(scratch_root, 0o711)
    monkeypatch.setattr(tempfile, "tempdir", scratch_root)
    before = _leftovers()
    yield
    # A killed namespace's init is reaped by the host's init, not by us: wait for the processes to
    # end (how soon they do is timed in benchmarks/sandbox.py, not here).
    now = _leftovers()
    _wait_until_ended((now[0] - before[0]) | (now[1] - before[1]))
    now = _leftovers()
    extra = [now[i] - before[i] for i in range(3)]
    shutil.rmtree(scratch_root, ignore_errors=True)
    assert extra == [set(), set(), set()], f"left behind (uid {NOBODY} pids, children, scratch): {extra}"


def _still_works(settings: SandboxSettings) -> None:
    result = run_python("print('alive')", dataclasses.replace(settings, wall_timeout_s=10.0))
    assert (result.status, result.stdout) == ("ok", "alive\n"), result


# ------------------------------------------------------------------ isolation on this host
@pytest.mark.skipif(not (NAMESPACES and os.geteuid() == 0), reason="needs root and working namespaces")
def test_the_strongest_isolation_is_active_where_root_can_make_namespaces():
    assert STRONG == Isolation(("mount", "net", "pid", "ipc", "uts"), private_root=True, uid=NOBODY)
    assert "uid 65534" in STRONG.describe() and "net" in STRONG.describe()
    assert isolation(PROCESS).namespaces == ()


@needs_namespaces
def test_inside_the_namespaces_only_the_private_root_exists(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("s")
    # The repo's own files (its folder may exist inside as a mount point when the venv lives in it).
    README = os.path.join(ROOT, "README.md")
    # os.stat and os.mkfifo raise no audit event: what they see is the kernel's view alone.
    code = f"""
import os
print(os.getuid(), os.getgid(), os.getgroups(), os.getppid(), os.getcwd(), sorted(os.environ))
for path in [{str(secret)!r}, {README!r}, '/root/.profile', '/proc/{os.getpid()}', '/home', '/var', '/tmp']:
    print(path, os.path.exists(path))
for path in ['/x', '/usr/x', {os.path.join(sys.prefix, 'x')!r}, '/tmp/fifo']:
    try:
        os.mkfifo(path)
        print(path, 'made')
    except OSError as err:
        print(path, err.strerror)
"""
    result = run_python(code, QUICK)
    assert result.status == "ok", result
    uid = STRONG.uid if STRONG.uid is not None else 0
    assert result.stdout.splitlines() == [
        f"{uid} {uid} [] 1 /tmp ['HOME', 'LANG', 'MKL_NUM_THREADS', 'OMP_NUM_THREADS', 'OPENBLAS_NUM_THREADS', 'PATH']",
        f"{secret} False", f"{README} False", "/root/.profile False", f"/proc/{os.getpid()} False", "/home False",
        "/var False",
        "/tmp True",
        "/x Read-only file system", "/usr/x Read-only file system",
        f"{os.path.join(sys.prefix, 'x')} Read-only file system", "/tmp/fifo made"]


# ------------------------------------------------------------------ ordinary snippets
@pytest.mark.parametrize("code, status, stdout, error", [
    ("print(6 * 7)", "ok", "42\n", None),
    ("x = 2 ** 100\nprint(x % 97)", "ok", f"{2 ** 100 % 97}\n", None),
    ("print('héllo 世界 🎉')", "ok", "héllo 世界 🎉\n", None),
    ("print('\\ud800')", "ok", "?\n", None),  # a lone surrogate cannot reach a tokenizer
    ("def f():\n    raise ValueError('bad input')\nprint('before')\nf()", "error", "before\n", "ValueError: bad input"),
    ("1 / 0", "error", "", "ZeroDivisionError: division by zero"),
    ("print(1", "error", "", "SyntaxError: '(' was never closed"),
    ("import sys\nprint('bye')\nsys.exit(0)", "ok", "bye\n", None),
    ("import sys\nsys.exit(3)", "error", "", "SystemExit: 3"),
    ("import sys\nprint('to stderr', file=sys.stderr)", "ok", "to stderr\n", None),
    ("", "ok", "", None),
])
def test_ordinary_snippets(code, status, stdout, error):
    result = run_python(code, QUICK)
    assert (result.status, result.stdout, result.error) == (status, stdout, error), result
    # (how long a call takes, result.duration_s, is benchmarks.sandbox's: sandbox / bare ratio)
    assert result.final_answer is None


def test_final_answer_is_a_builtin_and_the_last_call_wins():
    result = run_python("final_answer(41)\nprint('working')\nfinal_answer(6 * 7)", QUICK)
    assert (result.status, result.stdout, result.final_answer) == ("ok", "working\n", "42")
    assert observation(result) == "working\nFinal answer: 42"


def test_output_past_the_cap_is_cut_with_a_marker():
    result = run_python("print('a' * 2500)", QUICK)
    assert result.stdout == "a" * 2000 + "\n... [output truncated: 501 more characters]"


def test_numpy_and_sympy_import_under_the_default_limits():
    pytest.importorskip("numpy")
    pytest.importorskip("sympy")
    code = ("import numpy as np, sympy\nx = sympy.symbols('x')\n"
            "print(np.linalg.solve(np.eye(2) * 2, np.ones(2)).tolist(), sympy.solve(x**2 - 4, x))")
    result = run_python(code, SandboxSettings(wall_timeout_s=30.0))  # the default 1 GiB, 5 s of CPU
    assert (result.status, result.stdout) == ("ok", "[0.5, 0.5] [-2, 2]\n"), result


def test_code_that_is_not_a_string_is_a_failed_result():
    result = run_python(5, QUICK)  # type: ignore[arg-type]
    assert result.status == "failed" and "string" in result.error


# ------------------------------------------------------------------ hostile snippets: processes
@BOTH
@pytest.mark.parametrize("code", [
    "import os\nwhile True:\n    os.fork()",
    "import subprocess\nwhile True:\n    subprocess.Popen(['sh', '-c', ':'])",
    "import os\nos.system('sleep 100 &')",
    "import os\nos.execv('/bin/sh', ['sh', '-c', 'sleep 100'])",
    "import os\nos.posix_spawn('/bin/sleep', ['sleep', '100'], {})",
    "import os\nos.forkpty()",
    "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        time.sleep(100)",
])
def test_fork_bombs_and_new_processes_are_refused(settings, code):
    result = run_python(code, settings)
    assert result.status == "error" and result.error.startswith("PermissionError: sandbox:"), result
    _still_works(settings)


@needs_uid_drop
def test_a_fork_past_the_audit_hook_meets_the_process_limit():
    # _posixsubprocess raises no audit event: only RLIMIT_NPROC (0 for uid 65534) stops it. A daemon
    # (setsid + sleep) would be left behind if the fork went through.
    code = """
import _posixsubprocess, os
args = [b'/bin/sh', b'-c', b'sleep 100 &']
try:
    _posixsubprocess.fork_exec(args, [b'/bin/sh'], True, (), None, None, -1, -1, -1, -1, -1, -1,
                               *os.pipe(), False, True, -1, None, None, None, -1, None, False)
    print('forked')
except OSError as err:
    print(type(err).__name__, err.strerror)
import threading
try:
    threading.Thread(target=print).start()
except RuntimeError as err:
    print(err)
"""
    result = run_python(code, HOSTILE)
    assert result.stdout == "BlockingIOError Resource temporarily unavailable\ncan't start new thread\n", result


@BOTH
def test_memory_hogs_get_memory_error(settings):
    # Zero-filling up to the 1 GiB limit can take over a CPU second on a loaded host: the CPU limit
    # is raised here so that only the memory limit can stop these snippets.
    roomy = dataclasses.replace(settings, cpu_s=20, wall_timeout_s=60.0)
    for code in ("x = bytearray(10 * 2**30)", "x = []\nwhile True:\n    x.append(bytearray(64 * 2**20))"):
        result = run_python(code, roomy)
        assert (result.status, result.error) == ("error", "MemoryError"), result
    _still_works(settings)


def test_an_infinite_loop_hits_the_cpu_limit():
    result = run_python("print('spinning')\nwhile True:\n    pass", dataclasses.replace(HOSTILE, wall_timeout_s=10.0))
    # stopped by the CPU limit, not the 10 s wall deadline (how soon: benchmarks/sandbox.py)
    assert (result.status, result.error, result.stdout) == ("limit", "CPU time limit exceeded (1 s)", "spinning\n")
    _still_works(HOSTILE)


def test_a_loop_that_ignores_sigxcpu_is_killed_at_the_hard_limit():
    code = "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass"
    result = run_python(code, dataclasses.replace(HOSTILE, wall_timeout_s=10.0))
    assert (result.status, result.error) == ("killed", "Killed by signal SIGKILL"), result


@BOTH
def test_sleeping_past_the_wall_clock_is_a_timeout(settings):
    result = run_python("import time\ntime.sleep(1000)", settings)
    # the deadline's overshoot is measured in benchmarks/sandbox.py
    assert result.status == "timeout" and result.error == "TimeoutError: the code did not finish within 2 s"
    _still_works(settings)


@needs_uid_drop
def test_a_sandbox_does_not_outlive_a_killed_caller():
    # The caller is SIGKILLed while its snippet sleeps (for ~30 years: it never ends by itself): nobody
    # is left to enforce the 1 s deadline, `timeout` does (2 s after it). How soon: benchmarks/sandbox.py.
    before = _leftovers()
    script = ("from steprl_jax.tools.python_sandbox import SandboxSettings, isolation, run_python\n"
              "settings = SandboxSettings(wall_timeout_s=1.0)\n"
              "isolation(settings)\nprint('probed', flush=True)\n"  # the probe's own sandbox has ended
              "run_python('import time; time.sleep(1e9)', settings)")
    caller = subprocess.Popen([sys.executable, "-c", script],
                              env={**os.environ, "PYTHONPATH": ROOT, "TMPDIR": tempfile.gettempdir()},
                              stdout=subprocess.PIPE, text=True)
    try:
        assert caller.stdout.readline() == "probed\n"
        while not _leftovers()[0] - before[0]:  # until its sandbox has started (or the caller failed)
            assert caller.poll() is None, "the caller ended before its sandbox started"
            time.sleep(0.05)
    finally:
        caller.kill()
        caller.wait()
        caller.stdout.close()
    left = _leftovers()[0] - before[0]
    assert left, "the sandbox ended with its caller: nothing left to test"
    # What ends it: its outermost process, `timeout -s KILL` at the 1 s deadline + the grace
    # (how soon a deadline is enforced is timed in benchmarks/sandbox.py, not here).
    parents = _parents()
    outer = {" ".join(_cmdline(a)[:4]) for pid in left for a in _ancestors(pid, parents)}
    assert f"{_which('timeout')} -s KILL {1.0 + _OUTER_GRACE_S:g}" in outer, outer
    # It ends: only a kill ends a snippet that sleeps 1e9 s.
    _wait_until_ended(left)
    assert not _leftovers()[0] - before[0], "the sandbox outlived its caller"
    orphans = _leftovers()[2] - before[2]  # the caller could not remove its scratch folder: empty
    assert len(orphans) == 1 and all(os.listdir(folder) == [] for folder in orphans)
    for folder in orphans:
        os.rmdir(folder)


def _cmdline(pid: int) -> list:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode() for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def _ancestors(pid: int, parents: dict[int, int]) -> list:
    chain = []
    while pid > 1:
        chain.append(pid)
        pid = parents.get(pid, 0)
    return chain


# ------------------------------------------------------------------ hostile snippets: output
def test_printing_a_gigabyte_is_cut_and_never_buffered_by_the_caller():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    code = "s = 'y' * 10**6\nfor _ in range(1000):\n    print(s)\nimport os\nfor _ in range(10):\n    os.write(1, b'z' * 10**8)"
    result = run_python(code, dataclasses.replace(HOSTILE, wall_timeout_s=20.0, cpu_s=10))
    assert result.status == "ok", result
    assert result.stdout == "y" * 2000 + f"\n... [output truncated: {1000 * (10**6 + 1) - 2000:,} more characters]"
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mib < 100, f"the caller's peak memory grew by {grown_mib:.0f} MiB"


def test_flooding_the_report_channel_is_a_limit_not_a_buffer():
    code = "import os\nfor _ in range(100):\n    for fd in range(3, 64):\n        try:\n            os.write(fd, b'{' * 10**6)\n        except OSError:\n            pass"
    result = run_python(code, dataclasses.replace(HOSTILE, wall_timeout_s=10.0))
    assert (result.status, result.error) == ("limit", "the sandbox's report was too large"), result


def test_files_past_the_size_and_count_limits_fail():
    code = "try:\n    open('big', 'wb').write(b'0' * (17 << 20))\nexcept OSError as err:\n    print(err.strerror)\n" \
           "files = [open('/dev/null') for _ in range(200)]"
    result = run_python(code, QUICK)
    assert (result.stdout, result.error) == ("File too large\n", "OSError: [Errno 24] Too many open files: '/dev/null'")


@needs_namespaces
def test_the_scratch_folder_is_a_bounded_tmpfs():
    code = "for i in range(4):\n    open(f'f{i}', 'wb').write(b'0' * (1 << 20))"
    result = run_python(code, dataclasses.replace(QUICK, scratch_bytes=2 << 20))
    assert result.error == "OSError: [Errno 28] No space left on device", result


# ------------------------------------------------------------------ hostile snippets: files
@BOTH
def test_secrets_outside_the_sandbox_stay_unread(settings, tmp_path, monkeypatch):
    secret = "S3CRET-" + uuid.uuid4().hex
    monkeypatch.setenv("STEPRL_SANDBOX_TEST_SECRET", secret)
    run_dir = tempfile.mkdtemp(prefix="steprl_test_run_")  # world-readable: only the sandbox stops a read
    try:
        os.chmod(run_dir, 0o755)
        with open(os.path.join(run_dir, "api_key.txt"), "w") as f:
            f.write(secret)
        os.chmod(os.path.join(run_dir, "api_key.txt"), 0o644)
        holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                  env={"STEPRL_SANDBOX_TEST_SECRET": secret})
        try:
            paths = [os.path.join(run_dir, "api_key.txt"), os.path.join(ROOT, "README.md"), "/root/.profile",
                     f"/proc/{os.getpid()}/environ", f"/proc/{holder.pid}/environ", "/etc/shadow"]
            code = f"""
import os
print(dict(os.environ))
for path in {paths!r}:
    try:
        print(path, open(path, 'rb').read()[:200])
    except OSError as err:
        print(path, type(err).__name__)
for folder in ['/root', {run_dir!r}, '/proc']:
    try:
        print(folder, os.listdir(folder))
    except OSError as err:
        print(folder, type(err).__name__)
"""
            result = run_python(code, settings)
        finally:
            holder.kill()
            holder.wait()
    finally:
        for name in os.listdir(run_dir):
            os.remove(os.path.join(run_dir, name))
        os.rmdir(run_dir)
    assert result.status == "ok", result
    assert secret not in observation(result)
    lines = result.stdout.splitlines()
    assert "STEPRL_SANDBOX_TEST_SECRET" not in lines[0]
    # Refused by the hook (process-only), or absent from the private root (namespaces): never read.
    for line in lines[1:]:
        assert line.endswith(("PermissionError", "FileNotFoundError")), line


@BOTH
def test_writes_outside_the_scratch_folder_are_refused(settings):
    token = uuid.uuid4().hex
    targets = [f"/tmp/steprl_pwned_{token}", os.path.join(ROOT, f"steprl_pwned_{token}"),
               f"/dev/shm/steprl_pwned_{token}", os.path.join(sys.prefix, f"steprl_pwned_{token}")]
    code = f"""
import os, shutil, sqlite3
for path in {targets!r}:
    for attempt in (lambda: open(path, 'w').write('x'), lambda: os.mkdir(path), lambda: sqlite3.connect(path),
                    lambda: os.rename('mine', path), lambda: shutil.copy('mine', path)):
        open('mine', 'w').close()
        try:
            attempt()
        except OSError as err:
            print(type(err).__name__)
for attempt in (lambda: os.chdir('/'), lambda: os.remove({os.path.join(ROOT, 'README.md')!r})):
    try:
        attempt()
    except OSError as err:
        print(type(err).__name__)
"""
    result = run_python(code, settings)
    assert result.status == "ok", result
    # Inside the namespaces /tmp is the snippet's own scratch folder: writing there is allowed.
    expected = 5 * len(targets) + 2 - (5 if settings.isolation == "auto" and STRONG.private_root else 0)
    assert result.stdout.splitlines().count("PermissionError") == expected, result.stdout
    for path in targets:
        assert not os.path.exists(path), path
    assert os.path.exists(os.path.join(ROOT, "README.md"))


# ------------------------------------------------------------------ hostile snippets: network, signals, ctypes
@BOTH
def test_no_connection_reaches_a_local_server(settings):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        code = f"""
import socket
for attempt in (lambda: socket.create_connection(('127.0.0.1', {port}), timeout=1),
                lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('127.0.0.1', {port})),
                lambda: socket.getaddrinfo('example.com', 80), lambda: socket.socketpair()):
    try:
        attempt()
        print('connected')
    except OSError as err:
        print(type(err).__name__)
"""
        result = run_python(code, settings)
        server.settimeout(0.3)
        with pytest.raises(socket.timeout):
            server.accept()
    assert result.stdout == "PermissionError\n" * 4, result


@BOTH
def test_signals_to_the_caller_are_refused(settings):
    me = os.getpid()
    code = f"""
import os, signal, threading
for attempt in (lambda: os.kill({me}, signal.SIGKILL), lambda: os.killpg({os.getpgid(me)}, signal.SIGKILL),
                lambda: os.kill(0, signal.SIGKILL), lambda: signal.pthread_kill(threading.get_ident(), signal.SIGKILL)):
    try:
        attempt()
        print('sent')
    except OSError as err:
        print(type(err).__name__)
"""
    result = run_python(code, settings)
    assert result.stdout == "PermissionError\n" * 4, result
    _still_works(settings)  # and this process is evidently still alive


@needs_namespaces
def test_kill_everything_reaches_nothing_outside():
    result = run_python("import os, signal\nos.kill(-1, signal.SIGKILL)", HOSTILE)
    assert result.error == "PermissionError: sandbox: os.kill is not allowed", result


@BOTH
def test_ctypes_is_refused(settings):
    token = uuid.uuid4().hex
    code = f"""
import ctypes
for attempt in (lambda: ctypes.CDLL(None).system(b'touch /tmp/steprl_pwned_{token}'),
                lambda: ctypes.CDLL('libc.so.6'), lambda: ctypes.pythonapi.PyRun_SimpleString(b'print(1)'),
                lambda: ctypes.string_at(0), lambda: ctypes.memmove(0, 0, 8), lambda: ctypes.c_char.from_address(8)):
    try:
        attempt()
        print('called')
    except PermissionError as err:
        print(err)
"""
    result = run_python(code, settings)
    assert result.status == "ok", result
    assert [line.split(":")[0] for line in result.stdout.splitlines()] == ["sandbox"] * 6, result.stdout
    assert not os.path.exists(f"/tmp/steprl_pwned_{token}")


# ------------------------------------------------------------------ the tool
def test_the_tool_shows_output_errors_and_final_answers():
    tool = python_tool(QUICK)
    assert tool.name == "python" and tool.timeout_s > QUICK.queue_timeout_s + QUICK.wall_timeout_s
    assert tool({"code": "print(1)\nfinal_answer(2)"}).content == "1\nFinal answer: 2"
    assert tool({"code": "print('x')\n{}['k']"}).content == "x\nKeyError: 'k'"
    assert tool({"code": "y = 1"}).content == "(no output)"
    timed_out = python_tool(HOSTILE)({"code": "while True: pass"})
    assert timed_out.content == "CPU time limit exceeded (1 s)"


@pytest.mark.parametrize("arguments", [{"code": 5}, {"code": "1", "extra": 2}, {}, ["print(1)"]])
def test_bad_arguments_are_malformed_argument_errors(arguments):
    result = ToolRegistry([python_tool(QUICK)]).execute_one({"name": "python", "arguments": arguments})
    assert result.error_type == MALFORMED_ARGUMENTS, result


def test_concurrent_calls_all_answer_with_at_most_the_pool_running():
    """Counted from outside: a running sandbox is a child process of this one from its start to
    its end, and a call waiting for the pool has none."""
    registry = ToolRegistry([python_tool(dataclasses.replace(QUICK, max_concurrent=2))], max_workers=8)
    code = "import time\ntime.sleep(0.5)\nprint({})"
    before = _leftovers()[1]
    box = {}
    caller = threading.Thread(target=lambda: box.update(results=registry.execute(
        [{"name": "python", "arguments": {"code": code.format(i)}} for i in range(8)])))
    caller.start()
    running = []
    while caller.is_alive():
        running.append(len(_leftovers()[1] - before))
        time.sleep(0.01)
    caller.join()
    results = box["results"]
    assert all(r.ok for r in results), results
    assert [int(r.content.split()[0]) for r in results] == list(range(8))
    assert 1 <= max(running) <= 2, running