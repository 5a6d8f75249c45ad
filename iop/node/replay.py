"""What a node keeps of each answer until its edge has it, to send again what NATS lost on the way.

Replies travel as core NATS messages: those inside a server that dies, or published while the
edge's subscription is moving to another server, are gone. The node ran the request once and must
not run it again, so it keeps what the edge may not have yet and publishes it again when the edge
asks (`wire.Resend`). What it keeps per request: `Started`, the chunks the edge's client has not
taken (beyond its last credit: at most the flow-control window) and the `Done` or `Failure`; an
ended request's tail stays `wire.REPLAY_GRACE_S`. Answers are private: nothing here is logged.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from iop import wire

log = logging.getLogger("iop.node")

STORE_BYTES = 64 * 1024 * 1024
"""The most answer bytes a node keeps for all requests together; past it the oldest are forgotten."""
ENTRY_BYTES = 1536
"""What one kept request costs besides its chunks (its entry, Started and end): measured ≈ 1.5 KiB."""
CHUNK_BYTES = 100
"""What one kept chunk costs besides its data (the Struct, the deque slot)."""

Kept = wire.Started | wire.Chunk | wire.Done | wire.Failure


@dataclass(eq=False)
class KeptAnswer:
    """One request's replies that its edge may still be missing."""

    reply_to: str
    started: wire.Started | None = None
    chunks: deque[wire.Chunk] = field(default_factory=deque)
    end: wire.Done | wire.Failure | None = None
    nbytes: int = ENTRY_BYTES
    evicted: bool = False
    """Chunks were dropped before the edge confirmed them (the store was full): a resend cannot help."""


class ReplayStore:
    """Every kept answer by request id, oldest first, bounded in bytes and in time after the end."""

    def __init__(self, max_bytes: int = STORE_BYTES, grace_s: float = wire.REPLAY_GRACE_S) -> None:
        self.max_bytes = max_bytes
        self.grace_s = grace_s
        self.by_id: dict[str, KeptAnswer] = {}
        self._ended: OrderedDict[str, float] = OrderedDict()
        """Ended requests (id → monotonic end time) in the order they ended: expiry takes the oldest."""
        self.nbytes = 0
        self.evicted = 0
        """Requests forgotten before their grace ended because the store was full."""
        self.resends = 0
        """Resend requests answered (known or not)."""
        self.resent = 0
        """Replies published again."""
        self.received_count = 0
        """Ended answers forgotten because their edge said it had them whole (`wire.Received`)."""

    def keep(self, reply_to: str, message: Kept | wire.Replies) -> None:
        """Remember a reply as it leaves the node (`RunningRequests.publish`)."""
        if isinstance(message, wire.Replies):
            for item in message.items:
                self.keep(reply_to, item)
            return
        kept = self.by_id.get(message.id)
        if kept is None:
            kept = self.by_id[message.id] = KeptAnswer(reply_to)
            self.nbytes += kept.nbytes
        if isinstance(message, wire.Chunk):
            if kept.evicted:
                return
            kept.chunks.append(message)
            kept.nbytes += CHUNK_BYTES + len(message.data)
            self.nbytes += CHUNK_BYTES + len(message.data)
        elif isinstance(message, wire.Started):
            kept.started = message
        elif kept.end is None:
            kept.end = message
            self._ended[message.id] = time.monotonic()
        self.expire()
        if self.nbytes > self.max_bytes:
            self._evict()

    def confirm(self, rid: str, chunks: int) -> None:
        """The edge's client has taken `chunks` chunks (a Credit): those need never be sent again."""
        kept = self.by_id.get(rid)
        if kept is None:
            return
        while kept.chunks and kept.chunks[0].seq < chunks:
            size = CHUNK_BYTES + len(kept.chunks.popleft().data)
            kept.nbytes -= size
            self.nbytes -= size

    def received(self, ids: list[str]) -> None:
        """The edge has these answers whole (`wire.Received`): nothing of them is sent again."""
        for rid in ids:
            kept = self.by_id.get(rid)
            if kept is not None and kept.end is not None:  # an edge cannot have a running one whole
                self.received_count += 1
                self._drop(rid)

    def knows(self, rid: str) -> bool:
        return rid in self.by_id

    def replies(self, ask: wire.Resend) -> tuple[str, list[Kept]] | None:
        """What to publish again for `ask`, and where; None when it cannot be given in full."""
        self.expire()
        kept = self.by_id.get(ask.id)
        if kept is None or kept.evicted:
            return None
        if kept.chunks and kept.chunks[0].seq > ask.from_seq:
            # Confirmed by a credit, so the edge has them: it asks from before its own client's
            # progress only if it lost its own state. Either way not something kept here.
            return None
        out: list[Kept] = []
        if ask.started and kept.started is not None:
            out.append(kept.started)
        out += [c for c in kept.chunks if c.seq >= ask.from_seq]
        if kept.end is not None:
            out.append(kept.end)
        return kept.reply_to, out

    def expire(self) -> None:
        """Forget ended requests whose grace has passed."""
        limit = time.monotonic() - self.grace_s
        while self._ended and next(iter(self._ended.values())) <= limit:
            rid, _ = self._ended.popitem(last=False)
            self._drop(rid)

    def _drop(self, rid: str) -> None:
        self._ended.pop(rid, None)
        kept = self.by_id.pop(rid, None)
        if kept is not None:
            self.nbytes -= kept.nbytes

    def _evict(self) -> None:
        # Ended answers first (their edge most likely has them), oldest first; then running ones.
        while self._ended and self.nbytes > self.max_bytes:
            rid, _ = self._ended.popitem(last=False)
            if rid in self.by_id:
                self.evicted += 1
                self._drop(rid)
        for kept in self.by_id.values():
            if self.nbytes <= self.max_bytes:
                break
            if kept.evicted or not kept.chunks:
                continue
            # Still running: its entry stays, marked, so a resend says it cannot help (the edge
            # then fails the request) instead of sending an answer with a hole in it.
            self.evicted += 1
            kept.evicted = True
            size = sum(CHUNK_BYTES + len(c.data) for c in kept.chunks)
            kept.chunks.clear()
            kept.nbytes -= size
            self.nbytes -= size


async def resend(nc: NATS, store: ReplayStore, ask: wire.Resend) -> wire.Resent:
    """Publish the kept replies `ask` names again, on the request's reply subject."""
    store.resends += 1
    found = store.replies(ask)
    if found is None:
        return wire.Resent(known=False)
    reply_to, messages = found
    # Each as its own message: a replay is rare, and the edge takes them in any order.
    for message in messages:
        await nc.publish(reply_to, wire.encode(message))
    store.resent += len(messages)
    return wire.Resent(known=True, sent=len(messages))


async def serve_resend(nc: NATS, store: ReplayStore, msg: Msg) -> None:
    """Answer an edge's `Resend` (a core request on `wire.resend_subject`)."""
    try:
        ask = wire.decode_resend(msg.data)
    except msgspec.DecodeError:
        log.warning("undecodable resend request dropped")
        return
    answer = await resend(nc, store, ask)
    if msg.reply:
        await nc.publish(msg.reply, wire.encode(answer))
