"""Large buffers from memory the process keeps mapped: glibc's malloc thresholds, set once per process.

A request body (0.8-3 MB for an agent's turn) passes through several buffers in the edge and in
the node: the HTTP reads joined, the work item encoded, the NATS command, the upstream request.
glibc serves an allocation over its mmap threshold (128 KiB at first, raised as such blocks are
freed) from a fresh mapping, and hands the top of its heap back to the kernel once more than the
trim threshold (twice the mmap threshold) is free there: with a few megabytes per request both
happen on every request, and every copy of a body first faults its pages in, each one zeroed by
the kernel. Measured on a 2-core VM, four 3 MB copies took 12.5-14.4 CPU-ms that way against 1.1-1.5 from
memory kept mapped. The edge and the node raise both thresholds at start; the edge still gives
its memory back after a burst of waiting requests (iop/edge/memory.py trims the heap then).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

MMAP_THRESHOLD = 32 * 1024 * 1024
"""Allocations below this come from the heap (glibc's own ceiling for its moving threshold)."""
TRIM_THRESHOLD = 64 * 1024 * 1024
"""Free memory at the heap's top kept for reuse before glibc returns it."""
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
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
