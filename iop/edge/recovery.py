"""Getting back replies NATS lost, and telling nodes which answers arrived whole.

Replies are core NATS: those in flight when a server of the cluster dies (the node's or this
edge's) are lost. The node keeps what it sent until the edge says the answer arrived whole
(`wire.Received`, batched here); meanwhile the edge may ask for it again (`wire.Resend`). Only a
node that no longer has a request, or answers nothing for SILENT_S, fails it with relay_gap.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine
from typing import Any

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from iop import wire
from iop.edge.channel import Channel
from iop.errors import RelayGap, failure_of

SILENT_S = 3 * wire.PROBE_INTERVAL_S + 2.0
"""How long a running request's node may stay silent (no reply, no probe, no answer to a Resend)
before its answer counts as lost."""
RESEND_AFTER_S = wire.PROBE_INTERVAL_S + 1.0
"""A running request's node is heard at least every probe interval: this much silence means replies
were lost on the way (its end, most likely), and the edge asks the node to send them again."""
RESEND_AGAIN_S = 1.0
"""Least time between two Resend requests for one request while something is still missing."""
RESEND_TIMEOUT_S = 2.0

log = logging.getLogger("iop.edge")


class Recovery:
    """Resends, the sweep of silent requests, and the Received batches, over the relay's channels."""

    def __init__(self, nc: NATS, js: JetStreamContext, channels: dict[str, Channel]) -> None:
        self.nc = nc
        self.js = js
        self.channels = channels
        """The relay's open requests (shared, not copied)."""
        self.resends = 0
        """Resend requests this edge made (replies lost on the way, or its own reconnect)."""
        self.resends_unknown = 0
        """Of those, answered by a node that no longer had the request (the request failed with relay_gap)."""
        self._swept = 0.0
        self._reconnected = 0.0
        self._whole: dict[str, list[str]] = {}
        """Requests whose answer arrived whole, by node, not yet told to the node (`wire.Received`)."""
        self._whole_timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    # --- Received ------------------------------------------------------------------------------

    def received(self, ch: Channel) -> None:
        """Tell `ch`'s node, with the other ends gathered meanwhile, that this answer arrived whole."""
        ids = self._whole.get(ch.node)
        if ids is None:
            ids = self._whole[ch.node] = []
        ids.append(ch.id)
        if len(ids) >= wire.RECEIVED_BATCH:
            self._send_received(ch.node)
        elif self._whole_timer is None:
            self._whole_timer = asyncio.get_running_loop().call_later(wire.RECEIVED_EVERY_S, self._send_all_received)

    def _send_all_received(self) -> None:
        self._whole_timer = None
        for node in list(self._whole):
            self._send_received(node)

    def _send_received(self, node: str) -> None:
        ids = self._whole.pop(node, None)
        if ids:
            self._spawn(self._publish_quietly(wire.received_subject(node), wire.encode(wire.Received(ids))))

    async def _publish_quietly(self, subject: str, data: bytes) -> None:
        # Lost, the node keeps those answers until their grace ends (REPLAY_GRACE_S): nothing breaks.
        with contextlib.suppress(nats.errors.Error, OSError):
            await self.nc.publish(subject, data)

    # --- Resend --------------------------------------------------------------------------------

    def missing(self, ch: Channel) -> None:
        """`ch`'s replies have a gap (a chunk came past one that never did, or the end counts more
        chunks than came): lost on the way. The node kept them; ask at once, unless just asked."""
        if time.monotonic() - ch.resend_mono >= RESEND_AGAIN_S:
            self._ask_resend(ch)

    def _ask_resend(self, ch: Channel, *, again: bool = False) -> None:
        """Ask `ch`'s node to send again what this edge has not received (one request at a time,
        unless `again`: the one in flight may have been lost with the connection)."""
        if ch.ended or not ch.node or (ch.resending and not again):
            return
        ch.resending = True
        ch.resend_mono = time.monotonic()
        self._spawn(self._resend(ch))

    async def _resend(self, ch: Channel) -> None:
        ask = wire.Resend(ch.id, ch.order.next_seq, started=not ch.order.started)
        self.resends += 1
        try:
            reply = await self.nc.request(wire.resend_subject(ch.node), wire.encode(ask), timeout=RESEND_TIMEOUT_S)
            answer = wire.decode_resent(reply.data)
        except (nats.errors.Error, TimeoutError, msgspec.DecodeError) as exc:
            # Asked again at the next sweep; a node silent for SILENT_S fails the request there.
            log.info("request %s: node %s did not answer a resend (%s)", ch.id, ch.node, type(exc).__name__)
            return
        finally:
            ch.resending = False
        if answer.known:
            ch.last_heard = time.monotonic()  # the node is there, and has sent what it kept
        elif not ch.ended and self.channels.get(ch.id) is ch:
            self.resends_unknown += 1
            self._answer_lost(ch, "its node no longer has it")

    # --- the sweep -----------------------------------------------------------------------------

    def bus_reconnected(self) -> None:
        """While this edge was cut off it heard nobody: every open request's silence starts now.

        What its nodes sent meanwhile is lost (nobody subscribed for it): ask each node to send
        again what it kept of every request it is known to run.
        """
        self._reconnected = time.monotonic()
        for ch in list(self.channels.values()):
            if not ch.ended and (ch.started or ch.last_heard):
                self._ask_resend(ch, again=True)

    def sweep(self) -> None:
        """Ask for replies lost on the way; fail with relay_gap what cannot come back (every tick).

        A node probes each request it runs every PROBE_INTERVAL_S, so one silent for
        RESEND_AFTER_S while started (or once heard from) has lost replies on the way, its end
        most likely: the edge asks the node to send them again (the node keeps them). One never
        heard from whose work message has left the stream ran with everything lost: asked the
        same way. Only a node that no longer has the request, or answers nothing for SILENT_S,
        fails it with relay_gap; it ran once, and relay_gap is not retried by the edge.
        """
        now = time.monotonic()
        if now - self._swept < 1.0 or not self.nc.is_connected:
            return
        self._swept = now
        for ch in list(self.channels.values()):
            if ch.ended:
                continue
            if ch.order.missing and now - ch.resend_mono >= RESEND_AGAIN_S:
                self._ask_resend(ch)  # the last resend's copies were lost too, or never sent
            quiet = now - max(ch.last_heard, ch.started_mono, ch.published_mono, self._reconnected)
            if quiet < RESEND_AFTER_S:
                continue
            if ch.started or ch.last_heard:
                if quiet >= SILENT_S:
                    self._answer_lost(ch)
                elif now - ch.resend_mono >= RESEND_AFTER_S:
                    self._ask_resend(ch)
            elif ch.stream_seq and not ch.checked and quiet >= SILENT_S:
                ch.checked = True  # once: a request may wait in the broker for long, legitimately
                self._spawn(self._check_gone(ch))

    async def _check_gone(self, ch: Channel) -> None:
        try:
            await self.js.get_msg(wire.WORK_STREAM, ch.stream_seq)
            return  # still in the stream: queued, or to be redelivered after ack_wait
        except nats.js.errors.NotFoundError:
            pass
        except (nats.errors.Error, TimeoutError):
            return  # cannot tell: it waits for its deadline
        if not ch.ended and not ch.last_heard:
            # Taken by its node (acked or terminated) with every reply lost: the node may have it.
            self._ask_resend(ch, again=True)

    def _answer_lost(self, ch: Channel, why: str = "its node went silent") -> None:
        log.warning("request %s: %s; the answer was lost on the way (NATS)", ch.id, why)
        ch.end()
        ch.queue.put_nowait(failure_of(RelayGap("the answer was lost between node and edge"), ch.id, -1))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        t = asyncio.create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
