"""A WebSocket turn as bytes: its request spliced from raw JSON, its answer's events cut out of SSE.

iop/edge/websocket.py runs every `response.create` event through the Responses front as one POST
body. The event's fields stay the raw JSON they came as (`event_fields`); a turn that continues
the socket's last response gets that response's items, kept as the bytes they came in, spliced in
front of its own (`body_of`): no item of the conversation is decoded or encoded again.

The endpoint answers in SSE (the node's bytes, relayed as they came). `SseFrames` cuts each
event's `data` out of them in one pass of a regular expression over the usual shape (an `event:`
line, one `data:` line); what that does not cover goes through the general parser
(iop/openai/sse.py). The texts go to the connection as bytes, framed there.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from iop.errors import BadRequest
from iop.openai.sse import SseDecoder

_fields = msgspec.json.Decoder(dict[str, msgspec.Raw]).decode
_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode
_CREATE = b'"response.create"'
_ENDED = frozenset({b"response.completed", b"response.incomplete", b"response.failed"})
_EVENT = re.compile(rb"(?:event: ?([^\n]*)\n)?data: ?([^\n]*)\n\n")
_ENDED_DATA = re.compile(rb'\{\s*"type"\s*:\s*"response\.(?:completed|incomplete|failed)"')
_STRING_ITEM = (b'{"type":"message","role":"user","content":[{"type":"input_text","text":', b"}]}")


def event_fields(data: bytes) -> dict[str, msgspec.Raw]:
    """The request fields of a `response.create` event (beside `"type"`, or nested under
    `"response"` in an earlier form), each the raw JSON it came as."""
    try:
        fields = _fields(data)
    except msgspec.ValidationError:
        raise BadRequest("send events of type 'response.create'", param="type", code="invalid_event") from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"the event is not valid JSON: {exc}", code="invalid_json") from None
    kind = fields.pop("type", None)
    if kind is None or (bytes(kind) != _CREATE and _decode(kind) != "response.create"):
        raise BadRequest("send events of type 'response.create'", param="type", code="invalid_event")
    nested = fields.get("response")
    if nested is not None and bytes(nested)[:1] == b"{":
        return _fields(nested)
    return fields


def string_of(raw: msgspec.Raw | None) -> str | None:
    """A field's value when it is a JSON string."""
    if raw is None or bytes(raw)[:1] != b'"':
        return None
    value = _decode(raw)
    return value if isinstance(value, str) else None


def items_of(raw: msgspec.Raw | None) -> bytes:
    """An `input` or `output` as its items, comma-joined JSON (b"" for none): a list's items as they
    came, a string as one user message; anything else has none."""
    if raw is None:
        return b""
    data = bytes(raw)
    if data[:1] == b"[":
        return data[1:-1].strip()
    if data[:1] == b'"':
        return _STRING_ITEM[0] + data + _STRING_ITEM[1]
    return b""


def joined(first: bytes, then: bytes) -> bytes:
    """Two comma-joined runs of items as one."""
    return first + b"," + then if first and then else first or then


def body_of(fields: dict[str, msgspec.Raw], items: bytes | None) -> bytes:
    """The request as a POST body with `stream: true`; `items`, when given, its whole input in place
    of its own `input` and `previous_response_id`."""
    parts = [b'{"stream":true']
    for name, value in fields.items():
        if name == "stream" or (items is not None and (name == "input" or name == "previous_response_id")):
            continue
        parts += (b",", _encode(name), b":", value)  # a Raw is a buffer: joined as it is
    if items is not None:
        parts += (b',"input":[', items, b"]")
    parts.append(b"}")
    return b"".join(parts)


class _Response(msgspec.Struct):
    id: str
    status: Any = None
    output: msgspec.Raw = msgspec.Raw(b"[]")


class _Ended(msgspec.Struct):
    response: _Response


_ended = msgspec.json.Decoder(_Ended).decode


class Ended(msgspec.Struct):
    """The response a turn ended with: what the socket keeps of it."""

    id: str
    status: Any
    output: bytes
    """Its output items, comma-joined JSON."""
    compaction: bool
    """Its output is compaction items only (a summary that replaces the window)."""


def ended_of(data: bytes | None) -> Ended | None:
    """The final event's response (its id, status and output); None when it has no response with an id."""
    if data is None:
        return None
    try:
        response = _ended(data).response
    except msgspec.DecodeError:
        return None
    output = items_of(response.output)
    compaction = False
    if b'"compaction"' in output:
        items = _decode(response.output)
        compaction = all(isinstance(i, dict) and i.get("type") == "compaction" for i in items)
    return Ended(response.id, response.status, output, compaction)


class SseFrames:
    """One SSE answer, fed as it is sent, as the texts of its events (`[DONE]` left out), UTF-8 bytes."""

    __slots__ = ("decoder", "ended", "pending")

    def __init__(self) -> None:
        self.pending = b""
        """The start of an event whose end has not come yet."""
        self.decoder: SseDecoder | None = None
        """The general parser, for an answer with CR line ends (from the first one on)."""
        self.ended: bytes | None = None
        """The text of the answer's final event (`response.completed`, `.incomplete`, `.failed`)."""

    def feed(self, data: bytes, more: bool) -> list[bytes]:
        if self.decoder is None and b"\r" not in data:
            if self.pending:
                data, self.pending = self.pending + data, b""
            if more:
                cut = data.rfind(b"\n\n") + 2
                if cut == 1:
                    self.pending = data
                    return []
                if cut < len(data):
                    data, self.pending = data[:cut], data[cut:]
            return self._texts(data)
        if self.decoder is None:
            self.decoder = SseDecoder()
            data, self.pending = self.pending + data, b""
        events = self.decoder.feed(data) if data else []
        if not more:
            events += self.decoder.finish()
        texts: list[bytes] = []
        for event in events:
            self._text(None if event.event is None else event.event.encode(), _utf8(event.data), texts)
        return texts

    def _texts(self, data: bytes) -> list[bytes]:
        """The events of `data`, which starts with an event (and, but at the answer's end, ends with one)."""
        data = _utf8(data)
        parts = _EVENT.split(data)  # [before, name, text, between, name, text, ..., after]
        if any(parts[::3]):
            # A shape the expression does not cover (comments, ids, several data lines): the parser.
            decoder = SseDecoder()
            texts: list[bytes] = []
            for event in decoder.feed(data) + decoder.finish():
                self._text(None if event.event is None else event.event.encode(), event.data, texts)
            return texts
        names, texts = parts[1::3], parts[2::3]
        if not _ENDED.isdisjoint(names) or None in names:
            for name, text in zip(names, texts, strict=True):
                if name in _ENDED or (name is None and _ENDED_DATA.match(text)):
                    self.ended = text
        return [t for t in texts if t != b"[DONE]"] if b"[DONE]" in texts else texts

    def _text(self, name: bytes | None, text: bytes, texts: list[bytes]) -> None:
        if text == b"[DONE]":
            return
        if name in _ENDED or (name is None and _ENDED_DATA.match(text)):
            self.ended = text
        texts.append(text)


def _utf8(data: bytes) -> bytes:
    """`data`, made valid UTF-8 (a text frame must be) where it is not."""
    if data.isascii():
        return data
    try:
        data.decode()
    except UnicodeDecodeError:
        return data.decode(errors="replace").encode()
    return data
