"""How an entry point ends: one clear line for a user's mistake, a crash or an interruption.

    code = cli.outcome(error, log_path, debug)    # prints the line, returns the exit status

Exit statuses: 0 done, 1 a crash (a bug, or something this code did not foresee), 2 bad input
(`errors.BadInput`: the message names the field, file, line or argument), 130 interrupted
(Ctrl-C or SIGTERM; the workdir resumes with the same command). A crash's traceback goes to the
run's log file, and to the terminal with `--debug`.

Interruptions: SIGTERM is handled like Ctrl-C, so a stopped job unwinds through its `finally`
blocks (records are whole lines, checkpoints are committed atomically, so any point is safe to stop
at); a second Ctrl-C or SIGTERM exits at once.
"""
from __future__ import annotations

import os
import signal
import sys
import tempfile
import traceback
from typing import Optional

from steprl_jax.errors import BadInput

EXIT_CRASH, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 1, 2, 130

# Errors of the user's environment rather than of this code: a path that is missing, a folder
# where a file was expected, no permission, a full disk.
_ENVIRONMENT_ERRORS = (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError, FileExistsError)


_interrupted = []  # the signal that asked this process to stop, once one has


def interrupted() -> bool:
    """Whether a stop was asked for. A KeyboardInterrupt raised where Python cannot pass it on
    (inside a finaliser or a callback from native code) is printed and dropped, and the job runs
    on: the entry point then still ends as interrupted, not as done."""
    return bool(_interrupted)


def install_interrupt_handlers() -> None:
    """SIGTERM raises KeyboardInterrupt in the main thread, like Ctrl-C; the second of either
    ends the process at once."""

    def second(signum, frame):
        os._exit(EXIT_INTERRUPTED)

    def first(signum, frame):
        _interrupted.append(signum)
        signal.signal(signal.SIGINT, second)
        signal.signal(signal.SIGTERM, second)
        # os.write, not print: the main thread may be inside a write to stderr (a reentrant call)
        os.write(2, f"\n{signal.Signals(signum).name}: stopping (again to exit at once); the same command "
                    "resumes the run\n".encode())
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, first)
    signal.signal(signal.SIGTERM, first)


def outcome(error: BaseException, log_path: Optional[str], debug: bool) -> int:
    """Print the one line that says how the run ended by `error`; return the exit status."""
    detail = "".join(traceback.format_exception(error))
    if isinstance(error, KeyboardInterrupt) or interrupted():  # whatever the unwinding raised after it
        if not isinstance(error, KeyboardInterrupt) and log_path:
            _append(log_path, detail)
        print("interrupted; the same command resumes the run", file=sys.stderr)
        return EXIT_INTERRUPTED
    text = " ".join(str(error).split()) or type(error).__name__
    bad_input = isinstance(error, (BadInput, *_ENVIRONMENT_ERRORS))
    if log_path or not bad_input:
        log_path = _append(log_path, detail)
    if debug:
        print(detail, file=sys.stderr, end="")
    if bad_input:
        print(f"error: {text}", file=sys.stderr)
        return EXIT_BAD_INPUT
    where = f"; traceback in {log_path}" if log_path else ""
    hint = "" if debug else " (--debug prints it here)"
    print(f"crashed: {type(error).__name__}: {text}{where}{hint}", file=sys.stderr)
    return EXIT_CRASH


def _append(path: Optional[str], text: str) -> Optional[str]:
    """Append `text` to the log at `path` (a new temporary file when there is none yet); returns
    where it went, or None when it could not be written (the log must never hide the error)."""
    try:
        if path is None:
            fd, path = tempfile.mkstemp(prefix="steprl_jax-", suffix=".log")
            os.close(fd)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "a", encoding="utf-8") as f:
            f.write(text)
        return path
    except OSError:
        return None
