"""State in a Responses request, expanded by the edge before dispatch, and the keeping of its answer.

`previous_response_id` becomes the whole chain's input and output items (the earlier turns'
`instructions` are not carried over, as OpenAI specifies), `item_reference` items become the items
they name. What goes to the node is then a stateless request any upstream serves — chat-only,
Responses-native or a mix — with `store: false`: iop keeps the response, the upstream does not.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn, TypeVar

import msgspec

from iop import edgeconf
from iop.errors import BadRequest, NotFound
from iop.openai import compaction
from iop.openai.passthrough import LEAD
from iop.openai.responses_events import new_id
from iop.responses import records
from iop.responses.caps import ResponseCaps
from iop.responses.records import Stored
from iop.responses.store import Ahead, ResponseStore, valid_id
from iop.responses.takeover import Held, Takeover, new_runner

log = logging.getLogger("iop.responses")
AHEAD_BYTES = 256 * 1024
"""An input to keep at least this large is written while its answer is made (`Responses.dispatched`)."""
_TIMEOUT_S = 5.0
_T = TypeVar("_T")
_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode


class _SentItems(msgspec.Struct):
    input: str | list[msgspec.Raw]


class _ItemId(msgspec.Struct):
    id: Any = None


class _SentIds(msgspec.Struct):
    input: list[_ItemId]


_SPACE = re.compile(rb"[ \t\n\r]*")
_FALSE = msgspec.Raw(b"false")
_top_level = msgspec.json.Decoder(dict[str, msgspec.Raw]).decode
_sent_items = msgspec.json.Decoder(_SentItems).decode
_sent_ids = msgspec.json.Decoder(_SentIds).decode

MAX_CHAIN = 10_000
"""Turns a `previous_response_id` chain may have (ids never repeat; this only bounds a broken store)."""


class PreviousResponseNotFound(BadRequest):
    code = "previous_response_not_found"


def _too_large(size: int, limit: int) -> BadRequest:
    return BadRequest(
        f"the conversation with its earlier turns is {size} bytes, more than the {limit} a request may be "
        "(edge.max_body_mb): compact it or start a new one",
        param="previous_response_id",
        code="conversation_too_large",
    )


@dataclass
class Turn:
    """A request's own state: what `keep` needs once its answer is known."""

    body: dict[str, Any]
    """The request to dispatch: stateless, whole input, `store: false`."""
    items: list[dict[str, Any]]
    """This turn's input items, references resolved."""
    previous: str | None
    store: bool
    """The answer is to be kept (the request asked, and the edge keeps responses)."""
    referenced: set[str] = field(default_factory=set)
    """Ids of items that came from references (already in the store)."""
    background: bool = False
    response_id: str | None = None
    """The id the client was given before the answer existed (a background response): the answer takes it."""
    chain: list[str] = field(default_factory=list)
    """The earlier responses' ids, oldest first (kept with the answer: the next turn reads them at once)."""
    request: dict[str, Any] = field(default_factory=dict)
    """The client's request as it came (a background response echoes it before any answer)."""
    size: int = 0
    """Bytes of the whole input (the earlier turns' items and this turn's), encoded."""
    lease: Held | None = None
    """A background response's lease: its answer is kept only while this edge holds it."""
    encoded_input: bytes | None = None
    """`body["input"]` as JSON, when it was encoded already (a conversation's, to measure it)."""
    sent: bytes | None = None
    """The request to dispatch, as bytes (a turn kept as sent: `Responses.as_sent`; `body` is empty)."""
    lead: int = 0
    """`sent`'s lead (iop/edge/heads.py): where its first and only top-level `model` ends, or 0."""
    items_json: bytes | list[msgspec.Raw] | None = None
    """This turn's input items as the client sent them, when they were not decoded (`as_sent`):
    their JSON array, or each item's own bytes."""
    index: list[tuple[str, bytes]] = field(default_factory=list)
    """Of those, the ones with an id, by id (`as_sent`): what `keep` indexes in place of `items`."""
    unread: tuple[bytes, list[Any] | None] | None = None
    """A turn kept as sent whose items are not read yet: its body, and its items' ids if known."""
    own_id: str | None = None
    """The id this edge gives the answer it keeps, for its whole life (`Responses.dispatched`)."""
    ahead: asyncio.Task[Ahead | None] | None = None
    """Its input being written to the store while its answer is made (a large one), until `keep` takes it."""

    def encoded(self, **changes: Any) -> bytes:
        """The request to dispatch as JSON (with `changes` to its fields); an input encoded already
        is spliced in as it is."""
        if self.sent is not None:
            return self.sent if not changes else _encode({**_decode(self.sent), **changes})
        body = {**self.body, **changes}
        if self.encoded_input is not None and "input" not in changes:
            body["input"] = msgspec.Raw(self.encoded_input)
        return _encode(body)


class Responses:
    """The edge's stored-response state; `store` None when the deployment keeps none."""

    def __init__(
        self, store: ResponseStore | None, caps: ResponseCaps | None = None, sealer: compaction.Sealer | None = None
    ) -> None:
        self.store = store
        self.caps = caps if caps is not None else ResponseCaps(edgeconf.ResponsesSettings)
        """What each client key holds open on this edge (iop/responses/caps.py)."""
        self.sealer = sealer if sealer is not None else compaction.Sealer.random()
        """Opens the compaction items a stored conversation holds (a compaction answer's output)."""
        self.running: dict[str, asyncio.Task[None]] = {}
        """Background responses this edge is running, by id (iop/responses/background.py)."""
        self.leases: dict[str, Held] = {}
        """Their leases (iop/responses/takeover.py)."""
        self.runner = new_runner("edge")
        self.takeover: Takeover | None = None
        """Takes over the background responses of edges that are gone (started with the store)."""
        self.stopping = False
        self._finishing: set[asyncio.Future[Any]] = set()
        """Writes that end even when their request is cancelled (a kept answer, parts no answer took)."""

    def lost(self, response_id: str) -> None:
        """Another edge took over a background response this edge runs: its run here stops, unkept."""
        held = self.leases.get(response_id)
        task = self.running.get(response_id)
        if held is not None and task is not None:
            held.lost = True
            task.cancel()

    async def stop(self) -> None:
        """Stop the background responses this edge runs (the edge stops): another edge takes them over."""
        self.stopping = True
        if self.takeover is not None:
            await self.takeover.stop()
        await asyncio.gather(*(held.release() for held in list(self.leases.values())))
        tasks = list(self.running.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._finishing:
            await asyncio.wait(self._finishing, timeout=_TIMEOUT_S)

    async def expand(self, body: Mapping[str, Any], owner: str, max_bytes: int | None = None) -> Turn:
        """The stateless request for `body`, its references resolved for `owner`.

        Unknown ids (or another owner's) are `previous_response_not_found` (400) for
        `previous_response_id` and 404 for an `item_reference`: a client learns nothing of others'.
        A conversation whose input would be over `max_bytes` (what a stateless client may send) is
        `conversation_too_large` (400): one key cannot make the edge read and hold a chain of any size.
        """
        out = dict(body)
        previous = out.pop("previous_response_id", None)
        if previous is not None and not isinstance(previous, str):
            raise BadRequest("previous_response_id must be a string", param="previous_response_id")
        asked = out.get("store", True)
        if not isinstance(asked, bool):
            raise BadRequest("store must be a boolean", param="store")
        out["store"] = False
        background = out.get("background") is True
        if out.get("background") is not None and not isinstance(out.get("background"), bool):
            # Not silently a foreground run: the client would wait on what it asked not to wait on.
            raise BadRequest("background must be a boolean", param="background")
        if background:
            if not asked:
                raise BadRequest("background responses must be stored: send store: true", param="background")
            if self.store is None:
                raise BadRequest("background responses need the response store, which is off here", param="background")
            out["background"] = False  # the edge runs it in the background; the upstream just answers
        items = await self._resolve(_input_items(out.get("input")), owner)
        referenced = {str(item.get("id")) for item, ref in items if ref}
        turn_items = [item for item, _ in items]
        history, chain, compacted = await self._history(previous, owner, max_bytes) if previous else ([], [], False)
        sent = turn_items
        if referenced and any(isinstance(i, Mapping) and i.get("type") == "compaction" for i in sent):
            # One named by item_reference (the front opened those sent whole): the same.
            sent = compaction.opened(sent, self.sealer, owner, foreign=True)
        # A conversation is measured and dispatched on the same bytes: the earlier turns' items as
        # they were kept, this turn's encoded once.
        encoded: bytes | None = None
        if history and compacted:
            # A stored compaction answer: the model reads the summary its item holds.
            # Another service's item (a Responses upstream's own compaction) goes on as it is.
            opened = compaction.opened(
                _decode(records.joined(history)), self.sealer, owner, "previous_response_id", foreign=True
            )
            out["input"] = opened + sent
            encoded = _encode(out["input"])
        elif history:
            mine = memoryview(_encode(sent))[1:-1]
            encoded = records.joined([*history, mine] if sent else history)
            out["input"] = msgspec.Raw(encoded)
        else:
            out["input"] = sent
        size = len(encoded) if encoded is not None else 0
        if max_bytes is not None and size > max_bytes:
            raise _too_large(size, max_bytes)
        stored = asked and self.store is not None
        turn = Turn(out, turn_items, previous or None, stored, referenced, background, chain=chain, size=size)
        turn.encoded_input = encoded
        return turn

    def as_sent(self, body: bytes, lead: int, rewrite: bool = False, ids: list[Any] | None = None) -> Turn:
        """The turn of a request whose head is `kept_as_sent` (iop/edge/heads.py), read without
        decoding it: its bytes go on with `store: false` spliced in (after the leading `model`
        when `lead` says where it ends, so the node still finds it there), its input is kept as the
        bytes it came in, and only its items that name an `id` are read, for their index entries.
        `rewrite`: the body gave `store`, set false among its top-level members instead.
        `ids`: each input item's `id`, as the head's decode of this body read them. The items
        themselves are read after the dispatch (`read_sent`): while the model works when the input
        is large (`dispatched`), else when the answer is kept."""
        if rewrite:
            # Every top-level member once, `store` false, the rest as they came (a key given
            # twice once, with its last value, as it is read).
            fields = _top_level(body)
            fields["store"] = _FALSE
            sent = _encode(fields)
            found = LEAD.match(sent)  # the one `model`, first if it came first
            lead = found.end() if found is not None else 0
        else:
            space = _SPACE.match(body)  # (always a match, perhaps empty)
            at = lead if lead else (space.end() if space is not None else 0) + 1
            sent = b"".join((body[:at], b',"store":false' if lead else b'"store":false,', memoryview(body)[at:]))
        turn = Turn({}, [], None, self.store is not None)
        turn.sent, turn.lead, turn.unread = sent, lead, (body, ids)
        return turn

    @staticmethod
    def read_sent(turn: Turn) -> None:
        """A turn kept as sent: its input items as the bytes they came in, and those with an id."""
        if turn.unread is None:
            return
        body, ids = turn.unread
        # One scan at msgspec's speed, no Python object per item: each item's bytes. Their ids
        # come from the head's decode (`ids`), or a second scan.
        items = _sent_items(body).input
        if isinstance(items, str):
            turn.items_json = _encode(_input_items(items))  # a user message of that text
        else:
            if ids is None or len(ids) != len(items):
                ids = [i.id for i in _sent_ids(body).input]
            turn.index = [(i, bytes(raw)) for i, raw in zip(ids, items, strict=True) if valid_id(i)]
            turn.items_json = items  # written as they came, by the record's encode: not joined here first
        turn.unread = None  # (read: a body that could not be read is read again, and refused, by `keep`)

    def dispatched(self, owner: str, turn: Turn) -> None:
        """The turn's work is on its way to a node. An answer to keep gets its id here (the upstream's
        is replaced: two providers, or one that repeats its ids, could name two answers alike), and
        a large input is written under it now, while the answer is made, not after it."""
        if not turn.store or self.store is None or turn.response_id is not None or turn.own_id is not None:
            return  # (a background response queued or resumed has its id from before: the client has it)
        turn.own_id = new_id("resp_")
        # The body's size for a turn kept as sent; a conversation's whole input for another (its
        # own items may be fewer: `_write_ahead` measures them).
        if (len(turn.unread[0]) if turn.unread is not None else turn.size) >= AHEAD_BYTES:
            turn.ahead = asyncio.create_task(self._write_ahead(self.store, owner, turn, turn.own_id))

    async def _write_ahead(self, store: ResponseStore, owner: str, turn: Turn, response_id: str) -> Ahead | None:
        self.read_sent(turn)
        if turn.items_json is None:
            turn.items_json = _encode(turn.items)  # encoded here, off the answer's path; `keep` reuses it
            if len(turn.items_json) < AHEAD_BYTES:
                return None  # a long history, a short turn: written with its answer
        return await store.write_ahead(owner, response_id, records.ahead(turn.items_json))

    def settle(self, turn: Turn) -> None:
        """The request is over: an input written ahead that no kept answer took is removed."""
        task, turn.ahead = turn.ahead, None
        if task is not None and self.store is not None:
            self._finish(_forget_ahead(self.store, task))

    async def keep(self, owner: str, turn: Turn, response: dict[str, Any]) -> None:
        """Keep an answered turn (when it is to be kept); a store that cannot is logged, never raised.
        Its answer is whole: a client that leaves meanwhile does not cut a record written ahead in half."""
        if not turn.store or self.store is None:
            return
        if turn.response_id is not None:
            # Kept under the id the client was given; unless it was cancelled meanwhile (on any edge).
            response["id"] = turn.response_id
            stored = await self.store.response(owner, turn.response_id)
            if stored is not None and stored.response.get("status") == "cancelled":
                return
            if turn.lease is not None and not await turn.lease.commit():
                log.warning("background %s: taken over by another edge; this answer is not kept", turn.response_id)
                return
            await self._keep(self.store, owner, turn, response, None)
            return
        ahead, turn.ahead = turn.ahead, None  # this keep's now: `settle` leaves it
        if ahead is None:
            # In its request's task: a task of its own cost a kept turn ~10 % of the c=32 rate.
            await self._keep(self.store, owner, turn, response, None)
            return
        # Parts written ahead, the rest, the key that names them: a client that leaves meanwhile
        # does not cut the record in half.
        await asyncio.shield(self._finish(self._keep(self.store, owner, turn, response, ahead)))

    async def _keep(
        self,
        store: ResponseStore,
        owner: str,
        turn: Turn,
        response: dict[str, Any],
        written: asyncio.Task[Ahead | None] | None,
    ) -> None:
        # Items with ids are indexed for item_reference: those the client sent (but not the ones
        # that came from a reference, already there) and every output item.
        # (An id that is not a string was never a reference, nor is it indexed: not hashable either.)
        referenced = turn.referenced
        new = [i for i in turn.items if isinstance(i, dict) and not _among(i.get("id"), referenced)]
        new += [i for i in response.get("output") or [] if isinstance(i, dict)]
        output = response.get("output") or []
        if written is not None:
            await asyncio.wait([written])  # it reads or encodes `items_json` first, when it was not
        try:
            self.read_sent(turn)
        except msgspec.DecodeError:  # (its head's decode read every item: not seen)
            log.warning("response store: %s not kept: its input could not be read", response.get("id"))
            return
        # Measured and written on the same bytes: the input encoded once, or as it was sent.
        encoded = turn.items_json if turn.items_json is not None else _encode(turn.items)
        size = (turn.size or records.json_size(encoded)) + len(_encode(output))
        ahead = None
        if written is not None and not written.cancelled() and written.exception() is None:
            ahead = written.result()  # (one that failed: the whole record now, over the same part keys)
        try:
            record = Stored(response, list(turn.items), turn.previous, turn.chain, size)
            kept = await store.keep(owner, record, new, encoded, turn.index, ahead)
        except Exception as exc:  # NATS down, a bucket at its limit: the answer still goes out
            log.warning("response store: %s not kept: %s", response.get("id"), type(exc).__name__)
            return
        if not kept:
            log.warning("response store: an answer without a usable response id is not kept")

    def _finish(self, write: Awaitable[_T]) -> asyncio.Future[_T]:
        """`write` in a task of its own that its caller's cancellation does not end (the edge's
        stop waits for it a while)."""
        task = asyncio.ensure_future(write)
        self._finishing.add(task)
        task.add_done_callback(_finished)
        task.add_done_callback(self._finishing.discard)
        return task

    async def _resolve(self, items: list[Any], owner: str) -> list[tuple[Any, bool]]:
        """Each input item, an `item_reference` replaced by the item it names (all read at once),
        with whether it came from one. Only the references are awaited: a long input of items sent
        whole costs no task per item."""
        out: list[tuple[Any, bool]] = [(item, False) for item in items]
        refs = [n for n, item in enumerate(items) if isinstance(item, Mapping) and item.get("type") == "item_reference"]
        if not refs:
            return out

        async def one(i: int) -> None:
            ref = items[i].get("id")
            found = await self.store.item(owner, ref) if self.store is not None and isinstance(ref, str) else None
            if found is None:
                raise NotFound(f"Item with id '{ref}' not found.", param=f"input[{i}]", code="item_not_found")
            out[i] = (found, True)

        await asyncio.gather(*(one(i) for i in refs))
        return out

    async def _history(
        self, previous: str, owner: str, max_bytes: int | None
    ) -> tuple[list[memoryview], list[str], bool]:
        """The input and output items of `previous` and every response before it, oldest first, as
        the JSON they were kept as (iop/responses/records.py), their ids, and whether an item may be
        a compaction item.

        The previous response names all its ancestors, so they are read in one batched direct get:
        two round trips to NATS for a conversation of up to 512 turns, one more per 512 after that;
        turns in this edge's cache (iop/responses/cache.py) are not read, after one round trip for both.
        """
        since = time.monotonic()
        store = self.store
        got = await store.items(owner, [previous], since) if store is not None else [None]
        last = got[0] if got[0] is not None else _gone(previous)
        if max_bytes is not None and last.size > max_bytes:
            raise _too_large(last.size, max_bytes)  # before the chain is read
        chain = [*last.chain, previous]
        if len(chain) > MAX_CHAIN:
            raise BadRequest(f"the conversation is longer than {MAX_CHAIN} responses", param="previous_response_id")
        found = await store.items(owner, last.chain, since) if store is not None else []
        history: list[memoryview] = []
        compacted = False
        for at, turn in zip((*last.chain, previous), (*found, last), strict=True):
            if turn is None:
                _gone(at)
            history += turn.parts
            compacted = compacted or turn.compacted
        return history, chain, compacted


def _finished(task: asyncio.Future[Any]) -> None:
    """A write whose request may have ended meanwhile: a failure is its own to log (`_keep`,
    `_forget_ahead` do); this only marks one retrieved."""
    if not task.cancelled():
        task.exception()


async def _forget_ahead(store: ResponseStore, task: asyncio.Task[Ahead | None]) -> None:
    try:
        ahead = await task
        if ahead is not None:
            await store.forget_ahead(ahead)
    except Exception as exc:  # NATS down: the parts age out with the bucket's limits
        log.warning("response store: parts written ahead not removed: %s", type(exc).__name__)


def _gone(response_id: str) -> NoReturn:
    """A turn of the chain is not there (never kept, another owner's, deleted or expired): the
    conversation is not whole."""
    raise PreviousResponseNotFound(
        f"Previous response with id '{response_id}' not found.", param="previous_response_id"
    )


def _among(item_id: object, ids: set[str]) -> bool:
    return isinstance(item_id, str) and item_id in ids


def _input_items(value: object) -> list[Any]:
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if value is None:
        return []
    if isinstance(value, Sequence):
        return list(value)
    raise BadRequest("input must be a string or a list of items", param="input")
