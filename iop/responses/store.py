"""The response store: stored responses and their items in the JetStream KV bucket iop_responses.

Every key starts with the owner's id (a digest of the client key, never the key itself), so one
client's lookup can only ever reach its own keys: another key's response is simply not there (404).
Keys: `r.<owner>.<response id>` (the response object, this turn's input items, the previous
response's id), `i.<owner>.<item id>` (one item, for `item_reference`) and `e.<owner>.<response
id>` (a background response's events as they were streamed, iop/responses/live.py), and while a
background response runs `w.<owner>.<id>` and `l.<owner>.<id>` (its work and its lease,
iop/responses/takeover.py). A value larger than one
NATS message is kept in parts (`<key>.1`, `<key>.2`, …) written before the key that names them.
The bucket's age and byte limits bound it; NATS drops the oldest first. Records this edge wrote or
read are also kept in memory (iop/responses/cache.py) while the store still holds them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import logging
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any, ParamSpec, TypeVar

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js import api as js_api
from nats.js.errors import KeyNotFoundError, NotFoundError

from iop import edgeconf
from iop.errors import BusError, Unavailable
from iop.nats import bulk, connection, streams
from iop.nats.acked import AckedPublishes
from iop.responses import records
from iop.responses.cache import Entry, Freshness, TurnCache, gone_subject
from iop.responses.direct import TIMEOUT_S, DirectGets, Got
from iop.responses.keys import bucket_keys
from iop.responses.records import Stored, StoredItems, Written, items_of, stored_items

log = logging.getLogger("iop.responses")

BUCKET = "iop_responses"
_ID = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
"""The ids the store can hold: one KV key token (no `.`, `*`, `>`); any other id is simply unknown."""
ANONYMOUS = "anonymous"
"""The owner of every response on an edge without client keys: anyone who can call it."""
_HEADROOM = 4096  # a KV put's headers and subject ride in the same message
_BATCH = 512
"""Keys one direct get may name (the server answers more than 1,024 with 413)."""
_CHANGING = frozenset({"queued", "in_progress"})
"""Statuses of a record that is still to be written again (a background response): never cached."""


def owner_of(secret: bytes | None) -> str:
    """The stable id of a client key that stored responses are filed under (never the key itself)."""
    if secret is None:
        return ANONYMOUS
    return hashlib.sha256(b"iop.responses.owner\0" + secret).hexdigest()[:32]


def valid_id(value: object) -> bool:
    return isinstance(value, str) and _ID.match(value) is not None


_encode = msgspec.json.Encoder().encode
P = ParamSpec("P")
R = TypeVar("R")


def _reachable(method: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
    """NATS unreachable (or the bucket gone) is 503 to the client, never a traceback."""

    @functools.wraps(method)
    async def guarded(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return await method(*args, **kwargs)
        except (nats.errors.Error, TimeoutError, OSError) as exc:
            raise Unavailable(
                f"the response store cannot be reached now ({type(exc).__name__}); try again",
                code="response_store_unavailable",
            ) from exc

    return guarded


_stored = msgspec.json.Decoder(Stored).decode
_item = msgspec.json.Decoder(dict[str, Any]).decode


class ResponseStore:
    """Reads and writes stored responses; every call names the owner it acts for."""

    def __init__(
        self,
        kv: Any,
        max_value: int,
        nc: NATS | None = None,
        fresh: Freshness | None = None,
        acked: AckedPublishes | None = None,
    ) -> None:
        self.kv = kv
        self.acked = acked
        """Writes through the store's own ack inbox (iop/nats/acked.py); None: nats-py's `kv.put`."""
        self.max_value = max(1024, max_value - _HEADROOM)
        self._nc = nc
        self.fresh = fresh
        """The records kept in memory and when they may be served (None: every read goes to NATS)."""
        self._direct = DirectGets(nc, BUCKET) if nc is not None else None

    @property
    def nc(self) -> NATS:
        """The connection the store's edge shares (background responses followed live, iop/responses/live.py)."""
        assert self._nc is not None, "a store opened without its connection"
        return self._nc

    @classmethod
    async def open(cls, nc: NATS, settings: edgeconf.ResponsesSettings, replicas: int | None = None) -> ResponseStore:
        """The store, its bucket created (or brought to `settings`' limits) with the deployment's replicas."""
        js = nc.jetstream()
        cfg = js_api.KeyValueConfig(
            bucket=BUCKET, history=1, ttl=settings.max_age, max_bytes=settings.max_bytes, direct=True
        )
        kv = await streams.ensure_bucket(js, cfg, replicas=replicas, sized_by="edge.responses.max_bytes")
        info = await js.stream_info(f"KV_{BUCKET}")
        old = js_api.DiscardPolicy.OLD
        if (info.config.max_age, info.config.max_bytes, info.config.discard) != (
            settings.max_age,
            settings.max_bytes,
            old,
        ):
            # Several edges share the bucket; each brings it to its own limits at start (as the ledger).
            # A full bucket drops its oldest turns: nats-py makes a KV bucket refuse every write instead.
            new = dataclasses.replace(info.config, max_age=settings.max_age, max_bytes=settings.max_bytes, discard=old)
            try:
                await js.update_stream(new)
            except nats.js.errors.APIError as exc:
                n, sized_by = info.config.num_replicas or 1, "edge.responses.max_bytes"
                problem = streams.stream_problem(f"KV bucket {BUCKET}", settings.max_bytes, n, exc, sized_by)
                raise BusError(problem) from exc
        fresh = None
        # In a NATS cluster a deletion's announcement crosses a route, unordered against the round
        # trip a hit makes to this edge's server: the cache could answer for a deleted turn.
        clustered = info.cluster is not None and info.cluster.name is not None
        if settings.cache_mb > 0 and clustered:
            log.info("stored turns are not cached: NATS is a cluster (edge.responses.cache_mb applies to one server)")
        elif settings.cache_mb > 0:
            fresh = Freshness(nc, TurnCache(settings.cache_mb << 20, settings.max_age), f"KV_{BUCKET}")
            await fresh.start()
        acked = AckedPublishes(nc)
        await acked.start()
        return cls(kv, nc.max_payload, nc, fresh, acked)

    async def response(self, owner: str, response_id: str, since: float | None = None) -> Stored | None:
        return (await self.responses(owner, [response_id], since))[0]

    @_reachable
    async def responses(self, owner: str, response_ids: list[str], since: float | None = None) -> list[Stored | None]:
        """Several stored responses (a conversation's earlier turns) in one request to NATS per 512.

        None for each one that is not there: never kept, deleted, aged out, or another owner's.
        Those in this edge's cache come from memory once it is known fresh for a lookup that began
        at `since` (monotonic; default now): lookups of one request share that check.
        """
        return await self._records(owner, response_ids, since, False)

    @_reachable
    async def items(self, owner: str, response_ids: list[str], since: float | None = None) -> list[StoredItems | None]:
        """`responses()` as a conversation reads them: their items as JSON, not decoded (iop/responses/records.py)."""
        return await self._records(owner, response_ids, since, True)

    async def _records(self, owner: str, response_ids: list[str], since: float | None, as_items: bool) -> list[Any]:
        keys = [f"r.{owner}.{i}" if valid_id(i) else "" for i in response_ids]
        out: list[Any] = [None] * len(keys)
        fresh = self.fresh
        pairs = list(zip(keys, response_ids, strict=True))
        cached = fresh is not None and any(k and fresh.cache.entry(owner, i) is not None for k, i in pairs)
        if fresh is not None and cached and await fresh.check(time.monotonic() if since is None else since):
            entries = [fresh.cache.entry(owner, i) if k else None for k, i in pairs]
            out = [(items_of(e) if as_items else e.record()) if e is not None else None for e in entries]
        missing = [k for k, o in zip(keys, out, strict=True) if k and o is None]
        if not missing:
            return out
        ticket = fresh.ticket() if fresh is not None else None
        found = await self._get_many(missing)
        for n, (k, i) in enumerate(zip(keys, response_ids, strict=True)):
            got = found.get(k) if out[n] is None and k else None
            if got is None:
                continue
            got_items = stored_items(got[0]) if as_items else None
            stored = None if got_items is not None else _stored(got[0])
            out[n] = got_items if got_items is not None else stored
            state = got_items if got_items is not None else stored
            if fresh is not None and ticket is not None and got[1] >= 0 and _cacheable(state):
                if stored is not None:
                    entry = Entry(stored, len(got[0]), got[2], got[1])
                else:  # read as items: the record stays its JSON until another read decodes it
                    entry = Entry(got[0], len(got[0]), got[2], got[1], _stored, got_items)
                fresh.put(owner, i, entry, ticket)
        return out

    @_reachable
    async def item(self, owner: str, item_id: str) -> dict[str, Any] | None:
        raw = await self._get(f"i.{owner}.{item_id}") if valid_id(item_id) else None
        return _item(raw) if raw is not None else None

    @_reachable
    async def keep(
        self,
        owner: str,
        stored: Stored,
        items: list[dict[str, Any]],
        encoded_input: bytes | list[msgspec.Raw] | None = None,
        encoded_items: list[tuple[str, bytes]] | None = None,
        ahead: Ahead | None = None,
    ) -> bool:
        """Keep `stored` and index `items` (the new ones it holds) by id; False when its id cannot be kept.
        `encoded_input`: `stored.input` as JSON already, or each item's JSON (written as it is);
        `encoded_items`: more items to index, by id, as JSON already (before `items`: an id in both
        is `items`'); `ahead`: its input, written already under this id (`write_ahead`)."""
        response_id = stored.response.get("id")
        if not isinstance(response_id, str) or not valid_id(response_id):
            return False
        index = dict(encoded_items or ())
        index.update((item["id"], _encode(item)) for item in items if valid_id(item.get("id")))
        key = f"r.{owner}.{response_id}"
        if ahead is not None and ahead.key != key:
            ahead = None  # written under another id: this record is written whole, its own parts
        data: bytes | tuple[Any, ...]
        if ahead is not None:
            written = records.rest(stored)  # after the parts written ahead
            data, size, since = (*ahead.pieces, written), ahead.size + len(written), ahead.stamp
        else:
            if encoded_input is None:
                written = _encode(stored)
            else:
                raw = msgspec.Raw(encoded_input) if isinstance(encoded_input, bytes) else encoded_input
                written = _encode(Written(stored.response, raw, stored.previous, stored.chain, stored.size))
            data, size, since = written, len(written), None
        fresh = self.fresh
        ticket, stamp = (fresh.ticket() if fresh is not None else None), time.time()
        digests = {i: hash(value) for i, value in index.items()} if fresh is not None else {}
        # An item the client sent again, as this edge wrote it and still in the store, is not
        # written again: a client resending its whole history would rewrite every item each turn.
        known = [i for i in index if fresh is not None and fresh.cache.indexed_still(owner, i, digests[i], stamp)]
        skipped = set(known)
        writes = [i for i in index if i not in skipped]
        began = time.monotonic()
        # The response and its items at once: one round trip to the bucket before the answer goes
        # out, not two. A client learns the ids from that answer, sent once every write is acked.
        seq, *done = await self._put_all([(key, written), *((f"i.{owner}.{i}", index[i]) for i in writes)], ahead)
        seqs = dict(zip(writes, done, strict=True))
        if fresh is not None and known:
            # Still there once every deletion announced before this turn was heard (a deletion
            # takes its owner's remembered items with it) and the bucket's first sequence read.
            # The record's ack is that round trip (`Freshness.passed`), unless only a check can tell.
            ok = fresh.passed(began)
            if ok is None:
                ok = await fresh.check(began)
            again = [i for i in known if not (ok and fresh.cache.indexed_still(owner, i, digests[i], stamp))]
            if again:
                more = await self._put_all([(f"i.{owner}.{i}", index[i]) for i in again])
                seqs.update(zip(again, more, strict=True))
        if fresh is not None and ticket is not None:
            for i, at in seqs.items():
                fresh.note_indexed(owner, i, digests[i], at, stamp, ticket)
        if fresh is not None and ticket is not None and _cacheable(stored):
            # A copy of its own, as a read would give: the caller's objects go on to the client.
            # Decoded when it is first read here, if ever (a client resending its whole input never).
            fresh.put(owner, response_id, Entry(data, size, stamp if since is None else since, seq, _stored), ticket)
        return True

    @_reachable
    async def write_ahead(self, owner: str, response_id: str, pieces: list[Any]) -> Ahead:
        """A record's first bytes (`records.ahead`: its input) written before its answer exists, as
        its first parts: `keep` writes the rest and then its head, which makes it readable. Their
        join lives while they are written; the pieces stay (the cache's copy, joined if read)."""
        key, stamp, data = f"r.{owner}.{response_id}", time.time(), b"".join(pieces)
        seqs = await self._parts(key, memoryview(data), 1)
        return Ahead(key, tuple(pieces), len(data), len(seqs), min(seqs), stamp)

    async def forget_ahead(self, ahead: Ahead) -> None:
        """Parts written ahead for an answer that was never kept (it failed, its client left)."""
        await self._purge_parts(ahead.key, ahead.parts)

    @_reachable
    async def keep_events(self, owner: str, response_id: str, events: bytes) -> None:
        """The recorded events of a background response (kept before its answer)."""
        if valid_id(response_id):
            await self._put(f"e.{owner}.{response_id}", events)

    @_reachable
    async def events(self, owner: str, response_id: str) -> bytes | None:
        return await self._get(f"e.{owner}.{response_id}") if valid_id(response_id) else None

    @_reachable
    async def keep_work(self, owner: str, response_id: str, work: bytes) -> None:
        """What another edge needs to run a background response again (iop/responses/takeover.py)."""
        await self._put(f"w.{owner}.{response_id}", work)

    @_reachable
    async def work(self, owner: str, response_id: str) -> bytes | None:
        return await self._get(f"w.{owner}.{response_id}") if valid_id(response_id) else None

    @_reachable
    async def forget_work(self, owner: str, response_id: str) -> None:
        await self._delete(f"w.{owner}.{response_id}")

    @_reachable
    async def delete(self, owner: str, response_id: str) -> bool:
        """Remove a stored response and its items; False when `owner` has none of that id."""
        stored = await self.response(owner, response_id)
        if stored is None:
            return False
        if self.fresh is not None:
            self.fresh.cache.forget(owner, response_id)
        ids = [i.get("id") for i in (*stored.input, *stored.response.get("output", []))]
        await asyncio.gather(*(self._delete(f"i.{owner}.{i}") for i in ids if valid_id(i)))
        await self._delete(f"e.{owner}.{response_id}")
        await self._delete(f"r.{owner}.{response_id}")
        if self.fresh is not None:
            self.fresh.cache.forget(owner, response_id)  # a read of this edge that raced the deletion
        if self._nc is not None:
            # Every edge forgets it before this one answers: the server has the announcement.
            await self._nc.publish(gone_subject(owner, response_id), b"")
            await connection.flush(self._nc)
        return True

    @_reachable
    async def owners_of(self, response_id: str) -> list[str]:
        """Who holds a response of this id (for an administrator: ids are unique, so at most one)."""
        if not valid_id(response_id):
            return []
        keys, _ = await bucket_keys(self.nc, BUCKET, f"r.*.{response_id}", 16, TIMEOUT_S)
        return [key.split(".")[1] for key in keys]

    @_reachable
    async def listing(self, limit: int, owner: str | None = None) -> tuple[list[tuple[str, str]], bool]:
        """Up to `limit` (owner, response id) pairs, oldest first, and whether there are more (for an administrator)."""
        if owner is not None and not valid_id(owner):
            return [], False
        keys, more = await bucket_keys(self.nc, BUCKET, f"r.{owner or '*'}.*", limit, TIMEOUT_S)
        found = []
        for key in keys:
            _, who, response_id = key.split(".")
            found.append((who, response_id))
        return found, more

    async def _get(self, key: str) -> bytes | None:
        try:
            entry = await self.kv.get(key)
        except (KeyNotFoundError, NotFoundError):
            return None
        value: bytes = entry.value or b""
        if value[:1] == b"=":
            return value[1:]
        if value[:1] != b"#":
            return None
        parts = int(value[1:])
        try:
            chunks = await asyncio.gather(*(self.kv.get(f"{key}.{n}") for n in range(1, parts + 1)))
        except (KeyNotFoundError, NotFoundError):
            return None  # a part aged out (or was dropped for bytes) before its head: the whole is gone
        return b"".join(c.value or b"" for c in chunks)

    async def _get_many(self, keys: list[str]) -> dict[str, Got]:
        """The values of those of `keys` that are there, as `_get` reads each one (its parts joined)."""
        heads: dict[str, Got] = {}
        for n in range(0, len(keys), _BATCH):
            got = await self._last(keys[n : n + _BATCH])
            if got is None:  # a server (or bucket) without batched direct gets: one request a key
                values = await asyncio.gather(*(self._get(k) for k in keys))
                return {k: (v, -1, 0.0) for k, v in zip(keys, values, strict=True) if v is not None}
            heads.update(got)
        found = {k: (v[1:], seq, at) for k, (v, seq, at) in heads.items() if v[:1] == b"="}
        split = {k: int(v[1:]) for k, (v, _, _) in heads.items() if v[:1] == b"#"}
        if split:
            names = [f"{k}.{n}" for k, parts in split.items() for n in range(1, parts + 1)]
            batches = await asyncio.gather(
                *(self._get_many_raw(names[n : n + _BATCH]) for n in range(0, len(names), _BATCH))
            )
            chunks = {k: v for batch in batches for k, v in batch.items()}
            for k, parts in split.items():
                pieces = [chunks.get(f"{k}.{n}") for n in range(1, parts + 1)]
                whole = [p for p in pieces if p is not None]
                if len(whole) == parts:  # else a part aged out before its head: all gone
                    _, seq, at = heads[k]
                    seq = -1 if seq < 0 or any(p[1] < 0 for p in whole) else min(seq, *(p[1] for p in whole))
                    found[k] = (b"".join(p[0] for p in whole), seq, min(at, *(p[2] for p in whole)))
        return found

    async def _get_many_raw(self, keys: list[str]) -> dict[str, Got]:
        got = await self._last(keys)
        if got is None:
            values = await asyncio.gather(*(self._raw(k) for k in keys))
            return {k: (v, -1, 0.0) for k, v in zip(keys, values, strict=True) if v is not None}
        return got

    async def _raw(self, key: str) -> bytes | None:
        try:
            return (await self.kv.get(key)).value or b""
        except (KeyNotFoundError, NotFoundError):
            return None

    async def _last(self, keys: list[str]) -> dict[str, Got] | None:
        return await self._direct.last_of(keys) if self._direct is not None else None

    async def _put(self, key: str, data: bytes, ahead: Ahead | None = None) -> int:
        """Write `key` (in parts when it is large, after those written `ahead`); the stream sequence
        of its first message."""
        if ahead is None and len(data) < self.max_value:
            return await self._put_one(key, [b"=", data])
        first = ahead.parts + 1 if ahead is not None else 1
        seqs = await self._parts(key, memoryview(data), first)  # views of `data`, never copies
        await self._put_one(key, [b"#%d" % (first - 1 + len(seqs))])
        return min(seqs) if ahead is None else min(ahead.seq, *seqs)

    async def _put_all(self, writes: list[tuple[str, bytes]], ahead: Ahead | None = None) -> list[int]:
        """Every (key, data) of `writes` at once, the first after its parts written `ahead`: their
        sequences (`_put`'s), in order. Small values without parts go out in one coroutine."""
        if self.acked is not None and ahead is None and all(len(data) < self.max_value for _, data in writes):
            return await self.acked.publish_many([(f"$KV.{BUCKET}.{key}", [b"=", data]) for key, data in writes])
        (key, data), *rest = writes
        return await asyncio.gather(self._put(key, data, ahead), *(self._put(k, d) for k, d in rest))

    def _parts(self, key: str, view: memoryview, first: int) -> Awaitable[list[int]]:
        step = self.max_value
        chunks = [view[i : i + step] for i in range(0, len(view), step)]
        return asyncio.gather(*(self._put_one(f"{key}.{n}", [c]) for n, c in enumerate(chunks, first)))

    async def _put_one(self, key: str, pieces: list[bulk.Buffer]) -> int:
        if self.acked is None:
            return int(await self.kv.put(key, b"".join(pieces)))
        return await self.acked.publish(f"$KV.{BUCKET}.{key}", pieces)

    async def _delete(self, key: str) -> None:
        try:
            entry = await self.kv.get(key)
        except (KeyNotFoundError, NotFoundError):
            return
        value: bytes = entry.value or b""
        if value[:1] == b"#":
            await self._purge_parts(key, int(value[1:]))
        await self.kv.purge(key)

    async def _purge_parts(self, key: str, parts: int) -> None:
        """The parts `key.1` .. `key.<parts>` of a record, gone from the bucket."""
        await asyncio.gather(*(self.kv.purge(f"{key}.{n}") for n in range(1, parts + 1)))


@dataclasses.dataclass(frozen=True, slots=True)
class Ahead:
    """A record's first parts, written before its answer (`ResponseStore.write_ahead`)."""

    key: str
    pieces: tuple[Any, ...]
    """Its bytes, as `records.ahead` gave them."""
    size: int
    parts: int
    seq: int
    """The stream sequence of its first message."""
    stamp: float
    """When it was written (Unix time)."""


def _cacheable(state: Any) -> bool:
    """A record no edge writes again (a background response may still be cancelled or taken over):
    `state` the record (`Stored`), or its response's state as its items were read."""
    if isinstance(state, Stored):
        status, background = state.response.get("status"), state.response.get("background")
    else:
        status, background = state.status, state.background
    return not background and not (isinstance(status, str) and status in _CHANGING)
