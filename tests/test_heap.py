"""Edge and node keep large buffers in memory that stays mapped and space their collections out (iop/heap.py),
unless the operator tuned malloc or the collector."""

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


COLLECTOR = """
import gc, weakref
from iop import heap
before = gc.get_threshold()
print(heap.freeze_start_up(), gc.get_freeze_count() > 0, gc.get_threshold() == before)
freed = []
class Node:
    pass
n = Node(); n.self = n  # a cycle: only the collector frees it
weakref.finalize(n, freed.append, "cycle")
del n
keep = [[] for _ in range(3 * before[0])]  # net allocations past the young threshold
print("cycle" in freed)
"""


def collector(**env: str) -> list[str]:
    clean = {k: v for k, v in os.environ.items() if k != "IOP_GC_FREEZE"}
    out = subprocess.run(
        [sys.executable, "-c", COLLECTOR], env=clean | env, capture_output=True, text=True, timeout=30, check=True
    )
    return out.stdout.split()


def test_heap_start_up_is_frozen_and_cycles_are_still_freed() -> None:
    assert collector() == ["True", "True", "True", "True"]


def test_heap_the_operator_can_leave_the_collector_as_python_sets_it() -> None:
    assert collector(IOP_GC_FREEZE="0") == ["False", "False", "True", "True"]


def test_heap_a_bad_collector_setting_is_one_line_and_exit_2() -> None:
    env = {k: v for k, v in os.environ.items() if k != "IOP_GC_FREEZE"} | {"IOP_GC_FREEZE": "yes"}
    done = subprocess.run(
        [sys.executable, "-m", "iop", "edge", "--config", "configs/smoke.yaml"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().count("\n") == 0 and "IOP_GC_FREEZE" in done.stderr, done.stderr
