"""Puts a request's work where its node takes it, and takes it back when the request ends early.

A pool request is stored in the work stream (JetStream; the broker enforces each provider's
capacity), with the publish ack read here by hand; a direct one goes to its CLI resource by core
request-reply. `withdraw()` undoes either: the stored message deleted, the node told to cancel.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from typing import Any, cast

import msgspec
import nats.errors
import nats.js.api
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from iop import wire
from iop.edge.channel import Channel
from iop.edge.storage import WorkStream
from iop.errors import Unavailable
from iop.nats import bulk, inline
from iop.nats.server import MAX_PAYLOAD

PUBLISH_TIMEOUT_S = 2.0
"""One publish attempt to the work stream; a lost stream leader makes it time out (then retried)."""
PUBLISH_RETRY_FIRST_S = 0.1
PUBLISH_RETRY_MAX_S = 1.0
PUBLISH_GRACE_S = 1.0
"""Retries go on this long past the item's deadline: a node's Started sent just before it still arrives."""
HEADER_ROOM = 1024
"""Bytes kept free in a NATS message for headers (`Nats-Msg-Id`, the trace context) around an encoded work item."""
INLINE_BELOW = 256 * 1024
"""A pool request's body of this many bytes or more stays here and the node fetches it: the work
stream then stores (and a cluster replicates) a work item of a few hundred bytes, not the body."""
ACK_PREFIX = f"$JS.ACK.{wire.WORK_STREAM}."
"""What every ack subject of the work stream starts with: the only subject the edge sends +TERM to."""

log = logging.getLogger("iop.edge")


class Publisher:
    """Publishes work items (pool: the work stream; direct: a CLI resource) and withdraws them."""

    def __init__(self, nc: NATS, js: JetStreamContext, work_stream: WorkStream | None = None) -> None:
        self.nc = nc
        self.js = js
        self.work_stream = work_stream
        """Re-makes the work stream when a publish finds it gone."""
        self.bodies_by_reference = 0
        """Requests whose body stayed here (agent-sized, or too large for one message)."""
        self.bodies_sent = 0
        """Of those, the bodies sent to their node ahead of the work item (`_send_body`)."""
        self.parts_asked = 0
        """Parts that nodes asked for all the same (`body_part`): sent ahead and lost, or late."""
        self._acks_inbox = ""
        self._acks: dict[str, asyncio.Future[Msg]] = {}
        """Work publishes waiting for JetStream's ack, by channel id (see `_publish_work`)."""

    async def start(self) -> None:
        self._acks_inbox = self.nc.new_inbox()
        await inline.subscribe(self.nc, self._acks_inbox + ".*", self._on_publish_ack)  # read as it comes

    def _framed(self, ch: Channel, item: wire.WorkItem, limit: int, inline_below: int | None = None) -> bytes:
        """The encoded item; a body too large for one message (or of `inline_below` bytes or more)
        stays here and the node fetches it."""
        size = len(item.body)
        if inline_below is None or size < inline_below:
            data = wire.encode(item)
            if len(data) + HEADER_ROOM <= limit:
                return data  # the body travels inline
        ch.body = item.body
        self.bodies_by_reference += 1
        return wire.encode(msgspec.structs.replace(item, body=b"", body_size=size))

    def body_part(self, ch: Channel | None, part: wire.BodyPart) -> bytes:
        """The piece of a body kept here (`_framed`) that the node asks for; b"" for none.

        A view, not a copy (see `_send_body`)."""
        self.parts_asked += 1
        if ch is None or ch.ended or not 0 <= part.offset < len(ch.body):
            return b""  # never a valid piece: the node gives up on the request
        end = part.offset + wire.body_part_size(self.nc.max_payload)
        return cast(bytes, memoryview(ch.body)[part.offset : end])

    async def _send_body(self, ch: Channel) -> None:
        """A body kept here, sent to its node in parts just before its work item (iop/node/body.py).

        The node has it by the time it takes the item instead of asking for it then: the transfer
        overlaps the work item's trip through JetStream (0.5-1 ms at 800 KB). Core NATS, no ack:
        whatever does not arrive, the node fetches (`body_part`)."""
        body = memoryview(ch.body)
        step = wire.body_part_size(self.nc.max_payload)
        try:
            for offset in range(0, len(body), step):
                # A view of the body, queued as it is (iop/nats/bulk.py): no copy of the body here.
                await bulk.publish(self.nc, wire.body_subject(ch.node, ch.id, offset), [body[offset : offset + step]])
        except nats.errors.Error as exc:  # reconnecting, its buffer full: the node fetches instead
            log.debug("request %s: body not sent ahead: %s", ch.id, exc)
            return
        self.bodies_sent += 1

    async def to_pool(
        self, ch: Channel, provider: str, item: wire.WorkItem, trace: dict[str, str] | None = None
    ) -> None:
        """Publish the work to the provider's JetStream subject (the broker enforces its capacity).

        `trace`: the try's W3C trace context, carried as message headers to the node."""
        # The work stream refuses messages over MAX_PAYLOAD even where the server allows more. An
        # agent-sized body stays here: storing it cost nats-server more than the node's fetch of it
        # (docs/performance.md, "Agent-sized bodies").
        data = self._framed(ch, item, min(self.nc.max_payload, MAX_PAYLOAD), INLINE_BELOW)
        if ch.body and ch.node:
            await self._send_body(ch)
        delay = PUBLISH_RETRY_FIRST_S
        repaired = False
        while True:
            try:
                seq = await self._publish_work(ch, wire.work_subject(provider), data, item.id, trace)
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

    async def _publish_work(
        self, ch: Channel, subject: str, data: bytes, msg_id: str, trace: dict[str, str] | None = None
    ) -> int:
        """Store the work in the stream; its sequence there. Raises as nats-py's JetStream publish does.

        The ack comes to this edge's own inbox and resolves a plain future: no task, no timer task
        and no JSON object per request (nats-py's `js.publish` made all three). A client that
        leaves meanwhile does not cancel the wait for the ack: the channel keeps it, since only the
        ack tells where the work is to withdraw it (`withdraw`).
        """
        loop = asyncio.get_running_loop()
        acked: asyncio.Future[Msg] = loop.create_future()
        # One token per channel for every attempt: a late ack of an earlier attempt is the same
        # message (same Msg-Id), so it answers the current one as well.
        self._acks[ch.id] = acked
        # The wait is a future of its own that the ack or a timer ends, not asyncio.timeout around
        # a shield (5 us less per request in process): a cancel ends the wait and leaves `acked`.
        waiter: asyncio.Future[None] = loop.create_future()
        acked.add_done_callback(functools.partial(_end_wait, waiter))
        expiry = loop.call_later(PUBLISH_TIMEOUT_S, _end_wait, waiter, None)
        try:
            headers = {"Nats-Msg-Id": msg_id, **trace} if trace else {"Nats-Msg-Id": msg_id}
            await self.nc.publish(subject, data, reply=f"{self._acks_inbox}.{ch.id}", headers=headers)
            await waiter
            if not acked.done():
                raise nats.errors.TimeoutError
            msg = acked.result()
        except asyncio.CancelledError:
            ch.publishing = acked
            raise
        finally:
            expiry.cancel()
            if not acked.done() and ch.publishing is not acked:
                self._acks.pop(ch.id, None)
        return _stream_seq(msg)

    def _on_publish_ack(self, msg: Msg) -> None:
        acked = self._acks.pop(msg.subject.rpartition(".")[2], None)
        if acked is not None and not acked.done():
            acked.set_result(msg)

    async def to_resource(
        self, ch: Channel, node: str, resource: str, item: wire.WorkItem, trace: dict[str, str] | None = None
    ) -> None:
        """Hand the request to a CLI resource by core request-reply (no queue, no capacity)."""
        data = self._framed(ch, item, self.nc.max_payload)
        try:
            await self.nc.request(wire.cli_subject(node, resource), data, timeout=5.0, headers=trace)
            ch.last_heard = time.monotonic()  # Accepted: the node has it (a resend may ask for it)
        except nats.errors.NoRespondersError as exc:
            raise Unavailable(
                f"CLI resource '{resource}' on node '{node}' is not connected", code="no_provider"
            ) from exc
        except (nats.errors.Error, TimeoutError) as exc:
            raise Unavailable(
                f"CLI resource '{resource}' on node '{node}' did not answer", code="node_unresponsive"
            ) from exc

    async def withdraw(self, ch: Channel, *, tell_node: bool = True) -> None:
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


def _end_wait(waiter: asyncio.Future[None], _: object) -> None:
    """End a publish's wait for its ack: the ack came (`_` is its future) or the time is up (None)."""
    if not waiter.done():
        waiter.set_result(None)


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
