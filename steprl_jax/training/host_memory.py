"""Give the C heap's free pages back to the system between the phases of a run.

A rollout, a train step and an evaluation each allocate and free gigabytes of buffers of
sizes that change from iteration to iteration (cache lengths, packed shapes). glibc keeps
what is freed in its arenas, so a PORTool run's resident memory grew ~1 GiB an iteration
(5.7 -> 9.0 GiB over its first 4) while its live arrays stayed at ~2.8 GiB; with
`malloc_trim(0)` after each phase the same 4 iterations went 3.6 -> 4.7 GiB. A no-op where
the C library has no `malloc_trim` (not glibc).

A phase may itself be long (an evaluation of 96 tool-world queries, a collection): `Trimmer`
trims inside it, at most every few seconds. Under glibc's huge-page malloc (steprl_jax/malloc.py)
the rollouts of 24 tool-world queries held 14 GiB resident for 2.2 GiB of live arrays, and 3.9
GiB when trimmed every 15 s (each trim 5-170 ms); an evaluation of 96 was killed for memory at
23.5 GiB on a 24 GiB host.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import time


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def trim_heap() -> bool:
    """Return the heap's free memory to the system; True if anything was released."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False


class Trimmer:
    """Call it as often as convenient (after every decode chunk): it trims at most once every
    `every_s` seconds."""

    def __init__(self, every_s: float = 10.0):
        self.every_s = every_s
        self._last = time.monotonic()

    def __call__(self) -> bool:
        """Whether it trimmed this time."""
        if time.monotonic() - self._last < self.every_s:
            return False
        trim_heap()
        self._last = time.monotonic()
        return True
