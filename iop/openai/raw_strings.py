"""A Responses request decoded for translation with its long texts left as the client's JSON bytes.

Translating a Responses request for a chat server moves its texts (message content, tool outputs,
call arguments, images as data URLs) from one place to another and never reads them, yet encoding
the chat request converted each string back to UTF-8: 12 of the 22 CPU-ms a 3 MB agent turn took.
Here the request is decoded with the fields that carry those texts as raw JSON (msgspec views into
the body); a long string among them becomes a short placeholder, and once the chat request is
encoded (2.5 ms) each placeholder is replaced by the original string's escaped bytes. Inside a
JSON string the escaped forms of two texts joined are the escaped form of the joined text, so a
placeholder that the translation joined with other text (`"\\n".join`) splices just as well.

A placeholder that did not survive the translation intact (re-escaped, cut, transformed) leaves
a stray NUL escape in the output; `Placeholders.encode` then answers None and the caller translates
the fully decoded request instead. The marker holds a per-process random nonce, so a client's text
cannot forge one.
"""

from __future__ import annotations

import secrets
from typing import Any

import msgspec

from iop.openai.passthrough import Piece

LONG = 512
"""Strings whose JSON is at least this many bytes stay raw."""
_NONCE = secrets.token_hex(8)
_MARK = f"\x00iop-raw-{_NONCE}-"
_ENCODED_MARK = b"\\u0000iop-raw-" + _NONCE.encode() + b"-"
"""A placeholder's start as msgspec encodes it (a NUL is written `\\u0000`)."""
# The fields of input items and of their content parts that the translation passes through as
# they are (responses_request.py); every other field is decoded as usual.
_ITEM_TEXTS = frozenset({"content", "output", "arguments"})
_PART_TEXTS = frozenset({"text", "image_url"})


class _Item(msgspec.Struct):
    """An input item as far as the translation reads it (responses_request.py, tool_names.py): the
    fields that carry its texts as raw JSON, the others decoded. Fields it never reads are dropped."""

    type: Any = msgspec.UNSET
    role: Any = msgspec.UNSET
    content: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET
    name: Any = msgspec.UNSET
    namespace: Any = msgspec.UNSET
    call_id: Any = msgspec.UNSET
    arguments: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET
    input: Any = msgspec.UNSET
    output: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET
    summary: Any = msgspec.UNSET
    tools: Any = msgspec.UNSET


_KNOWN = (
    "model", "instructions", "tools", "tool_choice", "parallel_tool_calls", "stream", "stream_options",
    "store", "previous_response_id", "conversation", "prompt", "background", "include", "temperature",
    "top_p", "presence_penalty", "frequency_penalty", "stop", "user", "max_output_tokens",
    "max_tool_calls", "metadata", "reasoning", "text", "truncation", "top_logprobs", "service_tier",
    "safety_identifier", "prompt_cache_key", "prompt_cache_retention", "client_metadata",
)  # fmt: skip
"""The top-level fields a Responses request may carry beside `input` (Codex CLI's among them)."""
_Request = msgspec.defstruct(
    "_Request",
    [("input", list[_Item] | str | msgspec.UnsetType, msgspec.UNSET), *((k, Any, msgspec.UNSET) for k in _KNOWN)],
    forbid_unknown_fields=True,
)
"""A request of known fields alone, in one pass over the body: the top level and the items at once
(the split into top-level fields first was a second pass over every tool output, 1 ms per 3 MB)."""

_request = msgspec.json.Decoder(_Request).decode
_items = msgspec.json.Decoder(list[_Item]).decode
_fields = msgspec.json.Decoder(dict[str, msgspec.Raw]).decode
_elements = msgspec.json.Decoder(list[msgspec.Raw]).decode
_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode


class Placeholders:
    """The long strings of one request, by placeholder number."""

    def __init__(self) -> None:
        self.raw: list[msgspec.Raw] = []

    def decode(self, body: bytes) -> Any:
        """The request as `msgspec.json.decode` gives it, but with long texts of `input` as placeholders.

        Raises msgspec.DecodeError as a full decode would (for a body that is not JSON).
        """
        try:
            top = _request(body)
        except msgspec.ValidationError:
            return self._general(body)  # a field not known here, or an input not of items: field by field
        request: dict[str, Any] = {}
        for key in _Request.__struct_fields__:
            value = getattr(top, key)
            if value is not msgspec.UNSET:
                request[key] = self._objects(value) if key == "input" and isinstance(value, list) else value
        return request

    def _general(self, body: bytes) -> Any:
        fields = _fields(body)
        request: dict[str, Any] = {k: v for k, v in ((k, _decode(v)) for k, v in fields.items() if k != "input")}
        raw_input = fields.get("input")
        if raw_input is not None:
            request["input"] = self._input(raw_input)
        # In the client's order, as a full decode gives it (nothing reads the order).
        return {k: request[k] for k in fields}

    def _input(self, raw: msgspec.Raw) -> Any:
        if not _starts(raw, b"["):
            return _decode(raw)
        try:
            items = _items(raw)  # one pass: the long fields as raw views, the rest decoded
        except msgspec.ValidationError:
            return self._list(raw, _ITEM_TEXTS, nested=True)  # an item that is not an object: field by field
        return self._objects(items)

    def _objects(self, items: list[_Item]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for item in items:
            obj: dict[str, Any] = {}
            for key in _Item.__struct_fields__:
                value = getattr(item, key)
                if value is msgspec.UNSET:
                    continue
                if not isinstance(value, msgspec.Raw):
                    obj[key] = value
                elif len(value) < LONG:
                    obj[key] = _decode(value)
                elif _starts(value, b'"'):
                    obj[key] = self._hold(value)
                elif key != "arguments" and _starts(value, b"["):
                    obj[key] = self._list(value, _PART_TEXTS, nested=False)
                else:
                    obj[key] = _decode(value)
            out.append(obj)
        return out

    def _list(self, raw: msgspec.Raw, texts: frozenset[str], nested: bool) -> list[Any]:
        out: list[Any] = []
        for element in _elements(raw):
            # Only an element long enough to hold a long text is split further: one decode for the rest.
            long = len(element) >= LONG and _starts(element, b"{")
            out.append(self._object(element, texts, nested) if long else _decode(element))
        return out

    def _object(self, raw: msgspec.Raw, texts: frozenset[str], nested: bool) -> dict[str, Any]:
        obj: dict[str, Any] = {}
        for key, value in _fields(raw).items():
            if len(value) < LONG:
                obj[key] = _decode(value)
            elif key in texts and _starts(value, b'"'):
                obj[key] = self._hold(value)
            elif nested and key in ("content", "output") and _starts(value, b"["):
                obj[key] = self._list(value, _PART_TEXTS, nested=False)
            else:
                obj[key] = _decode(value)
        return obj

    def _hold(self, raw: msgspec.Raw) -> str:
        self.raw.append(raw)
        return f"{_MARK}{len(self.raw) - 1}\x00"

    def encode(self, obj: Any) -> list[Piece] | None:
        """`obj` as JSON with every placeholder replaced by its string, as pieces to send in a row
        (the long strings are views of the client's body: joining them would copy the body once
        more); None if a placeholder did not survive."""
        data = _encode(obj)
        if not self.raw:
            return [data]
        pieces: list[Piece] = []
        view = memoryview(data)
        last = 0
        at = data.find(_ENCODED_MARK)
        while at >= 0:
            # The marker as msgspec writes it: `\u0000iop-raw-<nonce>-<number>\u0000`, not escaped again.
            stop = data.find(b"\\u0000", at + len(_ENCODED_MARK))
            number = data[at + len(_ENCODED_MARK) : stop]
            if stop < 0 or not number.isdigit() or int(number) >= len(self.raw) or data[at - 1 : at] == b"\\":
                return None
            pieces.append(view[last:at])
            pieces.append(memoryview(self.raw[int(number)])[1:-1])  # the string's escaped text, no quotes
            last = stop + 6
            at = data.find(_ENCODED_MARK, last)
        pieces.append(view[last:])
        # Every NUL in what the translation wrote must be one of the two of a whole placeholder:
        # one re-escaped, cut or changed on the way leaves others (so may a short text of the
        # client's, which then takes the slow path too).
        if data.count(b"\\u0000") != 2 * (len(pieces) // 2):
            return None
        return pieces


def _starts(raw: msgspec.Raw, prefix: bytes) -> bool:
    return memoryview(raw)[:1] == prefix
