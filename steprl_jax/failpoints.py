"""Fail points: named places where a test kills the process, to show that a job resumes exactly
from wherever it dies.

    failpoints.hit("records.append.mid")      # does nothing unless armed

    STEPRL_JAX_KILL_AT="records.append.mid:3" python -m steprl_jax.main ...

The environment variable names one or more points, comma separated, each with the count of the
hit that kills (default 1): the process sends itself SIGKILL the 3rd time it reaches
"records.append.mid", with no cleanup, no flush and no `finally`, as a preempted host would. The
variable is read once, at import; unarmed, `hit` is one dictionary look-up. `armed(name)` lets a
writer do its work in a way that makes the kill meaningful (e.g. write half a line first).

`STEPRL_JAX_TERM_AT` (same format) sends SIGTERM instead, which the process's own handler turns
into a clean stop (the main job: exit 130, resumable).

The points (grep for `failpoints.hit`):

    records.append.mid      a record line half written (and fsynced) to its JSONL store
    records.append.after    a record line written and fsynced
    checkpoint.save.mid     every item of a checkpoint written, the step not yet committed
    checkpoint.save.after   a checkpoint committed
    swirl.stage.before_mark a SWiRL stage's output complete, its marker not yet written
    swirl.stage.after_mark  a SWiRL stage marked complete (between stages)

This module imports nothing from the project, so that any layer can use it.
"""
from __future__ import annotations

import os
import signal
import threading

ENV = "STEPRL_JAX_KILL_AT"


TERM_ENV = "STEPRL_JAX_TERM_AT"  # the same points, but SIGTERM: the process's own handler stops it


def parse(text: str, env: str = ENV) -> dict[str, int]:
    """"a:3,b" -> {"a": 3, "b": 1}."""
    out = {}
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        name, _, count = part.partition(":")
        try:
            out[name.strip()] = int(count) if count else 1
        except ValueError:
            raise ValueError(f"{env}={text!r}: {part!r} is not NAME or NAME:COUNT") from None
        if out[name.strip()] < 1:
            raise ValueError(f"{env}={text!r}: the count of {name!r} must be >= 1")
    return out


_ARMED = parse(os.environ.get(ENV, ""))
_TERM = parse(os.environ.get(TERM_ENV, ""), TERM_ENV)
_HITS: dict[str, int] = {}
_LOCK = threading.Lock()


def armed(name: str) -> bool:
    return name in _ARMED


def hit(name: str) -> None:
    """Count a pass through `name`; SIGKILL this process on the armed pass (SIGTERM on the pass
    armed by STEPRL_JAX_TERM_AT)."""
    if name not in _ARMED and name not in _TERM:
        return
    with _LOCK:
        _HITS[name] = count = _HITS.get(name, 0) + 1
    if count == _TERM.get(name):
        os.write(2, f"fail point {name}:{count}: SIGTERM\n".encode())
        os.kill(os.getpid(), signal.SIGTERM)
    if count == _ARMED.get(name):
        os.write(2, f"fail point {name}:{count}: SIGKILL\n".encode())
        os.kill(os.getpid(), signal.SIGKILL)
