"""Flow control of one answer: the node sends no more than the edge's client has room for."""

from __future__ import annotations

import asyncio
import contextlib
import time

from iop import wire
from iop.errors import RequestError

STALL_TIMEOUT_S = 60.0
"""A request whose flow-control window stays full this long (its client stopped reading) fails."""


class ClientStalled(RequestError):
    """The client stopped reading a streamed answer (the flow-control window stayed full)."""

    status = 408
    type = "server_error"
    code = "client_stalled"


class FlowWindow:
    """How much of one answer the node may still send before the edge's client takes more.

    The edge reports what its HTTP client has taken (`Credit`, cumulative); the node keeps at most
    `wire.WINDOW_CHUNKS` chunks and `wire.WINDOW_BYTES` bytes beyond that in flight.
    """

    def __init__(self, on_blocked: asyncio.Event | None = None) -> None:
        self.sent_chunks = 0
        self.sent_bytes = 0
        self.credit_chunks = 0
        self.credit_bytes = 0
        self.blocked = False
        self.blocked_since = 0.0
        """When the present (or last) wait for credit began, on the monotonic clock: the stall timer's start."""
        self.waits = 0
        """How many times sending had to wait for credit (tests, overhead figures)."""
        self._wake = asyncio.Event()
        self._progress = 0.0
        self._on_blocked = on_blocked

    def fits(self, size: int) -> bool:
        return (
            self.sent_chunks - self.credit_chunks < wire.WINDOW_CHUNKS
            and self.sent_bytes - self.credit_bytes + size <= wire.WINDOW_BYTES
        )

    def grant(self, chunks: int, nbytes: int) -> None:
        # Credits are cumulative, so a late or repeated one never takes back what a newer one gave.
        if chunks > self.credit_chunks or nbytes > self.credit_bytes:
            self.credit_chunks = max(self.credit_chunks, chunks)
            self.credit_bytes = max(self.credit_bytes, nbytes)
            self._progress = time.monotonic()
            self._wake.set()

    async def reserve(self, size: int, stall_timeout_s: float) -> int:
        """Wait until `size` more bytes fit, count them as sent and return their chunk's seq.

        Raises ClientStalled when no credit arrives for `stall_timeout_s` while waiting; ends with
        CancelledError when the request is cancelled (client gone, edge gone, node stopping).
        """
        if not self.fits(size):
            self.waits += 1
            self.blocked = True
            if self._on_blocked is not None:
                self._on_blocked.set()
            since = self.blocked_since = time.monotonic()
            try:
                while not self.fits(size):
                    self._wake.clear()
                    left = max(since, self._progress) + stall_timeout_s - time.monotonic()
                    if left <= 0:
                        raise ClientStalled(
                            f"the client took nothing of the answer for {stall_timeout_s:g}s; request abandoned"
                        )
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(left):
                            await self._wake.wait()
            finally:
                self.blocked = False
        seq = self.sent_chunks
        self.sent_chunks += 1
        self.sent_bytes += size
        return seq
