"""A provider slot's own JetStream pull: one inbox, one pull request at a time, its status replies read."""

from __future__ import annotations

import asyncio
import logging
from collections import deque

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import Header, StatusCode

from iop.nats import inline

log = logging.getLogger("iop.node")

EXPIRES_MARGIN_S = 0.05
"""How much sooner the server ends a pull than the slot stops waiting for it: room for the pull's
trip there and its 408's trip back, so a pull normally ends by its 408 and the next never overlaps it."""
PAUSE_S = 0.5
"""How long a slot waits before pulling again after a pull the server ended early (consumer deleted,
no consumer, leadership change) or while the connection is down: a loop of pulls never spins."""


class SlotPull:
    """One slot's pulls on a durable pull consumer: one message at a time, on an inbox of its own.

    The slot's one subscription is `<inbox>.*`; pull n asks for one message with `<inbox>.<n mod 2>`
    as its reply. The server ends a pull on that subject (408 expired, 409 consumer deleted /
    leadership change / max waiting, 503 no consumer), so the late status of the pull before is
    known for what it is and never ends the current one. Two subjects, not one per pull: the
    server's subject cache keeps them, where a new subject per pull missed it on every delivery
    and on every check of the waiting pulls' interest. A message is work whichever pull it answers
    (the server delivers it under its stream subject): one that comes after its pull's wait ended
    is kept for the next `next()`, never lost while the slot lives. Messages are nats-py's own
    `Msg`, built by the core subscription: ack/nak/term/in_progress, metadata and headers work as
    after `fetch()`.

    Never cancel `next()` (its pull would stay on the server, free to take a message for nobody):
    it ends by itself within `wait_s` (+ `PAUSE_S`).
    """

    def __init__(self, nc: NATS, stream: str, durable: str, wait_s: float, api_prefix: str = "$JS.API") -> None:
        self._nc = nc
        self._next_subject = f"{api_prefix}.CONSUMER.MSG.NEXT.{stream}.{durable}"
        self._request = b'{"batch":1,"expires":%d}' % int((wait_s - EXPIRES_MARGIN_S) * 1e9)
        self._wait_s = wait_s
        self._inbox = nc.new_inbox()
        self._replies = (f"{self._inbox}.0", f"{self._inbox}.1")
        self._pulls = 0
        self._current = ""  # the reply subject of the pull waited for ("" when none is)
        self._started = 0.0
        self._waiter: asyncio.Future[Msg | None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._kept: deque[Msg] = deque()
        self._sub: Subscription | None = None
        self.last_status = ""
        """The status that ended the last pull the server ended ("408", "409 Consumer Deleted", ...)."""

    @property
    def inbox(self) -> str:
        """The prefix of this slot's reply subjects: pull n is answered on `<inbox>.<n mod 2>`."""
        return self._inbox

    @property
    def waiting(self) -> bool:
        """A wait for the next message is set up and not yet over: a run's `begin`, or a reconnect's pause."""
        return self._waiter is not None

    @property
    def pulls(self) -> int:
        """How many pull requests this slot has sent."""
        return self._pulls

    async def open(self) -> None:
        # Read as it comes (iop/nats/inline.py): the item's waiter is woken in the same turn.
        self._sub = await inline.subscribe(self._nc, self._inbox + ".*", self._on_msg)

    async def close(self) -> None:
        if self._sub is None:
            return
        try:
            await self._sub.unsubscribe()
        except nats.errors.Error as exc:  # the connection closed first: nothing left to undo
            log.debug("pull on %s: unsubscribing: %s", self._next_subject, exc)
        self._sub = None

    async def next(self) -> Msg | None:
        """The next message for this slot; None once a pull ended without one.

        A pull ends with a message, with its 408 (expired), or after `wait_s` (lost: a reconnect, a
        server gone). Ended early by the server, or with the connection down, it returns only after
        `PAUSE_S`. Raises `ConnectionClosedError` once the connection is closed, and what
        `publish` raises.
        """
        if self._kept and self._waiter is None:
            return self._kept.popleft()
        if self._waiter is None:
            await self._begin()
        waiter = self._waiter
        assert waiter is not None
        try:
            return await waiter
        finally:
            if self._timer is not None:
                self._timer.cancel()
            self._waiter, self._current, self._timer = None, "", None

    async def begin(self) -> None:
        """Send the next pull now, for the coming `next()` (none while one is out or a message is kept).

        A run sends its slot's next pull this way between its ack and its Done, in the same loop
        turn: the broker sees ack, pull, Done in that order, in one write."""
        if self._waiter is None and not self._kept and self._nc.is_connected:
            await self._begin()

    async def _begin(self) -> None:
        if self._nc.is_closed:
            raise nats.errors.ConnectionClosedError
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[Msg | None] = loop.create_future()
        if not self._nc.is_connected:
            # Reconnecting: a pull now would wait in nats-py's buffer and, with its successors, reach
            # the server at once on reconnect, each free to take a message for this one slot.
            self._waiter = waiter
            self._timer = loop.call_later(PAUSE_S, _end, waiter)
            return
        self._pulls += 1
        self._current = self._replies[self._pulls & 1]
        self._waiter = waiter  # before the publish: its answer may come in the same loop turn
        try:
            await self._nc.publish(self._next_subject, self._request, reply=self._current)
        except BaseException:
            self._waiter, self._current = None, ""
            raise
        self._started = loop.time()
        self._timer = loop.call_later(self._wait_s, _end, waiter)

    def _on_msg(self, msg: Msg) -> None:
        status = msg.headers.get(Header.STATUS) if msg.headers else None
        waiter = self._waiter
        if not status:
            if waiter is not None and not waiter.done():
                waiter.set_result(msg)
            else:
                self._kept.append(msg)
            return
        if status == StatusCode.CONTROL_MESSAGE or msg.subject != self._current or waiter is None or waiter.done():
            return  # an idle heartbeat, or the end of a pull no longer waited for
        assert msg.headers is not None
        self.last_status = f"{status} {msg.headers.get(Header.DESCRIPTION, '')}".strip()
        self._current = ""  # this pull is over: nothing else of it can come
        loop = asyncio.get_running_loop()
        if status == StatusCode.REQUEST_TIMEOUT and loop.time() - self._started >= self._wait_s / 2:
            waiter.set_result(None)  # the expected end of an idle pull: pull again at once
            return
        log.debug("pull on %s ended early: %s", self._next_subject, self.last_status)
        if self._timer is not None:
            self._timer.cancel()
        remaining = self._started + self._wait_s - loop.time()
        self._timer = loop.call_later(max(0.0, min(PAUSE_S, remaining)), _end, waiter)


def _end(waiter: asyncio.Future[Msg | None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
