"""Carries one request to a node and its answer back: dispatch, the reply inbox, cancel and loss."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import nats.errors
import nats.js.api
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from iop import wire
from iop.edge.reorder import Reorder
from iop.edge.storage import WorkStream
from iop.errors import NodeLost, RelayGap, Unavailable, error_of, failure_of
from iop.nats.server import MAX_PAYLOAD

PUBLISH_TIMEOUT_S = 2.0
"""One publish attempt to the work stream; a lost stream leader makes it time out (then retried)."""
PUBLISH_RETRY_FIRST_S = 0.1
PUBLISH_RETRY_MAX_S = 1.0
SILENT_S = 3 * wire.PROBE_INTERVAL_S + 2.0
"""How long a running request's node may stay silent (no reply, no probe, no answer to a Resend)
before its answer counts as lost."""
RESEND_AFTER_S = wire.PROBE_INTERVAL_S + 1.0
"""A running request's node is heard at least every probe interval: this much silence means replies
were lost on the way (its end, most likely), and the edge asks the node to send them again."""
RESEND_AGAIN_S = 1.0
"""Least time between two Resend requests for one request while something is still missing."""
RESEND_TIMEOUT_S = 2.0
PUBLISH_GRACE_S = 1.0
"""Retries go on this long past the item's deadline: a node's Started sent just before it still arrives."""

log = logging.getLogger("iop.edge")

HEADER_ROOM = 1024
ACK_PREFIX = f"$JS.ACK.{wire.WORK_STREAM}."
"""Bytes kept free in a NATS message for headers (`Nats-Msg-Id`) around an encoded work item."""


@dataclass(eq=False)
class Channel:
    """The replies of one request, in order, plus what the edge must undo if it ends early.

    The relay knows nothing of pools or slots: whoever opened the channel learns of its life through
    `on_started` (the node began running it) and `on_ended` (it is over for the node: done, failed,
    lost, or closed by the edge). Each runs at most once, and `on_started` never after `on_ended`.
    """

    id: str
    node: str = ""
    """The node the work goes to (where a cancel or credit is sent)."""
    on_started: Callable[[], None] | None = None
    on_ended: Callable[[], None] | None = None
    """Runs when the node reports the end: frees what the request held before its client read it all."""
    queue: asyncio.Queue[wire.Started | wire.Chunk | wire.Done | wire.Failure] = field(default_factory=asyncio.Queue)
    stream_seq: int = 0
    """The work message's JetStream sequence, to delete it if the request ends before it starts."""
    started: bool = False
    ended: bool = False
    started_mono: float = 0.0
    first_chunk_mono: float = 0.0
    ack_subject: str = ""
    body: bytes = b""
    """The request body, kept here when it was too large to travel inside the work item."""
    taken_chunks: int = 0
    """Chunks (and bytes, below) the HTTP side has taken: what flow-control credit is granted from."""
    taken_bytes: int = 0
    credited_chunks: int = 0
    credited_bytes: int = 0
    buffered_bytes: int = 0
    """Answer bytes received from the node and not yet taken by the HTTP side (bounded by the window)."""
    peak_buffered_bytes: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    """HTTP headers the node asked for (on its first chunk), sent with the client's answer."""
    publishing: asyncio.Future[Msg] | None = None
    """The work's publish ack still on its way, when the request ended before it told the stream
    sequence (`Relay._abandon` waits for it to withdraw the work)."""
    outcome: wire.Done | wire.Failure | None = None
    """The node's last message: what only it knows (tokens, upstream status, exit code)."""
    last_heard: float = 0.0
    """Monotonic time of the node's last message about this request (a reply or a Probe)."""
    published_mono: float = 0.0
    """When the work message was stored in the stream."""
    checked: bool = False
    """Whether the sweep has asked the stream about this request once already."""
    order: Reorder = field(default_factory=Reorder)
    """The node's replies in order, each once, whatever NATS lost and a resend sent again."""
    resending: bool = False
    """A Resend for this request is waiting for the node's answer."""
    resend_mono: float = 0.0
    """When the last Resend was asked."""

    def start(self, at: float | None = None) -> None:
        """The node began running the request (`at`: when, on the monotonic clock; default now)."""
        if not self.started and not self.ended:
            self.started = True
            self.started_mono = time.monotonic() if at is None else at
            if self.on_started is not None:
                self.on_started()

    def end(self) -> None:
        if not self.ended:
            self.ended = True
            if self.on_ended is not None:
                self.on_ended()


class Relay:
    """One wildcard subscription receives every reply for this edge; a dict routes it to its request."""

    def __init__(self, nc: NATS, js: JetStreamContext, edge_id: str, work_stream: WorkStream | None = None) -> None:
        self.nc = nc
        self.js = js
        self.edge_id = edge_id
        self.prefix = wire.reply_prefix(edge_id)
        self.channels: dict[str, Channel] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._swept = 0.0
        self._reconnected = 0.0
        self.peak_buffered_bytes = 0
        """The most answer bytes one request ever had waiting here for its HTTP client."""
        self.credits_sent = 0
        self.forged = 0
        """Replies dropped because they came from another node than the one a request was sent to."""
        self.bodies_by_reference = 0
        """Requests whose body was too large for one message and was fetched by the node in parts."""
        self.work_stream = work_stream
        """Re-makes the work stream when a publish finds it gone."""
        self._acks_inbox = ""
        self._acks: dict[str, asyncio.Future[Msg]] = {}
        """Work publishes waiting for JetStream's ack, by channel id (see `_publish_work`)."""
        self.resends = 0
        """Resend requests this edge made (replies lost on the way, or its own reconnect)."""
        self.resends_unknown = 0
        """Of those, answered by a node that no longer had the request (the request failed with relay_gap)."""
        self._whole: dict[str, list[str]] = {}
        """Requests whose answer arrived whole, by node, not yet told to the node (`wire.Received`)."""
        self._whole_timer: asyncio.TimerHandle | None = None
        self.duplicates = 0
        """Replies dropped because they had arrived already (copies a resend sent again)."""

    async def start(self) -> None:
        self._acks_inbox = self.nc.new_inbox()
        await self.nc.subscribe(self._acks_inbox + ".*", cb=self._on_publish_ack, pending_msgs_limit=10_000_000)
        await self.nc.subscribe(
            self.prefix + ".>",
            cb=self._on_reply,
            pending_msgs_limit=10_000_000,
            pending_bytes_limit=2 * 1024 * 1024 * 1024,
        )

    def open(
        self,
        node: str,
        *,
        on_started: Callable[[], None] | None = None,
        on_ended: Callable[[], None] | None = None,
    ) -> Channel:
        """A channel for one request to `node`; `close()` it when the request is over."""
        rid = secrets.token_hex(12)
        ch = Channel(rid, node, on_started, on_ended)
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

    async def _on_reply(self, msg: Msg) -> None:
        try:
            reply = wire.decode_reply(msg.data)
        except msgspec.DecodeError:
            log.warning("undecodable reply on %s dropped", msg.subject)
            return
        if isinstance(reply, wire.Claim):
            ch = self._channel(reply.id, msg.subject)
            go = ch is not None and not ch.started and not ch.ended
            if msg.reply:
                await self.nc.publish(msg.reply, wire.encode(wire.Verdict(go)))
            return
        if isinstance(reply, wire.Probe):
            if msg.reply:
                await self.nc.publish(msg.reply, wire.encode(self._credit_of(reply.id, msg.subject)))
            return
        if isinstance(reply, wire.BodyPart):
            if msg.reply:
                await self.nc.publish(msg.reply, self._body_part(reply, msg.subject))
            return
        if isinstance(reply, wire.Accepted):
            return
        if isinstance(reply, wire.Replies):
            for item in reply.items:
                self._on_answer(item, msg.subject)
        else:
            self._on_answer(reply, msg.subject)

    def _on_answer(self, reply: wire.Started | wire.Chunk | wire.Done | wire.Failure, subject: str) -> None:
        """One piece of a request's answer, from the node it was sent to (checked for each piece)."""
        ch = self._channel(reply.id, subject)
        if ch is None:
            if isinstance(reply, wire.Started) and reply.id not in self.channels:
                # A node began work this edge has already given up (the client left before the edge
                # could withdraw it from the stream): stop it now, not at the node's next probe.
                node = subject.rsplit(".", 2)[-2]
                self._spawn(self._abandon(Channel(reply.id, node)))
            return
        ch.last_heard = time.monotonic()
        self._answer(ch, reply)

    def _answer(self, ch: Channel, reply: wire.Started | wire.Chunk | wire.Done | wire.Failure) -> None:
        """One reply of the node about `ch`: handed to the reader in order, or held until a gap fills."""
        duplicates = ch.order.duplicates
        for r in ch.order.take(reply):
            self._deliver(ch, r)
        self.duplicates += ch.order.duplicates - duplicates
        if ch.order.missing and time.monotonic() - ch.resend_mono >= RESEND_AGAIN_S:
            # A chunk came past one that never did, or the end counts more chunks than came:
            # lost on the way (a NATS server died). The node kept them; ask at once.
            self._ask_resend(ch)

    def _deliver(self, ch: Channel, reply: wire.Started | wire.Chunk | wire.Done | wire.Failure) -> None:
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
        elif isinstance(reply, wire.Done | wire.Failure):
            ch.outcome = reply
            ch.end()
            self._received(ch)
        ch.queue.put_nowait(reply)

    def _received(self, ch: Channel) -> None:
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

    def _credit_of(self, rid: str, subject: str) -> wire.Credit:
        ch = self._channel(rid, subject)
        if ch is not None:
            ch.last_heard = time.monotonic()
        if ch is None or ch.ended:
            # Unknown here (client gone, failed at the edge): the node stops the work.
            return wire.Credit(rid, 0, 0, known=False)
        return wire.Credit(rid, ch.taken_chunks, ch.taken_bytes)

    def _body_part(self, part: wire.BodyPart, subject: str) -> bytes:
        ch = self._channel(part.id, subject)
        if ch is None or ch.ended or not 0 <= part.offset < len(ch.body):
            return b""  # never a valid piece: the node gives up on the request
        size = min(wire.BODY_PART_BYTES, self.nc.max_payload - HEADER_ROOM)
        return ch.body[part.offset : part.offset + size]

    def _framed(self, ch: Channel, item: wire.WorkItem, limit: int) -> bytes:
        """The encoded item; a body too large for one message stays here and the node fetches it."""
        data = wire.encode(item)
        if len(data) + HEADER_ROOM <= limit:
            return data  # the fast path: the body travels inline
        ch.body = item.body
        self.bodies_by_reference += 1
        return wire.encode(msgspec.structs.replace(item, body=b"", body_size=len(item.body)))

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
        """Fail every request running on (or sent to) a node that is gone."""
        for ch in list(self.channels.values()):
            if ch.node == node and not ch.ended:
                ch.end()
                ch.queue.put_nowait(failure_of(NodeLost(f"node {node} was lost: {reason}"), ch.id, -1))
                self._spawn(self._abandon(ch, tell_node=False))

    async def dispatch_pool(self, ch: Channel, provider: str, item: wire.WorkItem) -> None:
        """Publish the work to the provider's JetStream subject (the broker enforces its capacity)."""
        # The work stream refuses messages over MAX_PAYLOAD even where the server allows more.
        data = self._framed(ch, item, min(self.nc.max_payload, MAX_PAYLOAD))
        delay = PUBLISH_RETRY_FIRST_S
        repaired = False
        while True:
            try:
                seq = await self._publish_work(ch, wire.work_subject(provider), data, item.id)
                break
            except (nats.errors.Error, TimeoutError) as exc:
                # The stream may be electing a new leader (a cluster lost a server), or have stored
                # the message and lost only its ack. The same Msg-Id again is stored at most once
                # (the stream's duplicate window), so retry until the item's deadline: past it a
                # node terminates the message unrun, so giving up then cannot leave a second run.
                if ch.started:
                    return  # stored after all: a node runs it and this channel has its answer
                late = time.time() + delay >= item.deadline + PUBLISH_GRACE_S
                if (
                    self.work_stream is not None
                    and not repaired
                    and isinstance(exc, nats.js.errors.NoStreamResponseError)
                ):
                    # Nothing stores the subject: the stream may be gone (deleted, lost with a failed
                    # store). Make it and the consumers again, once per request, and publish at once.
                    made = await self.work_stream.repair(exc)
                    repaired = made is not None  # skipped (it failed a moment ago): try again later
                    if made:
                        continue
                if late or isinstance(exc, nats.errors.ConnectionClosedError):
                    ch.end()
                    reason = str(exc) or type(exc).__name__
                    if self.work_stream is not None:
                        self.work_stream.failed(exc)
                        reason = self.work_stream.error or reason
                    raise Unavailable(f"cannot queue the request on NATS: {reason}", code="bus_error") from exc
                log.info(
                    "request %s: publish failed (%s); retrying in %.2fs", item.id, exc or type(exc).__name__, delay
                )
                await asyncio.sleep(delay)  # backoff while the broker recovers, not a synchronisation
                delay = min(delay * 2, PUBLISH_RETRY_MAX_S)
        if self.work_stream is not None:
            self.work_stream.ok()
        ch.stream_seq = seq
        ch.published_mono = time.monotonic()

    async def _publish_work(self, ch: Channel, subject: str, data: bytes, msg_id: str) -> int:
        """Store the work in the stream; its sequence there. Raises as nats-py's JetStream publish does.

        The ack comes to this edge's own inbox and resolves a plain future: no task, no timer task
        and no JSON object per request (nats-py's `js.publish` made all three). A client that
        leaves meanwhile does not cancel the wait for the ack: the channel keeps it, since only the
        ack tells where the work is to withdraw it (`_abandon`).
        """
        acked: asyncio.Future[Msg] = asyncio.get_running_loop().create_future()
        # One token per channel for every attempt: a late ack of an earlier attempt is the same
        # message (same Msg-Id), so it answers the current one as well.
        self._acks[ch.id] = acked
        try:
            await self.nc.publish(subject, data, reply=f"{self._acks_inbox}.{ch.id}", headers={"Nats-Msg-Id": msg_id})
            async with asyncio.timeout(PUBLISH_TIMEOUT_S):
                msg = await asyncio.shield(acked)
        except asyncio.CancelledError:
            ch.publishing = acked
            raise
        except TimeoutError:
            raise nats.errors.TimeoutError from None
        finally:
            if not acked.done() and ch.publishing is not acked:
                self._acks.pop(ch.id, None)
        return _stream_seq(msg)

    async def _on_publish_ack(self, msg: Msg) -> None:
        acked = self._acks.pop(msg.subject.rpartition(".")[2], None)
        if acked is not None and not acked.done():
            acked.set_result(msg)

    async def dispatch_direct(self, ch: Channel, node: str, resource: str, item: wire.WorkItem) -> None:
        """Hand the request to a CLI resource by core request-reply (no queue, no capacity)."""
        data = self._framed(ch, item, self.nc.max_payload)
        try:
            await self.nc.request(wire.cli_subject(node, resource), data, timeout=5.0)
            ch.last_heard = time.monotonic()  # Accepted: the node has it (a resend may ask for it)
        except nats.errors.NoRespondersError as exc:
            raise Unavailable(
                f"CLI resource '{resource}' on node '{node}' is not connected", code="no_provider"
            ) from exc
        except (nats.errors.Error, TimeoutError) as exc:
            raise Unavailable(
                f"CLI resource '{resource}' on node '{node}' did not answer", code="node_unresponsive"
            ) from exc

    async def replies(self, ch: Channel, start_deadline: float | None) -> AsyncIterator[bytes]:
        """The answer's bytes in order; raises a RequestError for a failure.

        `start_deadline` (loop clock) bounds the wait for the node to start the item: past it, the
        request has waited longer than the queue timeout allows.
        """
        expected = 0
        q = ch.queue
        while True:
            if not ch.started and start_deadline is not None:
                try:
                    async with asyncio.timeout_at(start_deadline):
                        reply = await q.get()
                except TimeoutError:
                    raise Unavailable(
                        "the request was not started within the queue timeout", code="queue_timeout"
                    ) from None
            else:
                reply = q.get_nowait() if not q.empty() else await q.get()
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

        Replies are core NATS: those in flight when a server of the cluster dies (the node's or
        this edge's) are lost. A node probes each request it runs every PROBE_INTERVAL_S, so one
        silent for RESEND_AFTER_S while started (or once heard from) has lost replies on the way,
        its end most likely: the edge asks the node to send them again (the node keeps them).
        One never heard from whose work message has left the stream ran with everything lost:
        asked the same way. Only a node that no longer has the request, or answers nothing for
        SILENT_S, fails it with relay_gap; it ran once, and relay_gap is not retried by the edge.
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

    def close(self, ch: Channel) -> None:
        """Forget the request; if the node may still work on it, cancel it there."""
        self.channels.pop(ch.id, None)
        if not ch.ended:
            ch.end()
            self._spawn(self._abandon(ch))

    async def _abandon(self, ch: Channel, *, tell_node: bool = True) -> None:
        """Client gone, request failed at the edge, or node lost: stop the work, free the broker slot."""
        if ch.publishing is not None:
            with contextlib.suppress(nats.errors.Error, TimeoutError):
                try:
                    async with asyncio.timeout(PUBLISH_TIMEOUT_S):
                        ch.stream_seq = _stream_seq(await ch.publishing)
                finally:
                    self._acks.pop(ch.id, None)
        with contextlib.suppress(nats.errors.Error, OSError, TimeoutError):
            if ch.stream_seq and not ch.started:
                # Still in the stream (never fetched): remove it so it can never run later. First,
                # so that a node fetching it meanwhile hears the cancel below after it knows the id.
                with contextlib.suppress(nats.js.errors.Error):
                    await self.js.delete_msg(wire.WORK_STREAM, ch.stream_seq)
            if tell_node and ch.node:
                await self.nc.publish(wire.cancel_subject(ch.node), wire.encode(wire.Cancel(ch.id)))
            if ch.ack_subject and not tell_node:
                # The node is gone and cannot ack: terminate its delivery so the slot frees now,
                # not after ack_wait (the redelivery would be dropped by the claim anyway).
                await self.nc.publish(ch.ack_subject, b"+TERM")

    def _spawn(self, coro: object) -> None:
        t: asyncio.Task[None] = asyncio.create_task(coro)  # type: ignore[arg-type]
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)


class _PubAck(msgspec.Struct):
    seq: int = 0
    error: dict[str, Any] | None = None


_decode_puback = msgspec.json.Decoder(_PubAck).decode


def _stream_seq(msg: Msg) -> int:
    """The stream sequence a JetStream publish ack names; raises what nats-py's `js.publish` raises."""
    if msg.headers and msg.headers.get(nats.js.api.Header.STATUS) == "503":
        raise nats.js.errors.NoStreamResponseError  # nothing stores the subject (no stream)
    try:
        ack = _decode_puback(msg.data)
    except msgspec.DecodeError as exc:
        raise nats.errors.Error(f"unreadable publish ack: {exc}") from None
    if ack.error is not None:
        raise nats.js.errors.APIError.from_error(ack.error)
    return ack.seq
