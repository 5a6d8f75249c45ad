"""Stored turns this edge wrote or read, kept in memory, so a conversation it serves expands without NATS.

Keyed by (owner, response id): an owner's lookup reaches only its own entries, as in the store.
An entry is the decoded record exactly as a read returns it, with the stream sequence and time of
its oldest message. It is served only while the store still holds it:

- a DELETE on any edge: the deleting edge forgets it before it answers and announces it on
  `iop.responses.gone.<owner>.<id>` (edges only: a node may neither publish nor hear it); each edge
  forgets what it hears;
- age: an entry older than the bucket's `max_age` is gone, by this edge's clock;
- bytes: NATS drops the oldest messages first, so an entry whose sequence is below the bucket's
  first one is gone (the first sequence is read at most a second before a hit);
- a lost connection: deletions may have been missed meanwhile, so a reconnect empties the cache.

A hit therefore costs one round trip to NATS (a ping, or the bucket's state once a second): every
announcement published before the request arrived is heard first. Requests that arrive while
one round trip is on its way share the next. Records that may still change (a background response,
one queued or in progress) are not kept. The bound (`edge.responses.cache_mb`) counts the
records' JSON bytes, least recently used out first.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from iop.lru import Lru
from iop.nats import connection

log = logging.getLogger("iop.responses")

GONE_ROOT = "iop.responses.gone"
"""`<root>.<owner>.<response id>`: a stored response deleted (published by an edge after the deletion)."""
_INFO_EVERY_S = 1.0
"""How old the bucket's first sequence and age limit may be at a hit."""
_REMEMBERED = 4096
"""Deletions remembered for reads in flight (an older read is not kept: it may have raced one)."""
_TIMEOUT_S = 5.0
INDEXED_PER_MIB = 512
"""Item index entries an edge remembers writing per MiB of `cache_mb` (about 400 bytes each:
32,768 in 12.5 MiB beside the default 64 MiB of turns), least recently used out first."""


def gone_subject(owner: str, response_id: str) -> str:
    return f"{GONE_ROOT}.{owner}.{response_id}"


def key(owner: str, some_id: str) -> str:
    """An owner's response or item id as one string (a tuple would be tracked: iop/lru.py).
    Owners hold no `.` (`store.owner_of`), so the owner is what comes before the first."""
    return f"{owner}.{some_id}"


class _State(msgspec.Struct):
    first_seq: int = 0


class _Config(msgspec.Struct):
    max_age: int = 0
    """Nanoseconds (0: no limit)."""


class _Info(msgspec.Struct):
    state: _State
    config: _Config
    """Both required: an error's answer (no state) is not taken for an empty bucket without limits."""


_info = msgspec.json.Decoder(_Info).decode


class Indexed(msgspec.Struct, gc=False, array_like=True):
    """An item index entry this edge wrote (`TurnCache.indexed`)."""

    digest: int
    """Hash of the item's JSON."""
    seq: int
    """Its stream sequence."""
    stamp: float
    """Unix time of the write."""
    epoch: int
    """`TurnCache.epoch` when the write's ticket was taken."""


class Entry(msgspec.Struct, gc=False):
    """One kept turn. Never tracked by the cyclic collector (it refers to no object that refers
    back to it): a cache of many small turns is otherwise tens of thousands of objects that every
    full collection walks, 4 ms per 40,000 (a request waiting meanwhile waits for it)."""

    stored: Any
    """The decoded record (`store.Stored`); shared by every reader, who never changes it. Or, with
    `decode`, the record's JSON (or its pieces, `encoded`), decoded at its first read (a turn this edge wrote: most are
    never read here, and its writer's objects go on to the client, so it could not share them)."""
    size: int
    stamp: float
    """Unix time of its oldest message (its parts are written before it)."""
    seq: int
    """Stream sequence of its oldest message."""
    decode: Callable[[bytes], Any] | None = None
    items: Any = None
    """The record as a conversation reads it (iop/responses/records.py: its items as JSON,
    views of the record's bytes), once a conversation read it."""

    def encoded(self) -> bytes:
        """The record's JSON while it is not decoded (`decode` set): its pieces joined at the first
        read (a record written in two, its input ahead of its answer: iop/responses/records.py)."""
        if isinstance(self.stored, tuple):
            self.stored = b"".join(self.stored)
        return self.stored  # type: ignore[no-any-return]

    def record(self) -> Any:
        if self.decode is not None:
            self.stored, self.decode = self.decode(self.encoded()), None
        return self.stored


def _size(entry: Entry) -> int:
    return entry.size


@dataclass(frozen=True, slots=True)
class Ticket:
    """Taken before a read: what it finds is kept only if nothing it read was deleted meanwhile."""

    epoch: int
    reconnects: int


class TurnCache:
    """The entries and their bound; NATS is `Freshness`'s business."""

    def __init__(self, max_bytes: int, max_age_s: float) -> None:
        self.max_bytes = max_bytes
        self.max_age_s = max_age_s
        """The bucket's age limit as last read (0: none)."""
        self.first_seq = 0
        self.entries: Lru[Entry] = Lru(max_bytes, _size)
        """By `key(owner, response id)`; its weight is the entries' bytes."""
        self.epoch = 0
        """Counts forgets and clears: a read's ticket older than one that touched its keys keeps nothing."""
        self._forgotten: OrderedDict[tuple[str, str], int] = OrderedDict()
        self._floor = 0
        """Tickets before this epoch keep nothing (the deletions they raced may no longer be remembered)."""
        self.indexed: Lru[Indexed] = Lru((max_bytes * INDEXED_PER_MIB) >> 20)
        """By `key(owner, item id)`: the item index entries (`i.<owner>.<id>`) this edge wrote, so
        that an item a client sends again, the same, is not written again while the store still
        holds it (`indexed_still`)."""
        self._owner_forgot: OrderedDict[str, int] = OrderedDict()
        """The epoch of each owner's latest forget: a deletion takes that owner's items with it."""

    @property
    def bytes(self) -> int:
        return self.entries.weight

    def get(self, owner: str, response_id: str) -> Any:
        """The record, while it may still be in the store; None otherwise."""
        entry = self.entry(owner, response_id)
        return entry.record() if entry is not None else None

    def entry(self, owner: str, response_id: str) -> Entry | None:
        """The record's entry, while the record may still be in the store; None otherwise."""
        at = key(owner, response_id)
        entry = self.entries.get(at)
        if entry is None:
            return None
        if entry.seq < self.first_seq or (self.max_age_s > 0 and time.time() >= entry.stamp + self.max_age_s):
            self.entries.pop(at)
            return None
        return entry

    def put(self, owner: str, response_id: str, entry: Entry, ticket: Ticket, reconnects: int) -> None:
        if (
            entry.size > self.max_bytes
            or ticket.reconnects != reconnects
            or ticket.epoch < self._floor
            or self._forgotten.get((owner, response_id), -1) >= ticket.epoch
        ):
            return
        self.entries.put(key(owner, response_id), entry)

    def forget(self, owner: str, response_id: str) -> None:
        self.entries.pop(key(owner, response_id))
        self.epoch += 1
        gone = (owner, response_id)
        self._forgotten[gone] = self.epoch
        self._forgotten.move_to_end(gone)
        # A deleted response's items are deleted with it; which ones, an announcement does not say.
        self._owner_forgot[owner] = self.epoch
        self._owner_forgot.move_to_end(owner)
        # What is no longer remembered raises the floor, never lowers it (two memories feed it).
        if len(self._forgotten) > _REMEMBERED:
            self._floor = max(self._floor, self._forgotten.popitem(last=False)[1])
        if len(self._owner_forgot) > _REMEMBERED:
            self._floor = max(self._floor, self._owner_forgot.popitem(last=False)[1])

    def clear(self) -> None:
        self.entries.clear()
        self._forgotten.clear()
        self.indexed.clear()
        self._owner_forgot.clear()
        self.epoch += 1
        self._floor = self.epoch

    def indexed_still(self, owner: str, item_id: str, digest: int, now: float) -> bool:
        """Whether the store still holds the item index entry this edge wrote for `item_id`, the
        same item (`digest`), young enough not to expire before a turn written now: at most half
        the bucket's age limit old. Like a cached record, only once a check found the cache fresh."""
        at = key(owner, item_id)
        got = self.indexed.get(at)
        if got is None:
            return False
        if (
            got.digest != digest
            or got.seq < self.first_seq
            or got.epoch < self._floor
            or self._owner_forgot.get(owner, -1) > got.epoch
            or (self.max_age_s > 0 and now >= got.stamp + self.max_age_s / 2)
        ):
            self.indexed.pop(at)
            return False
        return True

    def note_indexed(
        self, owner: str, item_id: str, digest: int, seq: int, stamp: float, ticket: Ticket, reconnects: int
    ) -> None:
        """This edge wrote the item index entry for `item_id` (taking `ticket` before the write)."""
        if ticket.reconnects != reconnects or ticket.epoch < self._floor or seq < 0:
            return
        if self._owner_forgot.get(owner, -1) > ticket.epoch:
            return  # a deletion of the owner's raced the write: the entry may be gone already
        self.indexed.put(key(owner, item_id), Indexed(digest, seq, stamp, ticket.epoch))

    def ticket(self, reconnects: int) -> Ticket:
        return Ticket(self.epoch, reconnects)


class Freshness:
    """Whether the cache may answer now: the deletions announced so far heard, the connection unbroken."""

    def __init__(self, nc: NATS, cache: TurnCache, stream: str) -> None:
        self.nc = nc
        self.cache = cache
        self._info_subject = f"$JS.API.STREAM.INFO.{stream}"
        self._reconnects = self.reconnects
        self._info_at = -_INFO_EVERY_S
        self._checked_from = -1.0
        """When the last successful check began (monotonic)."""
        self._running: tuple[float, asyncio.Future[bool]] | None = None

    @property
    def reconnects(self) -> int:
        return int(self.nc.stats["reconnects"])

    async def start(self) -> None:
        await self.nc.subscribe(f"{GONE_ROOT}.>", cb=self._heard)

    async def _heard(self, msg: Msg) -> None:
        # No await here: a check's round trip, answered after this announcement, resumes after it.
        parts = msg.subject.split(".")
        if len(parts) == 5:
            self.cache.forget(parts[3], parts[4])

    def ticket(self) -> Ticket:
        return self.cache.ticket(self.reconnects)

    def put(self, owner: str, response_id: str, entry: Entry, ticket: Ticket) -> None:
        self.cache.put(owner, response_id, entry, ticket, self.reconnects)

    def note_indexed(self, owner: str, item_id: str, digest: int, seq: int, stamp: float, ticket: Ticket) -> None:
        self.cache.note_indexed(owner, item_id, digest, seq, stamp, ticket, self.reconnects)

    async def check(self, since: float) -> bool:
        """True when a lookup that began at `since` (monotonic) may be answered from the cache."""
        if not self.nc.is_connected:
            return False
        if self._checked_from >= since and self._reconnects == self.reconnects:
            return True
        running = self._running
        if running is not None and running[0] >= since:
            return await asyncio.shield(running[1])
        began = time.monotonic()
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._running = (began, done)
        ok = False
        try:
            ok = await self._round_trip(began)
        finally:
            done.set_result(ok)
            if self._running is not None and self._running[1] is done:
                self._running = None
        return ok

    def passed(self, began: float) -> bool | None:
        """After an answer on this connection to something sent at `began` (monotonic) or later,
        such as a write's ack: True, as `check(began)` would be; None when only `check` can tell
        (the connection broke meanwhile, or the bucket's first sequence is due to be read again).

        The server sends its answers and the announcements it took before the request down one
        connection in order, and nats-py hands each subscription's messages to its callback in
        that order, each in its own task woken in turn: `_heard` (no await) has run for every
        announcement before the answer's waiter resumes, as for a check's own round trip."""
        if not self.nc.is_connected or self._reconnects != self.reconnects or began - self._info_at >= _INFO_EVERY_S:
            return None
        self._checked_from = max(self._checked_from, began)
        return True

    async def _round_trip(self, began: float) -> bool:
        try:
            if began - self._info_at >= _INFO_EVERY_S:
                reply = await self.nc.request(self._info_subject, b"", timeout=_TIMEOUT_S)
                info = _info(reply.data)
                self.cache.first_seq = max(self.cache.first_seq, info.state.first_seq)
                self.cache.max_age_s = info.config.max_age / 1e9
                self._info_at = began
            else:
                await connection.flush(self.nc)
        except Exception as exc:  # NATS unreachable, or an answer not understood: the store decides
            log.debug("response cache: not checked (%s)", type(exc).__name__)
            return False
        if self._reconnects != self.reconnects:
            # Deletions announced while the connection was down were missed.
            self.cache.clear()
            self._reconnects = self.reconnects
            return False
        self._checked_from = max(self._checked_from, began)
        return True
