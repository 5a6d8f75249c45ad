"""The response store: stored responses and their items in the JetStream KV bucket iop_responses.

Every key starts with the owner's id (a digest of the client key, never the key itself), so one
client's lookup can only ever reach its own keys: another key's response is simply not there (404).
Keys: `r.<owner>.<response id>` (the response object, this turn's input items, the previous
response's id), `i.<owner>.<item id>` (one item, for `item_reference`) and `e.<owner>.<response
id>` (a background response's events as they were streamed, iop/responses/live.py), and while a
background response runs `w.<owner>.<id>` and `l.<owner>.<id>` (its work and its lease,
iop/responses/takeover.py). A value larger than one
NATS message is kept in parts (`<key>.1`, `<key>.2`, …) written before the key that names them.
The bucket's age and byte limits bound it; NATS drops the oldest first.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import logging
import re
from collections.abc import Awaitable, Callable
from typing import Any, ParamSpec, TypeVar

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js import api as js_api
from nats.js.errors import KeyNotFoundError, NotFoundError

from iop import config
from iop.errors import BusError, Unavailable
from iop.nats import streams

log = logging.getLogger("iop.responses")

BUCKET = "iop_responses"
_ID = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
"""The ids the store can hold: one KV key token (no `.`, `*`, `>`); any other id is simply unknown."""
ANONYMOUS = "anonymous"
"""The owner of every response on an edge without client keys: anyone who can call it."""
_HEADROOM = 4096  # a KV put's headers and subject ride in the same message


def owner_of(secret: bytes | None) -> str:
    """The stable id of a client key that stored responses are filed under (never the key itself)."""
    if secret is None:
        return ANONYMOUS
    return hashlib.sha256(b"iop.responses.owner\0" + secret).hexdigest()[:32]


def valid_id(value: object) -> bool:
    return isinstance(value, str) and _ID.match(value) is not None


class Stored(msgspec.Struct):
    """One stored response."""

    response: dict[str, Any]
    """The response object as the client got it (output included)."""
    input: list[dict[str, Any]]
    """This turn's input items (references resolved, each with an id); earlier turns are in `previous`."""
    previous: str | None = None
    chain: list[str] = msgspec.field(default_factory=list)
    """Every earlier response of the conversation, oldest first (`previous` last): read all at once."""
    size: int = 0
    """Bytes of the conversation's items up to and including this response (encoded JSON): a next turn
    that would pass the limit is refused without reading the chain (0: a record from before it was kept)."""


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

    def __init__(self, kv: Any, max_value: int, nc: NATS | None = None) -> None:
        self.kv = kv
        self.max_value = max(1024, max_value - _HEADROOM)
        self._nc = nc

    @property
    def nc(self) -> NATS:
        """The connection the store's edge shares (background responses followed live, iop/responses/live.py)."""
        assert self._nc is not None, "a store opened without its connection"
        return self._nc

    @classmethod
    async def open(cls, nc: NATS, settings: config.ResponsesSettings, replicas: int | None = None) -> ResponseStore:
        """The store, its bucket created (or brought to `settings`' limits) with the deployment's replicas."""
        js = nc.jetstream()
        cfg = js_api.KeyValueConfig(
            bucket=BUCKET, history=1, ttl=settings.max_age, max_bytes=settings.max_bytes, direct=True
        )
        kv = await streams.ensure_bucket(js, cfg, replicas=replicas, sized_by="edge.responses.max_bytes")
        info = await js.stream_info(f"KV_{BUCKET}")
        if info.config.max_age != settings.max_age or info.config.max_bytes != settings.max_bytes:
            # Several edges share the bucket; each brings it to its own limits at start (as the ledger).
            new = dataclasses.replace(info.config, max_age=settings.max_age, max_bytes=settings.max_bytes)
            try:
                await js.update_stream(new)
            except nats.js.errors.APIError as exc:
                n, sized_by = info.config.num_replicas or 1, "edge.responses.max_bytes"
                problem = streams.stream_problem(f"KV bucket {BUCKET}", settings.max_bytes, n, exc, sized_by)
                raise BusError(problem) from exc
        return cls(kv, nc.max_payload, nc)

    @_reachable
    async def response(self, owner: str, response_id: str) -> Stored | None:
        raw = await self._get(f"r.{owner}.{response_id}") if valid_id(response_id) else None
        return _stored(raw) if raw is not None else None

    @_reachable
    async def item(self, owner: str, item_id: str) -> dict[str, Any] | None:
        raw = await self._get(f"i.{owner}.{item_id}") if valid_id(item_id) else None
        return _item(raw) if raw is not None else None

    @_reachable
    async def keep(self, owner: str, stored: Stored, items: list[dict[str, Any]]) -> bool:
        """Keep `stored` and index `items` (the new ones it holds) by id; False when its id cannot be kept."""
        response_id = stored.response.get("id")
        if not valid_id(response_id):
            return False
        puts = [self._put(f"i.{owner}.{item['id']}", _encode(item)) for item in items if valid_id(item.get("id"))]
        await asyncio.gather(*puts)
        # The response last: whoever finds it finds its items too.
        await self._put(f"r.{owner}.{response_id}", _encode(stored))
        return True

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
        ids = [i.get("id") for i in (*stored.input, *stored.response.get("output", []))]
        await asyncio.gather(*(self._delete(f"i.{owner}.{i}") for i in ids if valid_id(i)))
        await self._delete(f"e.{owner}.{response_id}")
        await self._delete(f"r.{owner}.{response_id}")
        return True

    @_reachable
    async def owners_of(self, response_id: str) -> list[str]:
        """Who holds a response of this id (for an administrator: ids are unique, so at most one)."""
        if not valid_id(response_id):
            return []
        # A watch filtered on the subject: the server sends only the keys of that id (nats-py's
        # `keys()` would fetch every key of the bucket and filter here).
        watcher = await self.kv.watch(f"r.*.{response_id}", ignore_deletes=True, meta_only=True)
        owners = []
        try:
            async for entry in watcher:
                if entry is None:
                    break
                owners.append(entry.key.split(".")[1])
        finally:
            await watcher.stop()
        return owners

    @_reachable
    async def listing(self, limit: int, owner: str | None = None) -> tuple[list[tuple[str, str]], bool]:
        """Up to `limit` (owner, response id) pairs, oldest first, and whether there are more (for an administrator)."""
        if owner is not None and not valid_id(owner):
            return [], False
        watcher = await self.kv.watch(f"r.{owner or '*'}.*", ignore_deletes=True, meta_only=True)
        found: list[tuple[str, str]] = []
        more = False
        try:
            async for entry in watcher:
                if entry is None:
                    break
                if len(found) == limit:
                    more = True
                    break
                _, who, response_id = entry.key.split(".")
                found.append((who, response_id))
        finally:
            await watcher.stop()
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

    async def _put(self, key: str, data: bytes) -> None:
        if len(data) < self.max_value:
            await self.kv.put(key, b"=" + data)
            return
        chunks = [data[i : i + self.max_value] for i in range(0, len(data), self.max_value)]
        await asyncio.gather(*(self.kv.put(f"{key}.{n}", c) for n, c in enumerate(chunks, 1)))
        await self.kv.put(key, b"#%d" % len(chunks))

    async def _delete(self, key: str) -> None:
        try:
            entry = await self.kv.get(key)
        except (KeyNotFoundError, NotFoundError):
            return
        value: bytes = entry.value or b""
        if value[:1] == b"#":
            await asyncio.gather(*(self.kv.purge(f"{key}.{n}") for n in range(1, int(value[1:]) + 1)))
        await self.kv.purge(key)
