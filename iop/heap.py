"""Memory settings of a serving process, set once at start: glibc's malloc thresholds and the collector.

A request body (0.8-3 MB for an agent's turn) passes through several buffers in the edge and in
the node: the HTTP reads joined, the work item encoded, the NATS command, the upstream request.
glibc serves an allocation over its mmap threshold (128 KiB at first, raised as such blocks are
freed) from a fresh mapping, and hands the top of its heap back to the kernel once more than the
trim threshold (twice the mmap threshold) is free there: with a few megabytes per request both
happen on every request, and every copy of a body first faults its pages in, each one zeroed by
the kernel. Measured on a 2-core VM, four 3 MB copies took 12.5-14.4 CPU-ms that way against 1.1-1.5 from
memory kept mapped. The edge and the node raise both thresholds at start; the edge still gives
its memory back after a burst of waiting requests (iop/edge/memory.py trims the heap then).

Python's cyclic collector walks, in each full collection, every tracked object not yet found
long-lived, and in the edge and the node most of them were made at start: the modules, classes and
functions of the HTTP, NATS and metrics stacks. A serving process therefore collects once after
start-up and freezes what is left (`gc.freeze`: never walked again); the thresholds stay Python's,
so a cancelled request's cycles go as soon as before. Measured in one process (bench/fairness.py's
admission, 2,000 requests waiting on 1,000 tenants): 46-55 µs per admission unfrozen, 42-43 frozen.
A young threshold of 5,000-20,000 took a few µs more off that loop but raised the CPU per request
of the whole path at c=32 (`python -m bench --only throughput`, alternating). `IOP_GC_FREEZE=0`
leaves the collector as Python sets it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import sys

MMAP_THRESHOLD = 32 * 1024 * 1024
"""Allocations below this come from the heap (glibc's own ceiling for its moving threshold)."""
TRIM_THRESHOLD = 64 * 1024 * 1024
"""Free memory at the heap's top kept for reuse before glibc returns it."""
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_GC_SETTING = "IOP_GC_FREEZE"
_OPERATOR_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")
"""How an operator sets these themselves; then iop leaves malloc alone."""


def keep_large_buffers() -> bool:
    """Set glibc's mmap and trim thresholds for this process; True when they were set."""
    if not sys.platform.startswith("linux") or any(name in os.environ for name in _OPERATOR_SETTINGS):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    # mallopt answers 1 on success; musl's does nothing and answers 0.
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def freeze_start_up() -> bool:
    """Collect once, then keep what start-up made out of every later collection; True when frozen."""
    raw = os.environ.get(_GC_SETTING, "1").strip()
    if raw not in ("0", "1"):
        raise ValueError(
            f"{_GC_SETTING} must be 1 (freeze what start-up made) or 0 (leave the collector alone), not {raw!r}"
        )
    if raw == "0":
        return False
    gc.collect()  # start-up's garbage goes now, not into the frozen generation
    gc.freeze()
    return True
