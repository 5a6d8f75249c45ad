"""The waiters' deadlines: one loop timer for every waiting request of the edge.

A timer per waiter (asyncio.timeout, or a call_at each) costs an allocation, a push on the loop's
heap and a cancel on every admission; here a waiter's deadline is one push on a heap of our own,
and only the soonest one has a timer.
"""

from __future__ import annotations

import asyncio
import heapq
import math
from typing import Any


class Deadlines:
    """(deadline, order, future) of the waiters, soonest first. An entry whose waiter left already
    goes when it surfaces, or at a compaction."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, asyncio.Future[Any]]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._at = math.inf
        self._compact_at = 64

    def __len__(self) -> int:
        return len(self._heap)

    @property
    def armed(self) -> bool:
        """Whether a loop timer is set for the soonest deadline."""
        return self._timer is not None

    def watch(self, loop: asyncio.AbstractEventLoop, deadline: float, order: int, future: asyncio.Future[Any]) -> None:
        """Fail `future` with TimeoutError at `deadline` (the loop's clock) unless it is done by then."""
        if future.done():
            return  # granted by the pump that followed its arrival
        heap = self._heap
        while heap and heap[0][2].done():
            heapq.heappop(heap)  # granted or gone: the usual case, as deadlines follow arrivals
        heapq.heappush(heap, (deadline, order, future))
        if len(heap) >= self._compact_at:
            heap[:] = [e for e in heap if not e[2].done()]
            heapq.heapify(heap)
            self._compact_at = max(64, 2 * len(heap))
        if deadline < self._at:
            if self._timer is not None:
                self._timer.cancel()
            self._timer, self._at = loop.call_at(deadline, self._expire), deadline

    def clear(self) -> None:
        """Nobody waits: no deadline is left to watch (a drained burst keeps none of its futures)."""
        if not self._heap:
            return
        self._heap.clear()
        self._compact_at = 64
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._at = None, math.inf

    def _expire(self) -> None:
        """The soonest deadline came: its waiters (and any other one due) end in TimeoutError."""
        loop = asyncio.get_running_loop()
        # The loop's timers may fire a hair early (uvloop's are whole milliseconds), as asyncio.timeout's.
        due = loop.time() + 0.001
        heap = self._heap
        while heap and (heap[0][0] <= due or heap[0][2].done()):
            future = heapq.heappop(heap)[2]
            if not future.done():
                future.set_exception(TimeoutError())
        self._timer, self._at = None, math.inf
        if heap:
            self._at = heap[0][0]
            self._timer = loop.call_at(self._at, self._expire)
