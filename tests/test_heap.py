"""Edge and node keep large buffers in memory that stays mapped (iop/heap.py), unless the operator tuned malloc."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# Where a fresh 4 MiB buffer lives, after one like it was freed: in the [heap] mapping, or its own.
PROBE = """
import ctypes, sys
from iop import heap
print(heap.keep_large_buffers())
bytearray(4 << 20)  # made and freed: a moving threshold would now rise to its size
buf = bytearray(4 << 20)
address = ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))
for line in open("/proc/self/maps"):
    span, *_, name = line.split(" ", 5)
    lo, hi = (int(x, 16) for x in span.split("-"))
    if lo <= address < hi:
        print(name.strip() or "anonymous")
"""


def probe(**env: str) -> list[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=clean | env, capture_output=True, text=True, timeout=30, check=True
    )
    return out.stdout.split()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_heap_large_buffers_come_from_the_heap_not_a_fresh_mapping() -> None:
    assert probe() == ["True", "[heap]"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_heap_leaves_malloc_alone_when_the_operator_tuned_it() -> None:
    assert probe(MALLOC_TRIM_THRESHOLD_="1048576") == ["False", "anonymous"]
