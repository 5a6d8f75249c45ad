"""Routes each reply to its request: one wildcard subscription, a dict of open channels, the credit.

What a request's reader takes from here is its answer's bytes in order (`replies()`); what the
node hears back is the flow-control credit. Putting the work where a node takes it (and taking it
back) is `publish.Publisher`'s; getting back what NATS lost is `recovery.Recovery`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections import deque
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import msgspec
import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext

from iop import wire
from iop.edge.channel import Channel, Holder
from iop.edge.junk import Junk
from iop.edge.publish import ACK_PREFIX, Publisher
from iop.edge.recovery import Recovery
from iop.edge.storage import WorkStream
from iop.errors import NodeLost, RelayGap, Unavailable, error_of, failure_of
from iop.nats import bulk, inline

log = logging.getLogger("iop.edge")

Answer = wire.Started | wire.Chunk | wire.Done | wire.Failure

_LATE = object()
"""Queued on a channel when its request's start deadline passes (`Relay.replies`)."""


class Relay:
    """One wildcard subscription receives every reply for this edge; a dict routes it to its request."""

    def __init__(self, nc: NATS, js: JetStreamContext, edge_id: str, work_stream: WorkStream | None = None) -> None:
        self.nc = nc
        self.edge_id = edge_id
        self.prefix = wire.reply_prefix(edge_id)
        self.channels: dict[str, Channel] = {}
        self.publish = Publisher(nc, js, work_stream)
        self.recovery = Recovery(nc, js, self.channels)
        self._tasks: set[asyncio.Task[None]] = set()
        self._replies: Subscription | None = None
        self._answers: deque[tuple[str, bytes]] = deque()
        """Answers to nodes' questions (Claim, Probe, BodyPart) not yet published: (subject, payload)."""
        self._answering: asyncio.Task[None] | None = None
        self.peak_buffered_bytes = 0
        """The most answer bytes one request ever had waiting here for its HTTP client."""
        self.credits_sent = 0
        self.forged = 0
        """Replies dropped because they came from another node than the one a request was sent to."""
        self.duplicates = 0
        self.undecodable = Junk("reply")
        """Messages on this edge's reply subjects that are no reply."""
        """Replies dropped because they had arrived already (copies a resend sent again)."""

    async def start(self) -> None:
        await self.publish.start()
        # Handled as nats-py reads them (iop/nats/inline.py): no task's turn between a node's
        # reply and the request it wakes.
        self._replies = await inline.subscribe(self.nc, self.prefix + ".>", self._on_reply)

    def open(self, node: str, holder: Holder | None = None) -> Channel:
        """A channel for one request to `node`; `close()` it when the request is over."""
        rid = secrets.token_hex(12)
        ch = Channel(rid, node, holder)
        self.channels[rid] = ch
        return ch

    def reply_to(self, ch: Channel) -> str:
        """`iop.reply.<edge>.<node>.<request>`: only `ch.node` may publish there (NATS permissions)."""
        return wire.reply_subject(self.edge_id, ch.node, ch.id)

    def _channel(self, rid: str, subject: str) -> Channel | None:
        """The request a reply is about, if it came from the node the request was sent to.

        The node's id is the subject's second-to-last token, and nats-server lets a node publish
        only under its own id: so another node can neither answer, probe nor read this request.
        """
        ch = self.channels.get(rid)
        if ch is None:
            return None
        if not subject.endswith(f".{ch.node}.{rid}"):
            self.forged += 1
            log.warning("reply for request %s from the wrong node dropped (subject %s)", rid, subject)
            return None
        return ch

    def _on_reply(self, msg: Msg) -> None:
        """A message on this edge's reply subjects, as it is read (in wire order): an answer goes to
        its request at once; a node's question is answered by a task of its own."""
        try:
            reply = wire.decode_reply(msg.data)
        except msgspec.DecodeError:
            self.undecodable.dropped(msg.subject)
            return
        if isinstance(reply, wire.Claim):
            ch = self._channel(reply.id, msg.subject)
            go = ch is not None and not ch.started and not ch.ended
            if msg.reply:
                self._tell_node(msg.reply, wire.encode(wire.Verdict(go)))
            return
        if isinstance(reply, wire.Probe):
            if msg.reply:
                self._tell_node(msg.reply, wire.encode(self._credit_of(reply.id, msg.subject)))
            return
        if isinstance(reply, wire.BodyPart):
            if msg.reply:
                # A view of the body, not copied.
                self._tell_node(msg.reply, self.publish.body_part(self._channel(reply.id, msg.subject), reply))
            return
        if isinstance(reply, wire.Accepted):
            return
        if isinstance(reply, wire.Replies):
            # The reader hears of the batch only after all of it is taken in: a Done in it frees
            # the slot first, so the next waiter's work goes out before this answer's relay and
            # its record run (measured: 0.5 ms of a handover's 2 under load).
            woken: list[tuple[Channel, Answer]] = []
            for item in reply.items:
                self._on_answer(item, msg.subject, woken)
            for ch, r in woken:
                ch.queue.put_nowait(r)
        else:
            self._on_answer(reply, msg.subject)

    def _on_answer(self, reply: Answer, subject: str, woken: list[tuple[Channel, Answer]] | None = None) -> None:
        """One piece of a request's answer, from the node it was sent to (checked for each piece).

        `woken`: where the pieces go that the reader is to have, when the caller hands them over itself."""
        ch = self._channel(reply.id, subject)
        if ch is None:
            if isinstance(reply, wire.Started) and reply.id not in self.channels:
                # A node began work this edge has already given up (the client left before the edge
                # could withdraw it from the stream): stop it now, not at the node's next probe.
                node = subject.rsplit(".", 2)[-2]
                self._spawn(self.publish.withdraw(Channel(reply.id, node)))
            return
        ch.last_heard = time.monotonic()
        self._answer(ch, reply, woken)

    def _answer(self, ch: Channel, reply: Answer, woken: list[tuple[Channel, Answer]] | None = None) -> None:
        """One reply of the node about `ch`: handed to the reader in order, or held until a gap fills."""
        duplicates = ch.order.duplicates
        for r in ch.order.take(reply):
            self._deliver(ch, r)
            if woken is None:
                ch.queue.put_nowait(r)
            else:
                woken.append((ch, r))
        self.duplicates += ch.order.duplicates - duplicates
        if ch.order.missing:
            self.recovery.missing(ch)

    def _deliver(self, ch: Channel, reply: Answer) -> None:
        """What a reply tells of the request (its start, its bytes waiting, its end), before its reader has it."""
        now = time.monotonic()
        if isinstance(reply, wire.Chunk):
            if not ch.first_chunk_mono:
                ch.first_chunk_mono = now
            if not ch.started:
                ch.start(now)  # its Started was lost on the way; the chunk says as much
            ch.buffered_bytes += len(reply.data)
            if ch.buffered_bytes > ch.peak_buffered_bytes:
                ch.peak_buffered_bytes = ch.buffered_bytes
                self.peak_buffered_bytes = max(self.peak_buffered_bytes, ch.buffered_bytes)
        elif isinstance(reply, wire.Started):
            if not ch.ack_subject and not ch.ended:
                # Only ever an ack subject of the work stream: the edge publishes +TERM there.
                ch.ack_subject = reply.ack if reply.ack.startswith(ACK_PREFIX) else ""
                # The node may have held Started back to send it with the first bytes (wire.Replies).
                ch.start(now - min(max(reply.held_ms, 0.0), 1000.0) / 1000)
                ch.cold_start_ms = max(reply.cold_start_ms, 0.0)
        elif isinstance(reply, wire.Done | wire.Failure):
            ch.outcome = reply
            ch.end()
            self.recovery.received(ch)

    def _credit_of(self, rid: str, subject: str) -> wire.Credit:
        ch = self._channel(rid, subject)
        if ch is not None:
            ch.last_heard = time.monotonic()
        if ch is None or ch.ended:
            # Unknown here (client gone, failed at the edge): the node stops the work.
            return wire.Credit(rid, 0, 0, known=False)
        return wire.Credit(rid, ch.taken_chunks, ch.taken_bytes)

    async def _grant(self, ch: Channel) -> None:
        """Tell the node how much of the answer the HTTP side has taken (every quarter window)."""
        ch.credited_chunks, ch.credited_bytes = ch.taken_chunks, ch.taken_bytes
        if not ch.node:
            return
        self.credits_sent += 1
        credit = wire.Credit(ch.id, ch.taken_chunks, ch.taken_bytes)
        # A lost credit is recovered by the node's next Probe; never fail the answer over it.
        with contextlib.suppress(nats.errors.Error, OSError):
            await self.nc.publish(wire.credit_subject(ch.node), wire.encode(credit))

    def node_lost(self, node: str, reason: str) -> None:
        """Fail every request running on (or sent to) a node that is gone.

        Its replies that arrived before the news of its end (a node that stops sends each request
        it cuts short its failure, then leaves) were handled as they were read, before the news's
        own handler ran: a request the node answered keeps its answer."""
        for ch in list(self.channels.values()):
            if ch.node == node and not ch.ended:
                ch.end()
                ch.queue.put_nowait(failure_of(NodeLost(f"node {node} was lost: {reason}"), ch.id, -1))
                self._spawn(self.publish.withdraw(ch, tell_node=False))

    async def replies(self, ch: Channel, start_deadline: float | None) -> AsyncIterator[bytes]:
        """The answer's bytes in order; raises a RequestError for a failure.

        `start_deadline` (loop clock) bounds the wait for the node to start the item: past it, the
        request has waited longer than the queue timeout allows.
        """
        expected = 0
        q: asyncio.Queue[Any] = ch.queue
        # The deadline is a timer that queues _LATE, not an asyncio.timeout around the wait: no
        # Timeout, task lookup and reschedule for every request that starts in time.
        late = None
        if not ch.started and start_deadline is not None:
            late = asyncio.get_running_loop().call_at(start_deadline, q.put_nowait, _LATE)
        try:
            while True:
                reply = q.get_nowait() if not q.empty() else await q.get()
                if reply is _LATE:
                    if ch.started:
                        continue  # started in time: the timer fired before its Started was read
                    raise Unavailable("the request was not started within the queue timeout", code="queue_timeout")
                if isinstance(reply, wire.Chunk):
                    if reply.seq != expected:
                        raise RelayGap("part of the answer was lost between node and edge")
                    expected += 1
                    if reply.headers:
                        ch.headers.update(reply.headers)
                    yield reply.data
                    # Back here only once the HTTP side has sent the chunk (uvicorn's send waits while
                    # the socket is full): that is when the node may send more.
                    size = len(reply.data)
                    ch.taken_chunks += 1
                    ch.taken_bytes += size
                    ch.buffered_bytes -= size
                    if (
                        ch.taken_chunks - ch.credited_chunks >= wire.CREDIT_EVERY_CHUNKS
                        or ch.taken_bytes - ch.credited_bytes >= wire.CREDIT_EVERY_BYTES
                    ):
                        await self._grant(ch)
                elif isinstance(reply, wire.Done):
                    if reply.chunks != expected:
                        raise RelayGap("part of the answer was lost between node and edge")
                    return
                elif isinstance(reply, wire.Failure):
                    err = error_of(reply)
                    err.ended_stream = reply.ended and reply.chunks == expected
                    raise err
        finally:
            if late is not None:
                late.cancel()

    def close(self, ch: Channel) -> None:
        """Forget the request; if the node may still work on it, cancel it there."""
        self.channels.pop(ch.id, None)
        if not ch.ended:
            ch.end()
            self._spawn(self.publish.withdraw(ch))

    def _tell_node(self, subject: str, payload: bytes) -> None:
        """Publish an answer to a node's question after those before it, one at a time: a publish
        may wait for nats-py's buffer to drain (a body part is 1 MiB), and a node's many questions
        then wait here, in order, instead of all going into that buffer at once."""
        self._answers.append((subject, payload))
        if self._answering is None:
            self._answering = asyncio.create_task(self._tell_all())

    async def _tell_all(self) -> None:
        try:
            while self._answers:
                subject, payload = self._answers.popleft()
                # Lost with the connection: the node asks again when its question times out.
                with contextlib.suppress(nats.errors.Error, OSError):
                    await bulk.publish(self.nc, subject, [payload])
        finally:
            self._answering = None

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        t = asyncio.create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
