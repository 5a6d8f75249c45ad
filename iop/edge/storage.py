"""The edge's hold on the work stream: re-made when a publish finds it gone or failing, and its health.

JetStream can lose the stream under a running edge (deleted, a store that failed when its disk
filled, a server restarted on an empty store). The edge made the stream and the providers'
consumers only at its start, so every pool request failed until a restart. Now a failed publish
re-checks both (a bounded number of tries) and is retried once; while that fails, `error` says
why, and /healthz, /readyz and /status show it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import nats.errors
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from iop import wire
from iop.errors import BusError
from iop.nats import streams

log = logging.getLogger("iop.edge")

REPAIR_TRIES = 3
"""Tries to re-make the stream and consumers after a failed publish (0.1 s, then 0.2 s apart)."""
REPAIR_AGAIN_S = 1.0
PROBE_SUBJECT = "iop.work._health.probe"
"""In the work stream, read by no consumer (a provider's filter is one token after `iop.work.`):
a health check stores a message there and deletes it, the one proof the store takes writes."""
"""After a repair failed, publishes within this long fail at once instead of repairing again."""


class WorkStream:
    """Re-makes the work stream and the providers' consumers after a failed publish; knows if it is unusable."""

    def __init__(self, js: JetStreamContext, consumers: Callable[[], dict[str, int]]) -> None:
        self.js = js
        self.consumers = consumers
        """Provider id → capacity of every provider this edge serves (read at each repair: refreshes)."""
        self.error: str | None = None
        """Why the work stream cannot take work now; None while it can."""
        self.repairs = 0
        """Times the stream or a consumer was found missing and made again."""
        self._lock = asyncio.Lock()
        self._failed_at = 0.0
        self._repair_failed = False
        self._store_failed = False

    def store_failed(self, problem: str) -> None:
        """The NATS server said its store failed a write (a full disk): unusable until it is back."""
        self._store_failed = True
        self.error = f"work stream unusable: {problem}"
        self._failed_at = time.monotonic()
        log.error("%s", self.error)

    def store_back(self) -> None:
        """The failed store was loaded again: the next health check or publish finds out if it writes."""
        self._store_failed = False

    def ok(self) -> None:
        """A publish went through: whatever was wrong is over."""
        if self._store_failed:
            return
        if self.error is not None:
            log.info("work stream usable again")
            self.error = None

    async def _ensure(self) -> bool:
        """Make the stream and the consumers that are missing; whether any was."""
        made = await _missing(self.js.stream_info(wire.WORK_STREAM))
        await streams.ensure_work_stream(self.js)
        for provider, capacity in self.consumers().items():
            name = wire.consumer_name(provider)
            made |= await _missing(self.js.consumer_info(wire.WORK_STREAM, name))
            await streams.ensure_provider_consumer(self.js, provider, capacity)
        return made

    def failed(self, exc: BaseException) -> None:
        """A request gave up publishing its work: the stream cannot take work now."""
        if self.error is None:
            self.error = f"work stream unusable: {_reason(exc)}"
            self._failed_at = time.monotonic()  # only here and after a repair: a refusal must not extend it
            log.error("%s", self.error)

    async def recheck(self) -> None:
        """While the stream is reported unusable, check it again (at most every REPAIR_AGAIN_S):
        health clears without waiting for the next pool request to find it usable."""
        if self.error is None or self._lock.locked() or time.monotonic() - self._failed_at < REPAIR_AGAIN_S:
            return
        if self._store_failed:
            self._failed_at = time.monotonic()
            return
        if await self.repair(None) is not None and not self._repair_failed:
            try:
                info = await self.js.stream_info(wire.WORK_STREAM)
            except (nats.errors.Error, TimeoutError, OSError):
                info = None
            # A stream that answers its info may still fail every write (its store hit a full
            # disk): only a stored message says it is usable. Before, /healthz said fine meanwhile.
            if info is not None and wire.WORK_SUBJECTS in (info.config.subjects or []) and await self._writes():
                self.ok()
                return
        self._failed_at = time.monotonic()

    async def _writes(self) -> bool:
        """Store one message in the work stream and delete it again; whether both went through."""
        try:
            ack = await self.js.publish(PROBE_SUBJECT, b"", stream=wire.WORK_STREAM, timeout=2.0)
            await self.js.delete_msg(wire.WORK_STREAM, ack.seq)
        except (nats.errors.Error, TimeoutError, OSError) as exc:
            self.error = f"work stream unusable: a test write failed: {_reason(exc)}"
            return False
        return True

    async def repair(self, exc: BaseException | None) -> bool | None:
        """After a publish failed with `exc`: make the stream and consumers again if they are gone.

        True when something was missing and is made again (the publish may be retried at once);
        False when nothing was missing, or making it failed (then `error` says why); None when a
        repair failed less than REPAIR_AGAIN_S ago and none was tried.
        """
        if self.error is not None and time.monotonic() - self._failed_at < REPAIR_AGAIN_S:
            return None  # it failed a moment ago: don't make every waiting request retry it
        async with self._lock:
            self._repair_failed = False
            for attempt in range(REPAIR_TRIES):
                try:
                    made = await self._ensure()
                except (nats.errors.Error, TimeoutError, OSError, BusError) as err:
                    after = f" (after a publish failed: {_reason(exc)})" if exc is not None else ""
                    self.error = f"work stream unusable: {_reason(err)}{after}"
                    if attempt + 1 < REPAIR_TRIES:
                        await asyncio.sleep(0.1 * (attempt + 1))  # a bounded back-off, not a busy loop
                    continue
                if made:
                    self.repairs += 1
                    why = f" ({_reason(exc)})" if exc is not None else ""
                    log.warning("work stream or consumers were gone%s: made again", why)
                return made
            self._repair_failed = True
            self._failed_at = time.monotonic()
            log.error("%s", self.error)
            return False


async def _missing(check: Awaitable[object]) -> bool:
    try:
        await check
    except NotFoundError:
        return True
    return False


def _reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
