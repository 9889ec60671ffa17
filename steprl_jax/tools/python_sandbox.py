"""A sandboxed Python interpreter tool, for tool-integrated reasoning (ToRL, SimpleTIR): the policy
writes a snippet, the tool runs it and shows what it printed, or the last line of its traceback.

    settings = SandboxSettings(wall_timeout_s=5)
    result = run_python("print(6 * 7)\\nfinal_answer(42)", settings)   # never raises
    result.status, result.stdout, result.final_answer                # 'ok', '42\\n', '42'
    registry = ToolRegistry([python_tool(settings)])                 # the tool `python`, {"code": str}
    isolation().describe()                                            # the layers active on this host

Each snippet runs in a fresh process started from `_sandbox_boot.py`, never in the caller's. Layers,
strongest first (`isolation()` probes once which of them work here, and falls back in this order):

1. namespaces + private root (Linux with util-linux, as root or where user namespaces are allowed):
   `unshare` gives the snippet its own mount, network (no interface but a down loopback), pid (the
   caller's processes are not even visible), ipc and uts namespaces. Inside, a small shell script
   builds a new root on a tmpfs (/usr, the /bin-style links, a few /etc files, /dev/{null,zero,
   random,urandom}, a fresh /proc, the interpreter's prefixes, all read-only; /tmp a small tmpfs
   that is the scratch folder), `pivot_root`s into it and detaches the old one, so that nothing
   else of the host's file system can be named. As root, `setpriv` then drops to uid/gid 65534
   with no capability, no supplementary group and no_new_privs; without root the snippet is
   the root of a user namespace of its own with every capability dropped. The shell stays the
   namespace's init: when it dies (with unshare: --kill-child), every process inside dies.
2. uid drop only (root, namespaces refused): the process runs as uid/gid 65534 in a scratch folder
   it owns, so the kernel refuses writes to the caller's files. (Only where uid 65534 can run the
   interpreter at all: not when it lives in root's 0700 home, as a pyenv build does.)
3. nothing more (neither): the layers below only.

Always: the rlimits (CPU, address space, file size, open files, processes, no core file), an audit
hook (refuses new processes, signals, sockets, ctypes, links, writes outside the scratch folder,
reads outside the interpreter's files: a guard-rail that determined in-process Python can defeat,
the only file-system rule in layer 3), a minimal environment (no variable of the caller), stdin
from /dev/null, a wall-clock deadline after which the whole process group is killed (and coreutils'
`timeout` 2 s later, should the caller be dead), and a bound on what is read back (1 GB printed
never reaches the caller's memory). README.md, "The Python sandbox tool", says what is not isolated.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import pathlib
import select
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable

from steprl_jax.tools.protocol import TIMEOUT, TOOL_FAILURE, Tool, ToolError, object_schema

NOBODY = 65534
MAX_CODE_CHARS = 100_000
_NAMESPACES = ("mount", "net", "pid", "ipc", "uts")
_TOOLS = ("unshare", "setpriv", "mount", "umount", "pivot_root", "sh")
_SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc/ld.so.cache",
                 "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime", "/etc/passwd", "/etc/group")
_DEVICES = ("null", "zero", "random", "urandom")
_INNER_SCRATCH = "/tmp"  # the scratch folder as the snippet sees it inside a private root
_REAP_S = 10.0  # how long to wait for a killed process to be reaped
_OUTER_GRACE_S = 2.0  # `timeout` kills the sandbox this long after its deadline, should the caller be gone
# Fixed variables, none of the caller's: numerical libraries must not start threads (RLIMIT_NPROC
# forbids them, and OpenBLAS aborts its import when it cannot).
_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1"}


@dataclasses.dataclass(frozen=True)
class SandboxSettings:
    """Limits of one snippet, and of the tool's pool. `processes` is RLIMIT_NPROC: 0 forbids any
    process or thread beyond the snippet (a positive value counts every process of uid 65534, so
    concurrent sandboxes share it; and without a pid namespace a forked daemon could outlive the
    snippet). `scratch_bytes` bounds the scratch folder only with a private root (it is then a
    tmpfs); without one, only each file's size is bounded."""

    wall_timeout_s: float = 5.0
    cpu_s: int = 5
    memory_bytes: int = 1 << 30  # numpy + sympy + scipy.optimize peak at ~265 MiB of address space
    file_size_bytes: int = 16 << 20
    open_files: int = 64
    processes: int = 0
    scratch_bytes: int = 64 << 20
    stdout_chars: int = 2000
    python: str = sys.executable
    isolation: str = "auto"  # "auto": the strongest layers available; "process": no namespaces
    max_concurrent: int = 4  # sandboxes one tool runs at once
    queue_timeout_s: float = 10.0  # how long a tool call waits for a free sandbox

    def __post_init__(self):
        if self.isolation not in ("auto", "process"):
            raise ValueError(f"isolation must be 'auto' or 'process', got {self.isolation!r}")
        if self.max_concurrent < 1:
            raise ValueError(f"max_concurrent must be >= 1, got {self.max_concurrent}")


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    """`status`: ok, error (the snippet raised: `error` is the traceback's last line), timeout,
    killed (by a signal, named in `error`), limit (CPU time, or a report too large), failed (the
    sandbox itself could not run the snippet). `stdout` ends with a marker when it was cut."""

    status: str
    stdout: str = ""
    error: str | None = None
    final_answer: str | None = None
    duration_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class Isolation:
    """The layers a snippet runs under (beyond the rlimits and the audit hook, always on)."""

    namespaces: tuple[str, ...] = ()
    private_root: bool = False
    uid: int | None = None  # the uid it drops to (from root)
    user_namespace: bool = False  # namespaces made without root, inside a user namespace

    def describe(self) -> str:
        layers = ["a fresh process", "rlimits", "an audit hook", "a minimal environment"]
        if self.namespaces:
            via = " (in a user namespace)" if self.user_namespace else ""
            layers.append(f"{', '.join(self.namespaces)} namespaces{via}")
        if self.private_root:
            layers.append("a private read-only root (the interpreter, /usr, a tmpfs /tmp)")
        if self.uid is not None:
            layers.append(f"uid {self.uid}")
        return ", ".join(layers)


# ------------------------------------------------------------------ running one snippet
def run_python(code: str, settings: SandboxSettings = SandboxSettings()) -> SandboxResult:
    """Run `code` in a fresh sandboxed process under the strongest isolation this host allows.
    Never raises: every outcome, the sandbox's own failures included, is a `SandboxResult`."""
    started = time.monotonic()
    if not isinstance(code, str):
        return SandboxResult("failed", error=f"the code must be a string, got {type(code).__name__}")
    try:
        return _run(code, settings, isolation(settings), started)
    except Exception as err:  # a bug or an exhausted host (no fork, no disk): still a result
        return SandboxResult("failed", error=f"{type(err).__name__}: {err}", duration_s=time.monotonic() - started)


def _run(code: str, settings: SandboxSettings, iso: Isolation, started: float) -> SandboxResult:
    scratch = tempfile.mkdtemp(prefix="steprl_sandbox_")
    try:
        if iso.uid is not None and not iso.namespaces:
            os.chown(scratch, iso.uid, iso.uid)  # its only writable folder (the kernel refuses the others)
        inner = _INNER_SCRATCH if iso.private_root else scratch
        with tempfile.TemporaryFile() as job, tempfile.TemporaryFile() as errors:
            job.write(json.dumps(_job(code, settings, inner)).encode())
            job.seek(0)
            proc = subprocess.Popen(
                _command(iso, settings, scratch, job.fileno()), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=errors, pass_fds=(job.fileno(),), close_fds=True, start_new_session=True, cwd=scratch,
                env={**_ENV, "HOME": inner}, **_drop_kwargs(iso))
            report, problem = _collect(proc, started + settings.wall_timeout_s, _report_limit(settings))
            errors.seek(0)
            stderr = errors.read(2000).decode("utf-8", "replace").strip()
        return _result(report, problem, _signal_of(proc.returncode, iso), stderr, settings,
                       time.monotonic() - started)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _job(code: str, settings: SandboxSettings, scratch: str) -> dict:
    return {"code": code, "scratch": scratch, "cpu_s": max(1, math.ceil(settings.cpu_s)),
            "memory_bytes": settings.memory_bytes,
            "file_size_bytes": settings.file_size_bytes, "open_files": settings.open_files,
            "processes": settings.processes, "stdout_chars": settings.stdout_chars}


def _drop_kwargs(iso: Isolation) -> dict:
    """Popen's own uid drop, used when there are no namespaces (setpriv does it inside them)."""
    if iso.uid is None or iso.namespaces:
        return {}
    return {"user": iso.uid, "group": iso.uid, "extra_groups": []}


def _report_limit(settings: SandboxSettings) -> int:
    # JSON with ensure_ascii: at most 12 bytes a character (a surrogate pair), for stdout,
    # final answer and error line, plus the keys.
    return 12 * (2 * settings.stdout_chars + 1000) + 4096


def _collect(proc: subprocess.Popen, deadline: float, limit: int) -> tuple[bytes, str | None]:
    """Read the report until the process ends, its deadline passes or it writes more than `limit`
    bytes; then make sure the whole process group is gone. Returns (bytes, None | 'timeout' | 'overflow')."""
    chunks, size, problem = [], 0, None
    fd = proc.stdout.fileno()
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLHUP)
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                problem = "timeout"
                break
            if not poller.poll(max(1, int(left * 1000))):
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            size += len(chunk)
            if size > limit:
                problem = "overflow"
                break
            chunks.append(chunk)
        if problem is None:  # end of the report: every holder of the pipe closed it, the process is ending
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                problem = "timeout"
    finally:
        _kill(proc)
        proc.stdout.close()
    return b"".join(chunks), problem


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL the process group (start_new_session made it the child's own); inside a pid namespace
    the init's death takes every process of the namespace with it."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=_REAP_S)
    except subprocess.TimeoutExpired:  # not reaped yet (a process stuck in the kernel): Popen reaps it later
        pass


def _signal_of(returncode: int | None, iso: Isolation) -> int | None:
    """The signal that ended the interpreter: Popen reports -N; the namespace's shell exits with 128 + N."""
    if returncode is not None and returncode < 0:
        return -returncode
    if returncode is not None and iso.namespaces and returncode > 128:
        return returncode - 128
    return None


def _result(report: bytes, problem: str | None, signum: int | None, stderr: str, settings: SandboxSettings,
            duration: float) -> SandboxResult:
    """The outcome, from the report (written by the sandbox, so checked like any untrusted input)."""
    if problem == "timeout":
        return SandboxResult("timeout", error=f"TimeoutError: the code did not finish within "
                                              f"{settings.wall_timeout_s:g} s", duration_s=duration)
    if problem == "overflow":
        return SandboxResult("limit", error="the sandbox's report was too large", duration_s=duration)
    parsed = _parse_report(report, settings)
    if parsed is not None:
        return dataclasses.replace(parsed, duration_s=duration)
    if signum is not None:
        name = signal.Signals(signum).name if signum in signal.valid_signals() else str(signum)
        return SandboxResult("killed", error=f"Killed by signal {name}", duration_s=duration)
    if stderr:  # the sandbox's own start-up failed (the snippet's own stderr goes to its capture)
        return SandboxResult("failed", error=f"the sandbox failed to start: {stderr[-400:]}", duration_s=duration)
    return SandboxResult("error", error="the process ended before reporting", duration_s=duration)


def _parse_report(raw: bytes, settings: SandboxSettings) -> SandboxResult | None:
    try:
        report = json.loads(raw)
        status, stdout, cut = report["status"], report["stdout"], report["cut"]
        error, answer = report["error"], report["final_answer"]
    except (ValueError, TypeError, KeyError, RecursionError):  # RecursionError: [[[[... nested past the parser
        return None
    if (status not in ("ok", "error", "limit") or not isinstance(stdout, str) or not isinstance(cut, int)
            or not isinstance(error, (str, type(None))) or not isinstance(answer, (str, type(None)))):
        return None
    cap = settings.stdout_chars
    cut += max(0, len(stdout) - cap)
    stdout = _clean(stdout[:cap]) + (f"\n... [output truncated: {cut:,} more characters]" if cut > 0 else "")
    if status == "limit":
        error = f"CPU time limit exceeded ({settings.cpu_s} s)"
    return SandboxResult(status, stdout=stdout, error=error and _clean(error[:1000]),
                         final_answer=answer and _clean(answer[:cap]))


def _clean(text: str) -> str:
    """Valid UTF-8 only: a lone surrogate the snippet printed becomes '?' before any tokenizer sees it."""
    return text.encode("utf-8", "replace").decode("utf-8")


# ------------------------------------------------------------------ the command line
@functools.lru_cache(maxsize=1)
def _boot_source() -> str:
    return pathlib.Path(__file__).with_name("_sandbox_boot.py").read_text(encoding="utf-8")


def _command(iso: Isolation, settings: SandboxSettings, scratch: str, job_fd: int) -> list[str]:
    # Outermost, coreutils' `timeout`: a sandbox whose caller was killed (no one left to enforce the
    # deadline) still ends, a moment after its deadline.
    limit = settings.wall_timeout_s + _OUTER_GRACE_S
    outer = [_which("timeout"), "-s", "KILL", f"{limit:g}"] if _which("timeout") else []
    python = [settings.python, "-I", "-c", _boot_source(), str(job_fd)]
    if not iso.namespaces:
        return outer + python
    flags = ["--mount", "--net", "--pid", "--ipc", "--uts", "--fork", "--kill-child"]
    if iso.user_namespace:
        flags += ["--user", "--map-root-user"]
    return [*outer, _which("unshare"), *flags, "--", _which("sh"), "-c", _root_script(iso, settings, scratch),
            "sandbox", *python]


def _root_script(iso: Isolation, settings: SandboxSettings, root: str) -> str:
    """The shell script run as root of the new namespaces: build a read-only root on a tmpfs mounted
    at `root`, pivot into it, drop privileges and run the interpreter (its command line is "$@")."""
    q = shlex.quote
    mount, umount, pivot_root = (q(_which(tool)) for tool in ("mount", "umount", "pivot_root"))
    owner = 0 if iso.uid is None else iso.uid
    lines = ["set -eu", "umask 022", f"{mount} -t tmpfs -o mode=0755,size=4m,nosuid,nodev sandbox {q(root)}"]
    for path in _exposed(settings.python):
        lines.append(_expose(path, root + path, mount))
    lines.append(f"mkdir {q(root)}/dev")
    for name in _DEVICES:
        lines.append(f"touch {q(root)}/dev/{name} && {mount} --bind /dev/{name} {q(root)}/dev/{name}")
    scratch = root + _INNER_SCRATCH
    lines += [
        f"mkdir {q(root)}/proc {q(scratch)}",
        f"{mount} -t proc -o nosuid,nodev,noexec proc {q(root)}/proc",
        f"{mount} -t tmpfs -o size={settings.scratch_bytes},mode=0700,uid={owner},gid={owner},nosuid,nodev "
        f"scratch {q(scratch)}",
        # Into the new root; the old one detached, so that no path can lead back to the host's files.
        f"cd {q(root)}", f"{pivot_root} . .", f"{umount} -l .", f"{mount} -o remount,ro,bind /",
    ]
    drop = [_which("setpriv")]
    if iso.uid is not None:
        drop += [f"--reuid={iso.uid}", f"--regid={iso.uid}", "--clear-groups"]
    drop += ["--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--"]
    # Not exec: the shell stays the namespace's init (its death, which --kill-child ties to unshare's,
    # ends every process inside), and it exits with 128 + N when a signal N killed the interpreter.
    lines += ["unset PWD OLDPWD", f'{" ".join(q(a) for a in drop)} "$@"']
    return "\n".join(lines)


def _expose(path: str, target: str, mount: str) -> str:
    """A shell line making `path` visible, read-only, at `target` in the new root (a link stays a link)."""
    q = shlex.quote
    parent = f"mkdir -p {q(os.path.dirname(target))}"
    if os.path.islink(path):
        return f"{parent} && ln -s {q(os.readlink(path))} {q(target)}"
    make = f"mkdir -p {q(target)}" if os.path.isdir(path) else f"{parent} && touch {q(target)}"
    return f"{make} && {mount} --bind -o ro {q(path)} {q(target)}"


@functools.lru_cache(maxsize=None)
def _exposed(python: str) -> tuple[str, ...]:
    """What the private root shows: the system's libraries and the interpreter's prefixes, each path
    once (a prefix inside /usr is already there)."""
    wanted = [p for p in _SYSTEM_PATHS if os.path.lexists(p)] + sorted(_prefixes(python))
    shown: list[str] = []
    for path in wanted:
        if not any(path == s or path.startswith(s + "/") for s in shown if not os.path.islink(s)):
            shown.append(path)
    return tuple(shown)


@functools.lru_cache(maxsize=None)
def _prefixes(python: str) -> frozenset[str]:
    """The interpreter's prefixes (its standard library and site-packages live under them)."""
    query = "import json, sys; print(json.dumps([sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]))"
    try:
        out = subprocess.run([python, "-I", "-c", query], capture_output=True, text=True, timeout=30,
                             stdin=subprocess.DEVNULL, env=_ENV, check=True).stdout
        return frozenset(os.path.realpath(p) for p in json.loads(out))
    except (OSError, subprocess.SubprocessError, ValueError):
        return frozenset()


@functools.lru_cache(maxsize=None)
def _which(tool: str) -> str | None:
    return shutil.which(tool, path=_ENV["PATH"] + ":/usr/sbin:/sbin")


# ------------------------------------------------------------------ which layers work here
def isolation(settings: SandboxSettings = SandboxSettings()) -> Isolation:
    """The strongest isolation that runs a snippet on this host (probed once per interpreter and mode)."""
    return _probe(settings.python, settings.isolation)


@functools.lru_cache(maxsize=None)
def _probe(python: str, mode: str) -> Isolation:
    probe = SandboxSettings(python=python, isolation=mode, wall_timeout_s=30.0, cpu_s=10)
    candidates = _candidates(mode)
    for iso in candidates[:-1]:
        try:
            result = _run("import os; print(os.getuid())", probe, iso, time.monotonic())
        except Exception:  # e.g. uid 65534 may not execute the interpreter
            continue
        if result.status == "ok" and result.stdout.strip() == str(_expected_uid(iso)):
            return iso
    return candidates[-1]


def _candidates(mode: str) -> list[Isolation]:
    root = os.geteuid() == 0
    candidates = []
    if mode == "auto" and sys.platform.startswith("linux") and all(_which(t) for t in _TOOLS):
        candidates.append(Isolation(_NAMESPACES, private_root=True, uid=NOBODY if root else None,
                                    user_namespace=not root))
    if root:
        candidates.append(Isolation(uid=NOBODY))
    return candidates + [Isolation()]


def _expected_uid(iso: Isolation) -> int:
    if iso.uid is not None:
        return iso.uid
    return 0 if iso.user_namespace else os.geteuid()


# ------------------------------------------------------------------ the tool
def observation(result: SandboxResult) -> str:
    """What the policy sees: the output, then the error line (exception, timeout, limit, signal),
    then `Final answer: ...` when the snippet called final_answer; `(no output)` when all are empty."""
    lines = [result.stdout.rstrip("\n")] if result.stdout.strip() else []
    lines += [line for line in (result.error,) if line]
    if result.final_answer is not None:
        lines.append(f"Final answer: {result.final_answer}")
    return "\n".join(lines) if lines else "(no output)"


def python_tool(settings: SandboxSettings = SandboxSettings(), name: str = "python",
                render: Callable[[SandboxResult], str] = observation) -> Tool:
    """The tool `python` ({"code": str}). At most `settings.max_concurrent` of its calls run at once;
    a call that finds no free sandbox within `queue_timeout_s` is a `timeout` error. Its time limit
    covers the wait, the run and the clean-up, so the registry never abandons a live sandbox.
    `render`: the text a run returns (`observation` by default; a format may show runs its own way)."""
    isolation(settings)  # probe now, not inside the first call's time limit
    pool = threading.BoundedSemaphore(settings.max_concurrent)

    def run(code: str) -> str:
        if not pool.acquire(timeout=settings.queue_timeout_s):
            raise ToolError(TIMEOUT, f"no sandbox became free within {settings.queue_timeout_s:g} s")
        try:
            result = run_python(code, settings)
        finally:
            pool.release()
        if result.status == "failed":
            raise ToolError(TOOL_FAILURE, result.error or "the sandbox failed")
        return render(result)

    return Tool(
        name=name,
        description=("Run a Python 3 snippet in a fresh sandbox (no network, no files but its scratch folder, "
                     f"{settings.wall_timeout_s:g} s). Returns what it printed (first {settings.stdout_chars} "
                     "characters), the last line of the traceback if it raised, and the value passed to "
                     "final_answer(x) if called. numpy and sympy are importable when installed."),
        parameters=object_schema({"code": {"type": "string", "description": "the Python source to run",
                                           "maxLength": MAX_CODE_CHARS}}),
        fn=run,
        timeout_s=settings.queue_timeout_s + settings.wall_timeout_s + _REAP_S + 5.0,
    )
