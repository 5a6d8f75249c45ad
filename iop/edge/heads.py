"""What the edge reads of a request body (chat, Responses, Messages, embeddings, completions):
the model, the stream flag, the session key.

The body itself passes through untouched; only these few fields are decoded (and checked, so that
a client's wrongly typed field is a 400 naming it here, never a crash on a node).
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, MutableMapping
from typing import Any, Literal, NamedTuple, TypeVar

import msgspec

from iop import config, endpoints, wire
from iop.errors import BadRequest, RequestError
from iop.openai.passthrough import LEAD
from iop.openai.responses_request import responses_to_chat_request

# The edge checks the types of the fields iop itself reads or translates (on the node: the
# translations, the mock's writer), so that a client's wrongly typed field is a 400 naming it here,
# never a crash on a node that would count against the provider. Everything else passes through
# unread; empty Structs check "an object" without decoding its contents.


class _Object(msgspec.Struct):
    """Any JSON object (its fields unread)."""


class _ToolCall(msgspec.Struct):
    function: _Object | None = None


class _Message(msgspec.Struct):
    """A chat message as far as the edge checks it: an object with a string `role`."""

    role: str
    tool_calls: list[_ToolCall] | None = None


class _Item(msgspec.Struct):
    """A Responses input item as far as the edge checks it: an object, its `type` a string.
    Its `id` as it came (any JSON), for the index of a turn kept as sent (iop/responses/expand.py)."""

    type: str | None = None
    id: Any = None


class ModelName(str):
    """A body's top-level `model`: the decoders below count every one they meet (`_model_name`)."""

    __slots__ = ()


class ChatHead(msgspec.Struct):
    """The few fields of a chat request the edge reads; the body itself passes through untouched."""

    model: ModelName
    messages: list[_Message]
    stream: bool = False
    tools: list[_Object] | None = None
    prompt_cache_key: str | None = None
    user: str | None = None
    """Chat clients without a `prompt_cache_key` often name the session's user: a session key too."""
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    stream_options: Any = msgspec.UNSET
    """Only whether it is there: without it the node adds its own without reading the body (`lead`)."""


AsSent = Literal["", "splice", "rewrite"]
"""How a kept Responses turn goes on as sent (`ResponsesHead.kept_as_sent`): not at all (""), its
bytes with `store: false` added ("splice"), or its top-level members with `store` set false
("rewrite": the body gave `store`)."""


class ResponsesHead(msgspec.Struct):
    model: ModelName
    input: str | list[_Item]
    stream: bool = False
    tools: list[_Object] | None = None
    include: list[str] | None = None
    prompt_cache_key: str | None = None
    store: bool | msgspec.UnsetType | None = msgspec.UNSET
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    generate: Any = None
    """Codex's warm-up sends `false` (iop/edge/responses_front.py answers it); never checked here."""
    background: Any = msgspec.UNSET
    """Only whether it is there (iop/responses/expand.py checks it)."""

    def stateful(self) -> bool:
        """The request names or makes state the edge holds (iop/responses): it is expanded first."""
        if self.store is not False or self.previous_response_id is not None:
            return True
        return not isinstance(self.input, str) and any(i.type == "item_reference" for i in self.input)

    def kept_as_sent(self) -> AsSent:
        """A turn to keep that names no state and no option the edge applies (`store` true or
        left out, no `previous_response_id` or `background` key, no item_reference): its bytes go
        on as they came, with `store: false` (iop/responses/expand.py, `as_sent`)."""
        if (self.store is not msgspec.UNSET and self.store is not True) or self.previous_response_id is not None:
            return ""
        if self.background is not msgspec.UNSET:
            return ""
        if not isinstance(self.input, str) and any(i.type == "item_reference" for i in self.input):
            return ""
        return "splice" if self.store is msgspec.UNSET else "rewrite"

    def for_front(self) -> bool:
        """A warm-up, or compaction in the input: iop/edge/responses_front.py answers or opens it."""
        if self.generate is False:
            return True
        if isinstance(self.input, str) or not self.input:
            return False
        return self.input[-1].type == "compaction_trigger" or any(i.type == "compaction" for i in self.input)


class CompactHead(msgspec.Struct):
    """`/v1/responses/compact`, passed through to a Responses upstream: its window may name stored state."""

    model: str
    input: str | list[_Item] | None = None
    previous_response_id: str | None = None

    def stateful(self) -> bool:
        if self.previous_response_id is not None:
            return True
        return isinstance(self.input, list) and any(i.type == "item_reference" for i in self.input)


_JSON_KINDS = {type(None): "null", bool: "bool", int: "int", float: "float", list: "array", dict: "object"}
_models = [0]
"""How many top-level `model` keys the decode running now met. The edge reads heads on its event
loop's thread only, one decode at a time, with no await between a decode and its `lead`."""


def _model_name(kind: type, value: Any) -> Any:
    """msgspec's hook for `ModelName`: a top-level `model`, checked as a `str` field is, and counted.

    A key that occurs twice is decoded twice (the last one wins): the count is what tells."""
    if kind is not ModelName:
        raise NotImplementedError
    if type(value) is not str:
        raise TypeError(f"Expected `str`, got `{_JSON_KINDS.get(type(value), type(value).__name__)}`")
    _models[0] += 1
    return ModelName(value)


_compact_head = msgspec.json.Decoder(CompactHead).decode
_chat_head = msgspec.json.Decoder(ChatHead, dec_hook=_model_name).decode
_responses_head = msgspec.json.Decoder(ResponsesHead, dec_hook=_model_name).decode
_decode_json = msgspec.json.Decoder().decode
_utf8_decoder = codecs.getincrementaldecoder("utf-8")
_T = TypeVar("_T")


class Head(NamedTuple):
    model: str
    stream: bool
    cache_key: str | None
    """`prompt_cache_key`: the client's session key (prefix-cache affinity)."""
    user: str | None
    """Chat's `user`: the session key of last resort (after the session-id headers)."""
    stateful: bool = False
    """A Responses request the edge expands and whose answer it may keep (iop/responses)."""
    max_tokens: int | None = None
    """The most output tokens the request allows (the router's size of its answer)."""
    lead: int = 0
    """`wire.WorkItem.lead` of this very body: where its first and only top-level `model` ends."""
    as_sent: AsSent = ""
    """A Responses turn to keep whose bytes go on as they came (`ResponsesHead.kept_as_sent`)."""
    ids: list[str | None] | None = None
    """With `as_sent` and a list `input`: each input item's `id` as the head's decode read it, when a
    string (None when it gave none or another JSON value)."""


KNOWN = "iop.responses_head"
"""Scope key of the head iop/edge/responses_front.py read of a body it passed on: (body, head)."""


Known = tuple[ResponsesHead, int]
"""A Responses body's head and its `lead`."""


def known_head(scope: MutableMapping[str, Any], body: bytes) -> Known | None:
    """The head read of this very body before (`KNOWN`), taken out of the scope."""
    known = scope.pop(KNOWN, None)
    return known[1] if known is not None and known[0] is body else None


def responses_head(body: bytes) -> Known:
    """A Responses body's head, checked as `parse_head` checks it, and its `lead`."""
    _models[0] = 0
    head = _checked(_responses_head, body)
    return head, lead(body, head.model, _models[0] == 1)


def lead(body: bytes, model: str, once: bool) -> int:
    """Where the body's `model` ends when it is the body's first key and its only top-level one
    (`once`, as the decode counted), its value the `model` read, without escapes; else 0.

    With it the node sets the upstream's model without reading the rest of the body (0.3 ms per
    800 KB, iop/openai/passthrough.py). Any other body the node reads whole, as before."""
    if not once:
        return 0
    found = LEAD.match(body)
    if found is None or found.group(1) != model.encode():
        return 0
    return found.end()


def parse_head(api: wire.Api, body: bytes, known: Known | None = None) -> Head:
    """The model, stream flag and session key, after checking the body is a request of this API at all.

    `known`: this body's ResponsesHead and lead, read already (`known_head`)."""
    if api == "responses":
        resp, at = known if known is not None else responses_head(body)
        model = str(resp.model)
        stateful, max_tokens = resp.stateful(), resp.max_output_tokens
        as_sent = resp.kept_as_sent() if stateful else ""
        # Only strings can be ids: any other JSON an item gives as its `id` is not held while
        # the request waits (it could be many times the body's bytes as Python objects).
        items = resp.input if as_sent and not isinstance(resp.input, str) else None
        ids = [i.id if isinstance(i.id, str) else None for i in items] if items is not None else None
        return Head(model, resp.stream, resp.prompt_cache_key, None, stateful, max_tokens, at, as_sent, ids)
    return _checked(lambda b: _head(api, b), body)


def _head(api: wire.Api, body: bytes) -> Head:
    if api == "chat":
        _models[0] = 0
        chat = _chat_head(body)
        if not chat.messages:
            raise BadRequest("'messages' must not be empty", param="messages")
        limit = chat.max_completion_tokens or chat.max_tokens
        # A chat stream's node adds `stream_options` after the model: only to a body without one.
        at = lead(body, chat.model, _models[0] == 1) if chat.stream_options is msgspec.UNSET else 0
        return Head(str(chat.model), chat.stream, chat.prompt_cache_key, chat.user, max_tokens=limit, lead=at)
    if api == "compact":
        compact = _compact_head(body)
        return Head(compact.model, False, None, None, compact.stateful())
    model, stream, user = other_head(api, body)
    return Head(model, stream, None, user)


def _checked(decode: Callable[[bytes], _T], body: bytes) -> _T:
    """`decode(body)`, its errors the 400s naming the field; the body checked to be UTF-8 all through."""
    if not body.isascii():
        # The edge skips most of the body; make sure what it forwards is UTF-8 all through.
        check_utf8(body)
    try:
        return decode(body)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"invalid request body: {_path_message(exc)}", param=_param(exc)) from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:
        # msgspec recurses once per nesting level, even in the parts it skips.
        raise BadRequest("request body is nested too deeply", code="invalid_json") from None


UTF8_PIECE = 256 * 1024
"""The UTF-8 check decodes this much at a time: a third of the CPU of one decode of a 3 MB body,
whose text (never kept) was a 3 MB allocation written once and thrown away."""


def check_utf8(body: bytes) -> None:
    """BadRequest naming the first byte that is not UTF-8, if there is one."""
    decoder = _utf8_decoder()
    view = memoryview(body)
    try:
        for start in range(0, len(body), UTF8_PIECE):
            decoder.decode(view[start : start + UTF8_PIECE])
        decoder.decode(b"", True)
    except UnicodeDecodeError:
        try:
            body.decode("utf-8")  # once more whole, for the position the client is told
        except UnicodeDecodeError as exc:
            raise BadRequest(f"request body is not valid UTF-8 (byte {exc.start})", code="invalid_json") from None


# --- Messages, embeddings, completions -------------------------------------------------------


class _Turn(msgspec.Struct):
    """A Messages turn as far as the edge checks it: a string `role`, content a string or blocks."""

    role: str
    content: str | list[_Object]


class _Metadata(msgspec.Struct):
    user_id: str | None = None


class MessagesHead(msgspec.Struct):
    model: str
    messages: list[_Turn]
    max_tokens: int
    stream: bool = False
    system: str | list[_Object] | None = None
    tools: list[_Object] | None = None
    stop_sequences: list[str] | None = None
    metadata: _Metadata | None = None
    """Claude Code's `user_id` names its session (a JSON string holding session_id): a session key."""


class CountTokensHead(msgspec.Struct):
    """`/v1/messages/count_tokens` takes a Messages request without `max_tokens`."""

    model: str
    messages: list[_Turn]
    system: str | list[_Object] | None = None
    tools: list[_Object] | None = None


class EmbeddingsHead(msgspec.Struct):
    model: str
    input: str | list[str | int | list[int]]
    """A text, or a batch: texts, one input's token ids, or several inputs' token ids."""
    encoding_format: str | None = None
    user: str | None = None


class CompletionsHead(msgspec.Struct):
    model: str
    prompt: str | list[str | int | list[int]]
    stream: bool = False
    suffix: str | None = None
    user: str | None = None


messages_head = msgspec.json.Decoder(MessagesHead).decode
count_tokens_head = msgspec.json.Decoder(CountTokensHead).decode
embeddings_head = msgspec.json.Decoder(EmbeddingsHead).decode
completions_head = msgspec.json.Decoder(CompletionsHead).decode


def other_head(api: wire.Api, body: bytes) -> tuple[str, bool, str | None]:
    """The model, stream flag and session key of a Messages, embeddings or completions body.

    Raises msgspec's errors for the caller (api.parse_head) to turn into the 400 naming the field.
    """
    if api == "messages":
        msg = messages_head(body)
        if not msg.messages:
            raise BadRequest("'messages' must not be empty", param="messages")
        if msg.max_tokens < 1:
            raise BadRequest("'max_tokens' must be a positive integer", param="max_tokens")
        return msg.model, msg.stream, msg.metadata.user_id if msg.metadata is not None else None
    if api == "embeddings":
        emb = embeddings_head(body)
        if not emb.input:
            raise BadRequest("'input' must not be empty", param="input")
        return emb.model, False, emb.user
    if api == "count_tokens":
        count = count_tokens_head(body)
        return count.model, False, None
    comp = completions_head(body)
    return comp.model, comp.stream, comp.user


def _path_message(exc: msgspec.ValidationError) -> str:
    return str(exc).replace("`$.", "`").replace(" - at `$`", "")


def _param(exc: msgspec.ValidationError) -> str | None:
    msg = str(exc)
    if "`$." in msg:
        return msg.split("`$.", 1)[1].split("`", 1)[0]
    if "missing required field `" in msg:
        return msg.split("missing required field `", 1)[1].split("`", 1)[0]
    return None


def check_mixed_pool(catalog: config.Catalog, alias: str, body: bytes) -> None:
    """Refuse here what a chat-only provider of a mixed pool would refuse (e.g. previous_response_id).

    A pool of chat-only and Responses providers must give a request the same answer whichever
    provider it lands on; the edge decides before it picks one. Pools that are all one kind decide
    on the node, the same way on every provider, and cost the edge nothing.
    """
    members = catalog.pools[alias]
    translating = [p for p in members if _translates_responses(catalog.providers[p].adapter)]
    if not translating or len(translating) == len(members):
        return
    try:
        responses_to_chat_request(_decode_json(body), alias)
    except RequestError as exc:
        exc.headers.setdefault("x-iop-provider", translating[0])
        raise


def _translates_responses(adapter: config.Adapter) -> bool:
    own = endpoints.native(adapter)
    return isinstance(adapter, config.OpenAIAdapter) and "responses" not in own and "chat" in own
