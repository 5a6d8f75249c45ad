"""A request body that stayed at its edge: sent ahead to the node that runs it, or fetched by it.

A pool request's agent-sized body (256 KiB or more: the edge's `INLINE_BELOW`) and any body too
large for one NATS message stay in the edge's memory with the request; the work item says how many
bytes (`body_size`). Just before it publishes the work item the edge sends the body's parts to the
item's node on core NATS (`wire.body_subject`, which only edges may publish and only that node
read), so the transfer overlaps the item's trip through JetStream and the node has the body when
it takes the item. What did not arrive (the node was reconnecting, parts were dropped or came
after the item) the node fetches: it asks for every missing part at once (`BodyPart` requests on
the item's reply subject, which only this node may use for it), one round trip and the transfer,
not a round trip per part. An edge whose parts are smaller than the node's (another server's
`max_payload`) is asked again for the rest of each range.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from iop import wire
from iop.errors import BodyUnavailable

PART_TIMEOUT_S = 5.0
"""How long one fetched part may take to arrive."""
SENT_KEEP_S = 10.0
"""How long parts sent ahead wait for their work item (an edge sends them only to a node whose
slot it holds, so the item follows within milliseconds); then they are dropped."""
SENT_MAX_BYTES = 256 * 1024 * 1024
"""The most bytes of parts sent ahead that the node holds at once; a part past it is dropped (its
body is then fetched), so a burst of them costs bounded memory."""
REST_WAIT_S = 0.5
"""A body whose first parts are here when its item is taken: how long the rest may take to come."""
TAKEN_KEPT = 4096
"""How many of the last bodies taken are remembered, so that their late parts are dropped at once."""


@dataclass
class _Parts:
    expiry: asyncio.TimerHandle
    by_offset: dict[int, bytes] = field(default_factory=dict)
    size: int = 0
    arrived: asyncio.Event = field(default_factory=asyncio.Event)


class SentBodies:
    """Parts of bodies that edges sent ahead of their work items, by request id, bounded in bytes and time."""

    def __init__(self, max_bytes: int = SENT_MAX_BYTES, keep_s: float = SENT_KEEP_S) -> None:
        self.max_bytes = max_bytes
        self.keep_s = keep_s
        self.held = 0
        """Bytes held now."""
        self._bodies: dict[str, _Parts] = {}
        self._taken: dict[str, None] = {}
        """The last bodies taken (oldest first): a part of one came too late (a cluster may route
        parts and items by different servers) and is not kept for `keep_s`."""
        self.whole = 0
        """Bodies that were here whole when their item was taken."""
        self.fetched = 0
        """Bodies (or their missing parts) fetched from the edge."""
        self.dropped = 0
        """Parts dropped: over `max_bytes`, malformed, or never taken within `keep_s`."""

    def on_part(self, msg: Msg) -> None:
        """A part on `wire.body_subject(node)`: `iop.node.<node>.body.<request>.<offset>`."""
        _, _, request, offset_text = msg.subject.rsplit(".", 3)
        if not offset_text.isdigit() or not msg.data or self.held + len(msg.data) > self.max_bytes:
            self.dropped += 1
            return
        if request in self._taken:
            self.dropped += 1
            return
        offset = int(offset_text)
        parts = self._bodies.get(request)
        if parts is None:
            expiry = asyncio.get_running_loop().call_later(self.keep_s, self._expire, request)
            parts = self._bodies[request] = _Parts(expiry)
        if offset in parts.by_offset:
            return
        parts.by_offset[offset] = msg.data
        parts.size += len(msg.data)
        self.held += len(msg.data)
        parts.arrived.set()

    def _expire(self, request: str) -> None:
        parts = self._pop(request)
        if parts is not None:
            self.dropped += len(parts.by_offset)

    def _pop(self, request: str) -> _Parts | None:
        parts = self._bodies.pop(request, None)
        if parts is not None:
            parts.expiry.cancel()
            self.held -= parts.size
        return parts

    async def take(self, request: str, size: int) -> tuple[dict[int, bytes], list[tuple[int, int]]]:
        """The parts of `request`'s body that are here (by offset) and the ranges still missing.

        When some parts are here but not all, the rest is given `REST_WAIT_S` to arrive: they were
        sent one after another, just before the item."""
        parts = self._bodies.get(request)
        if parts is not None and parts.size < size:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + REST_WAIT_S
            while parts.size < size and (left := deadline - loop.time()) > 0:
                parts.arrived.clear()
                try:
                    await asyncio.wait_for(parts.arrived.wait(), left)
                except TimeoutError:
                    break
        parts = self._pop(request)
        self._taken[request] = None
        if len(self._taken) > TAKEN_KEPT:
            del self._taken[next(iter(self._taken))]
        have = parts.by_offset if parts is not None else {}
        missing: list[tuple[int, int]] = []
        at = 0
        for offset in sorted(have):
            if offset < at or offset + len(have[offset]) > size:
                # Overlapping or past the end: not parts of this body as the item states it.
                self.dropped += len(have)
                return {}, [(0, size)]
            if offset > at:
                missing.append((at, offset))
            at = offset + len(have[offset])
        if at < size:
            missing.append((at, size))
        return have, missing


async def fetch_body(nc: NATS, item: wire.WorkItem, sent: SentBodies | None = None) -> bytes:
    """The item's `body_size` bytes: the parts sent ahead, and the rest from its edge.

    BodyUnavailable when the edge no longer has what is missing."""
    have, missing = await sent.take(item.id, item.body_size) if sent is not None else ({}, [(0, item.body_size)])
    if missing:
        if sent is not None:
            sent.fetched += 1
        step = wire.body_part_size(nc.max_payload)
        ranges = [(a, min(a + step, end)) for start, end in missing for a in range(start, end, step)]
        got = await asyncio.gather(*(_body_range(nc, item, a, b) for a, b in ranges), return_exceptions=True)
        for (start, _), result in zip(ranges, got, strict=True):
            if isinstance(result, BaseException):
                raise result
            have[start] = result
    elif sent is not None:
        sent.whole += 1
    if len(have) == 1:
        return have[0]
    return b"".join(have[offset] for offset in sorted(have))


async def _body_range(nc: NATS, item: wire.WorkItem, start: int, end: int) -> bytes:
    pieces: list[bytes] = []
    at = start
    while at < end:
        try:
            reply = await nc.request(item.reply_to, wire.encode(wire.BodyPart(item.id, at)), timeout=PART_TIMEOUT_S)
        except (nats.errors.Error, TimeoutError) as exc:
            raise BodyUnavailable(f"the request body could not be fetched from the edge: {type(exc).__name__}") from exc
        data = reply.data
        if not data:
            raise BodyUnavailable("the edge no longer has this request")
        if len(data) > end - at:
            data = data[: end - at]  # the edge's parts are larger than this node's: the next range has the rest
        pieces.append(data)
        at += len(data)
    return pieces[0] if len(pieces) == 1 else b"".join(pieces)
