"""Giving memory back after a burst: once a burst of waiting requests has drained, trim the heap.

10,000 waiting requests take the edge from ~40 MB to ~200 MB (their connections, tasks and
bodies). When they end, Python frees the objects but the process keeps the pages: glibc's malloc
keeps freed chunks for reuse and only hands back the top of its heaps, and cycles left by cancelled
requests (an exception and its traceback hold their frames) wait for the cyclic collector. So the
edge sat at its peak until the next burst. After a burst drains the edge collects cycles and asks
glibc to return every free page (`malloc_trim(0)`); where there is no glibc (macOS, musl) the
collection alone runs.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import logging
import os
import sys
from collections.abc import Callable

log = logging.getLogger("iop.edge")

BURST_WAITERS = 256
"""A drained queue is worth a trim after at least this many requests waited at once."""
SETTLE_S = 1.0
"""How long after the last waiter left to trim: the requests' connections close in the meantime."""
POLL_S = 0.5
"""How often the counts are read. A count's high-water mark keeps what came and went between two
reads, so nothing is missed; waking on every change instead cost 8-30 µs per admission."""

_malloc_trim: Callable[[int], int] | None = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        _malloc_trim = _libc.malloc_trim  # glibc only: musl has no malloc_trim (AttributeError)
        _malloc_trim.argtypes = [ctypes.c_size_t]
        _malloc_trim.restype = ctypes.c_int
    except (OSError, AttributeError):
        _malloc_trim = None


def rss_bytes() -> int | None:
    """This process's resident memory (Linux); None elsewhere."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def give_back() -> bool:
    """Collect cycles, then return free heap pages to the OS; True when glibc's trim ran."""
    gc.collect()
    if _malloc_trim is None:
        return False
    _malloc_trim(0)
    return True


class HighWater:
    """The highest a count reached since the mark was last read (cheap for the one counting)."""

    __slots__ = ("mark",)

    def __init__(self) -> None:
        self.mark = 0

    def saw(self, n: int) -> None:
        if n > self.mark:
            self.mark = n

    def read(self, now: int) -> int:
        """The mark, counting `now`; the next read starts from `now`."""
        mark = max(self.mark, now)
        self.mark = now
        return mark


class BurstTrim:
    """Watches how many requests wait; a burst of at least `burst` that drains to none gets a trim.

    `waiting` counts the requests waiting now; `high` is the count's high-water mark, kept by
    whoever counts. Both are read every `poll_s`, never on each change: an admission pays nothing
    for the watch. One trim per burst, `settle_s` after the queue emptied, and only if it stayed
    empty: a queue that fills again is still the same burst.
    """

    def __init__(
        self,
        waiting: Callable[[], int],
        high: HighWater,
        *,
        burst: int = BURST_WAITERS,
        settle_s: float = SETTLE_S,
        poll_s: float = POLL_S,
    ) -> None:
        self.waiting = waiting
        self.high = high
        self.burst = burst
        self.settle_s = settle_s
        self.poll_s = poll_s
        self.trims = 0
        """Trims done (tests, status)."""
        self.trimmed = asyncio.Event()
        """Set after every trim (tests wait on it)."""
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._watch())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _watch(self) -> None:
        peak = 0
        while True:
            await asyncio.sleep(self.poll_s)
            now = self.waiting()
            peak = max(peak, self.high.read(now))
            if now or peak < self.burst:
                if not now:
                    peak = 0  # drained before it was a burst
                continue
            await asyncio.sleep(self.settle_s)
            if self.waiting():
                continue  # filled again: the same burst goes on
            before = rss_bytes()
            trimmed = give_back()
            after = rss_bytes()
            self.trims += 1
            log.info(
                "a burst of %d waiting requests drained: %s%s",
                peak,
                "heap trimmed" if trimmed else "cycles collected (no malloc_trim here)",
                f", resident {before / 2**20:.1f} → {after / 2**20:.1f} MB" if before and after else "",
            )
            peak = 0
            self.high.read(0)
            self.trimmed.set()
