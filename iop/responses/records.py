"""A stored response's record: as it is kept (`Stored`, `Written`), and as a conversation reads it
(`StoredItems`: its items as the JSON they were kept as, undecoded).

A turn that continues a chain (`previous_response_id`) sends the model every earlier turn's input
and output items. Decoding each record into objects only to encode them all again cost the edge
the whole conversation's encode on every turn (~1 ms per 800 KB); read this way, a record is
scanned for where its items lie, and the conversation is those bytes joined.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import msgspec

from iop.responses.cache import Entry


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


class Written(msgspec.Struct):
    """A `Stored` as it is written when its input items are encoded already (their size was
    measured on those bytes): the same JSON, without encoding a long input a second time.
    `input`: the items' JSON array, or each item's JSON (encoded as that array)."""

    response: dict[str, Any]
    input: msgspec.Raw | list[msgspec.Raw]
    previous: str | None
    chain: list[str]
    size: int


class Rest(msgspec.Struct):
    """A `Stored` without its input: what follows an input written ahead (`ahead`) in its record."""

    response: dict[str, Any]
    previous: str | None
    chain: list[str]
    size: int


def ahead(items: bytes | list[msgspec.Raw]) -> list[bytes | msgspec.Raw]:
    """A record's first bytes, its input, as they can be written before its answer exists: the
    JSON of a `Stored` with `input` its first member (the rest follows from `rest`). As pieces,
    the items themselves among them (views of the body they came in): joined only to be written."""
    if isinstance(items, bytes):
        return [b'{"input":', items]
    pieces: list[bytes | msgspec.Raw] = [b'{"input":[']
    for item in items:
        pieces += (item, b",")
    pieces[-1] = b"]" if items else pieces[-1] + b"]"
    return pieces


def rest(stored: Stored) -> bytes:
    """What follows `ahead`'s bytes in the record of `stored`, its input left out."""
    return b"," + memoryview(_encode(Rest(stored.response, stored.previous, stored.chain, stored.size)))[1:]


def json_size(items: bytes | list[msgspec.Raw]) -> int:
    """Bytes of `items` as one JSON array: the array itself, or the array its items' JSON makes."""
    if isinstance(items, bytes):
        return len(items)
    return sum(len(i) for i in items) + max(len(items) - 1, 0) + 2


_EMPTY = msgspec.Raw(b"[]")
_COMPACTION = re.compile(rb'"compaction"')
"""In a stored item's JSON only where an item (or a field) says "compaction" as a whole string:
inside a string its quotes would be escaped."""


class _Response(msgspec.Struct):
    output: msgspec.Raw = _EMPTY
    status: Any = None
    background: Any = None


class _Kept(msgspec.Struct):
    """The fields of a stored record (`Stored`) a conversation needs, its items left as they are."""

    response: _Response
    input: msgspec.Raw
    chain: list[str] = msgspec.field(default_factory=list)
    size: int = 0


_kept = msgspec.json.Decoder(_Kept).decode
_encode = msgspec.json.Encoder().encode


@dataclass(slots=True)
class StoredItems:
    """A stored response as a conversation reads it: read once, then shared by every reader."""

    parts: list[memoryview]
    """Its input items, then its output items: each list's JSON without its brackets (empty ones left out)."""
    chain: list[str]
    size: int
    status: Any
    background: Any
    compacted: bool
    """Whether an item may be a compaction item (then the conversation is decoded and opened)."""


def stored_items(data: bytes) -> StoredItems:
    """A record's items from its JSON: views of those bytes, nothing decoded."""
    kept = _kept(data)
    return _items(kept.input, kept.response.output, kept, kept.response.status, kept.response.background)


def of_stored(stored: Any) -> StoredItems:
    """The same from a decoded `Stored` (a record this edge decoded already): its items encoded once."""
    response = stored.response
    output = _encode(response.get("output") or [])
    return _items(_encode(stored.input), output, stored, response.get("status"), response.get("background"))


def _items(input_json: Any, output_json: Any, record: Any, status: Any, background: Any) -> StoredItems:
    parts = [m for m in (_inside(input_json), _inside(output_json)) if m is not None]
    compacted = any(_COMPACTION.search(p) is not None for p in parts)
    return StoredItems(parts, record.chain, record.size, status, background, compacted)


def items_of(entry: Entry) -> StoredItems:
    """A cached record's items: views of its JSON, or encoded from it once it was decoded."""
    if entry.items is None:
        entry.items = stored_items(entry.encoded()) if entry.decode is not None else of_stored(entry.stored)
    return entry.items  # type: ignore[no-any-return]


def joined(parts: list[memoryview]) -> bytes:
    """One JSON array of the items of `parts`."""
    return b"".join((b"[", b",".join(parts), b"]"))


def _inside(raw: Any) -> memoryview | None:
    """A JSON array's items without its brackets; None for an empty array or anything but an array."""
    view = memoryview(raw)
    if len(view) < 2 or view[0] != 0x5B:  # `[`: a Raw is the value's own bytes, no space around it
        return None
    inner = view[1:-1]
    if len(inner) < 64 and not bytes(inner).strip():
        return None
    return inner
