"""Request bodies while they are received: bounded together with the bodies of waiting requests.

`edge.queue.max_waiting_mb` bounded what waiting requests hold, but not what was still arriving:
twelve slow 30 MiB uploads grew the edge by 540 MiB before any of them waited. Every chunk now
takes its bytes from the same budget as it arrives (503 `bodies_over_budget` past it, before the
chunk is kept) and gives them back when the body is whole (it is then a waiting request's, and
counted there) or abandoned. After a burst of received bodies drains, the edge trims its heap.
"""

from __future__ import annotations

import asyncio

from iop.edge.memory import HighWater
from iop.edge.scheduler import Scheduler
from iop.errors import Unavailable

BURST_MIB = 16
"""Bodies of at least this many MiB at once, once drained, are worth giving the memory back."""
_MIB = 1024 * 1024


class ReceivingBodies:
    """The bytes of the request bodies being received now (one instance per edge)."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.bytes = 0
        self.refused = 0
        self.changed = asyncio.Event()
        """Set whenever `bytes` changes (tests wait on it)."""
        self.high = HighWater()
        """The most MiB held at once, received or waiting, since the trim after a burst last looked."""

    def take(self, n: int) -> None:
        """Count `n` more bytes of a body being received; Unavailable when the budget cannot hold them."""
        s = self.scheduler
        held = self.bytes + s.waiting_bytes + n
        if held > s.max_waiting_bytes:
            self.refused += 1
            raise Unavailable(
                f"the edge already holds {(self.bytes + s.waiting_bytes) / _MIB:.1f} MiB of request bodies being "
                f"received or waiting (edge.queue.max_waiting_mb: {s.max_waiting_bytes / _MIB:g}); retry shortly",
                code="bodies_over_budget",
                headers={"Retry-After": "1"},
            )
        self.bytes += n
        self.high.saw(held // _MIB)
        self.changed.set()

    def give(self, n: int) -> None:
        self.bytes -= n
        self.changed.set()

    def mib(self) -> int:
        """MiB of bodies held now, received or waiting (what the trim after a burst counts)."""
        return (self.bytes + self.scheduler.waiting_bytes) // _MIB
