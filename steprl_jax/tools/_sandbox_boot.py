"""The first code a sandboxed snippet's process runs (python_sandbox.py starts it as `python -I -c <this
file's text> JOB_FD`): it reads the job, limits the process, installs an audit hook, runs the snippet
with its output captured, and writes one JSON result to the inherited stdout pipe.

Standard library only, and nothing but imports happens at import: importing this module from the
package installs no hook and limits nothing. Everything here runs inside the sandbox, so nothing here is trusted by the parent: the
parent bounds what it reads back and treats a missing or malformed result as a failure.

The audit hook (PEP 578) is a guard-rail, not a wall: Python code in the same process can, with
enough effort, get around it (the docs say so). The walls are the kernel's: namespaces, a private
root, the uid, the rlimits (see python_sandbox.py). The hook turns the plain attempts (open a
socket, fork, kill, write outside the scratch folder, read outside the interpreter's files) into a
clear PermissionError and is the only file-system rule where the kernel layers are unavailable.
"""
import builtins
import ctypes  # imported before the hook (its import dlopens; numpy, sympy, scipy import it); later uses are refused
import io
import json
import os
import resource
import signal
import sys
import traceback

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_DEVICES = ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random")
_READ_EXTRA = ("/usr/share/zoneinfo",)  # zoneinfo reads its files with open(); nothing else outside the prefixes did
# Events refused whatever their arguments: new processes, signals, sockets, native calls, links
# (a hard link would let a path inside the scratch folder name a file outside it).
_REFUSED = frozenset((
    "os.system", "os.exec", "os.spawn", "os.posix_spawn", "os.fork", "os.forkpty", "subprocess.Popen",
    "pty.spawn", "os.kill", "os.killpg", "signal.pthread_kill", "os.link", "os.symlink",
    "gc.get_objects", "gc.get_referrers", "gc.get_referents"))
_REFUSED_PREFIXES = ("socket.", "ctypes.")
# Events that change the file system, and os.chdir (the snippet stays in its scratch folder):
# (positions of their paths, positions of their dir_fd arguments). A path must lie in the scratch
# folder; a dir_fd (a path relative to an open folder, which the hook cannot resolve) is refused.
_WRITE_EVENTS = {
    "os.remove": ((0,), (1,)), "os.rmdir": ((0,), (1,)), "os.mkdir": ((0,), (2,)), "os.rename": ((0, 1), (2, 3)),
    "os.chmod": ((0,), (2,)), "os.chown": ((0,), (3,)), "os.utime": ((0,), (3,)), "os.truncate": ((0,), ()),
    "os.chflags": ((0,), ()), "os.lchflags": ((0,), ()), "os.setxattr": ((0,), ()), "os.removexattr": ((0,), ()),
    "os.chdir": ((0,), ()),
}
_READ_EVENTS = frozenset(("os.listdir", "os.scandir", "os.getxattr", "os.listxattr"))


class CpuLimit(BaseException):
    """Raised by the SIGXCPU handler; a BaseException so that `except Exception` does not swallow it."""


class CappedText(io.TextIOBase):
    """A text stream that keeps the first `cap` characters written and counts the rest."""

    def __init__(self, cap: int):
        self.cap, self.kept, self.cut, self.parts = cap, 0, 0, []

    def writable(self) -> bool:
        return True

    @property
    def encoding(self) -> str:
        return "utf-8"

    def write(self, text) -> int:
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        room = self.cap - self.kept
        if room > 0:
            self.parts.append(text[:room])
            self.kept += min(room, len(text))
        self.cut += max(0, len(text) - max(room, 0))
        return len(text)

    def value(self) -> str:
        return "".join(self.parts)


def _path(value) -> str | None:
    """The absolute, symlink-free path an event argument names; None for a file descriptor."""
    if isinstance(value, int) or value is None:
        return None
    return os.path.realpath(os.fsdecode(os.fspath(value)))


def _under(path: str, roots) -> bool:
    return any(path == root or path.startswith(root.rstrip("/") + "/") for root in roots)


def make_hook(scratch: str, readable: tuple, refuse=PermissionError, _path=_path, _under=_under, _getpid=os.getpid):
    """The audit hook. Helpers are bound as default arguments so that replacing a module attribute
    (os.path.realpath = ...) does not change what the hook calls."""
    writable = (scratch,) + _DEVICES[:1]

    def check_write(path: str | None) -> None:
        if path is not None and not _under(path, writable):
            raise refuse(f"sandbox: writing outside the scratch folder is not allowed ({path})")

    def check_read(path: str | None) -> None:
        if path is not None and not _under(path, readable + (scratch, f"/proc/{_getpid()}")):
            raise refuse(f"sandbox: reading {path} is not allowed")

    def hook(event: str, args: tuple) -> None:
        if event in _REFUSED or event.startswith(_REFUSED_PREFIXES):
            raise refuse(f"sandbox: {event} is not allowed")
        if event == "open":
            path, flags = _path(args[0]), args[2] if isinstance(args[2], int) else 0
            mode = args[1] if isinstance(args[1], str) else ""
            writes = flags & _WRITE_FLAGS or any(c in mode for c in "wax+")
            check_write(path) if writes else check_read(path)
        elif event in _WRITE_EVENTS:
            paths, dir_fds = _WRITE_EVENTS[event]
            if any(args[i] not in (None, -1) for i in dir_fds if i < len(args)):  # -1: no dir_fd given
                raise refuse(f"sandbox: {event} relative to a folder descriptor is not allowed")
            for i in paths:
                check_write(_path(args[i]))
        elif event in _READ_EVENTS:
            check_read(_path(args[0]))
        elif event == "sqlite3.connect":  # SQLite opens (and creates) its file in C, past the "open" event
            name = os.fsdecode(args[0]) if isinstance(args[0], (str, bytes, os.PathLike)) else ""
            if name != ":memory:":
                check_write(_path(name))
        elif event == "object.__setattr__" and args[1] == "__code__":  # libraries set __defaults__, never this
            raise refuse("sandbox: replacing a function's code is not allowed")

    return hook


def readable_roots() -> tuple:
    """The interpreter's own files (standard library, site-packages) and a few fixed ones."""
    prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    return tuple(sorted({os.path.realpath(p) for p in prefixes})) + _DEVICES + _READ_EXTRA


def set_limits(job: dict) -> None:
    """Lower every limit, soft and hard (an unprivileged process can never raise a hard limit again).
    CPU: SIGXCPU at the soft limit (caught below), SIGKILL one second later."""
    limits = {
        resource.RLIMIT_CPU: (job["cpu_s"], job["cpu_s"] + 1),
        resource.RLIMIT_AS: (job["memory_bytes"],) * 2,
        resource.RLIMIT_FSIZE: (job["file_size_bytes"],) * 2,
        resource.RLIMIT_NOFILE: (job["open_files"],) * 2,
        resource.RLIMIT_NPROC: (job["processes"],) * 2,
        resource.RLIMIT_CORE: (0, 0),
    }
    for which, (soft, hard) in limits.items():
        _, old_hard = resource.getrlimit(which)
        if old_hard != resource.RLIM_INFINITY:
            soft, hard = min(soft, old_hard), min(hard, old_hard)
        resource.setrlimit(which, (soft, hard))


def disarm_ctypes() -> None:
    """ctypes' ready-made memmove and memset raise no audit event when called: take them away. (Other
    unaudited ways to memory remain, ctypes.cast, numpy's as_strided: hence 'guard-rail'.)"""
    def refused(*args, **kwargs):
        raise PermissionError("sandbox: ctypes memory access is not allowed")

    ctypes.memmove = ctypes.memset = refused


def _on_cpu_limit(signum, frame):
    raise CpuLimit()


def error_line(err: BaseException) -> str:
    """The last line of the traceback (`ZeroDivisionError: division by zero`), as ToRL shows it."""
    lines = traceback.format_exception_only(type(err), err)
    return (lines[-1].strip() if lines else type(err).__name__)[:1000]


def run(code: str, cap: int) -> dict:
    """Run the snippet as `__main__`, its output captured; the outcome as a JSON-ready dict."""
    out = CappedText(cap)
    answer = []

    def final_answer(value) -> None:
        """Record the snippet's final answer (str(value); the last call wins)."""
        answer[:] = [str(value)[:cap]]

    builtins.final_answer = final_answer
    sys.stdout = sys.stderr = out
    status, error = "ok", None
    try:
        exec(compile(code, "<code>", "exec"), {"__name__": "__main__", "__builtins__": builtins})
    except SystemExit as err:  # exit() / sys.exit(): a normal end unless it carries a failure code
        if err.code not in (None, 0):
            status, error = "error", error_line(err)
    except CpuLimit:
        status, error = "limit", "CPU time limit exceeded"
    except BaseException as err:
        status, error = "error", error_line(err)
    finally:
        sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    return {"status": status, "error": error, "stdout": out.value(), "cut": out.cut,
            "final_answer": answer[0] if answer else None}


def main() -> None:
    with os.fdopen(int(sys.argv[1]), "rb") as job_file:
        job = json.loads(job_file.read())
    result_fd = os.dup(1)  # the snippet's own fd 1 and 2 (C-level writes) go to /dev/null
    null = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)
    os.chdir(job["scratch"])
    readable = readable_roots()
    sys.path[:] = [p for p in sys.path if _under(os.path.realpath(p), readable)]  # others would be refused
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a file past the size limit: an OSError, not a kill
    signal.signal(signal.SIGXCPU, _on_cpu_limit)
    ballast = bytearray(1 << 20)  # freed before the result is written, should the snippet exhaust memory
    set_limits(job)
    disarm_ctypes()
    sys.addaudithook(make_hook(os.path.realpath(job["scratch"]), readable))
    code = job.pop("code")
    result = run(code, job["stdout_chars"])
    del ballast, code
    data = json.dumps(result, ensure_ascii=True).encode("ascii")
    while data:
        data = data[os.write(result_fd, data):]


if __name__ == "__main__":
    main()
