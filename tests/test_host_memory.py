"""trim_heap gives freed heap pages back to the system (glibc's malloc_trim)."""
import subprocess
import sys

import pytest

from steprl_jax.training.host_memory import Trimmer, _malloc_trim
from steprl_jax.training.metrics_log import memory_gb


# In a fresh process: what a long-lived test worker's heap already holds (holes that the chunks
# fill, a raised mmap threshold) changes what one trim gives back.
TRIM_SNIPPET = """
from steprl_jax.training.host_memory import trim_heap
from steprl_jax.training.metrics_log import memory_gb
# 64 KiB chunks stay in malloc's heap (below its mmap threshold); a small chunk after each
# keeps them from being at the heap's top, where free() alone would give them back.
big, small = [], []
for _ in range(3000):
    big.append(bytearray(b"x" * 65536))
    small.append(bytearray(1024))
del big
before = memory_gb()["rss_gb"]
trimmed = trim_heap()
print(trimmed, before, memory_gb()["rss_gb"])
"""


@pytest.mark.skipif(_malloc_trim() is None or not memory_gb(), reason="needs glibc and /proc")
def test_trim_heap_returns_freed_pages():
    out = subprocess.run([sys.executable, "-c", TRIM_SNIPPET], capture_output=True, text=True, check=True).stdout
    trimmed, before, after = out.split()
    assert trimmed == "True"
    assert float(before) - float(after) > 0.1, (before, after)  # ~0.18 GiB of freed chunks


def test_the_trimmer_trims_at_most_once_an_interval():
    hourly = Trimmer(every_s=3600.0)
    assert not hourly() and not hourly()  # the first interval has not passed
    always = Trimmer(every_s=0.0)
    assert always() and always()
