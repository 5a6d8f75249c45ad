"""A Responses request decoded for translation with its long texts left as the client's JSON bytes.

Translating a Responses request for a chat server moves its texts (message content, tool outputs,
call arguments, images as data URLs) from one place to another and never reads them. Decoding a
3 MB agent turn built every one of those strings, and encoding the chat request converted each
back to UTF-8: ~2.5x the cost of leaving them as bytes. Here the request is split field by field
as raw JSON (msgspec skips what it does not decode); a long string in one of the fields that pass
through verbatim becomes a short placeholder, and once the chat request is encoded each
placeholder is replaced by the original string's escaped bytes. Inside a JSON string the escaped
forms of two texts joined are the escaped form of the joined text, so a placeholder that the
translation joined with other text (`"\\n".join`) splices just as well.

A placeholder that did not survive the translation intact (re-escaped, cut, transformed) leaves
a stray NUL escape in the output; `Placeholders.encode` then answers None and the caller translates
the fully decoded request instead. The marker holds a per-process random nonce, so a client's text
cannot forge one.
"""

from __future__ import annotations

import re
import secrets
from typing import Any

import msgspec

LONG = 512
"""Strings whose JSON is at least this many bytes stay raw."""
_NONCE = secrets.token_hex(8)
_MARK = f"\x00iop-raw-{_NONCE}-"
_ENCODED = re.compile(rb"(?<!\\)\\u0000iop-raw-" + _NONCE.encode() + rb"-(\d+)\\u0000")
# The fields of input items and of their content parts that the translation passes through as
# they are (responses_request.py); every other field is decoded as usual.
_ITEM_TEXTS = frozenset({"content", "output", "arguments"})
_PART_TEXTS = frozenset({"text", "image_url"})

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
        fields = _fields(body)
        request: dict[str, Any] = {k: v for k, v in ((k, _decode(v)) for k, v in fields.items() if k != "input")}
        raw_input = fields.get("input")
        if raw_input is not None:
            request["input"] = self._list(raw_input, _ITEM_TEXTS, nested=True) if _starts(raw_input, b"[") else None
            if request["input"] is None:
                request["input"] = _decode(raw_input)
        # Keep the client's order of fields (nothing reads it, but the error messages stay alike).
        return {k: request[k] for k in fields}

    def _list(self, raw: msgspec.Raw, texts: frozenset[str], nested: bool) -> list[Any]:
        out: list[Any] = []
        for element in _elements(raw):
            out.append(self._object(element, texts, nested) if _starts(element, b"{") else _decode(element))
        return out

    def _object(self, raw: msgspec.Raw, texts: frozenset[str], nested: bool) -> dict[str, Any]:
        obj: dict[str, Any] = {}
        for key, value in _fields(raw).items():
            if key in texts and len(value) >= LONG and _starts(value, b'"'):
                obj[key] = self._hold(value)
            elif nested and key in ("content", "output") and _starts(value, b"["):
                obj[key] = self._list(value, _PART_TEXTS, nested=False)
            else:
                obj[key] = _decode(value)
        return obj

    def _hold(self, raw: msgspec.Raw) -> str:
        self.raw.append(raw)
        return f"{_MARK}{len(self.raw) - 1}\x00"

    def encode(self, obj: Any) -> bytes | None:
        """`obj` as JSON with every placeholder replaced by its string; None if one did not survive."""
        data = _encode(obj)
        if not self.raw:
            return data
        pieces: list[bytes | memoryview] = []
        last = 0
        for m in _ENCODED.finditer(data):
            i = int(m.group(1))
            if i >= len(self.raw):
                return None
            pieces.append(memoryview(data)[last : m.start()])
            pieces.append(memoryview(self.raw[i])[1:-1])  # the string's escaped text, without its quotes
            last = m.end()
        pieces.append(memoryview(data)[last:])
        # Every NUL in what the translation wrote must be one of the two of a whole placeholder:
        # one re-escaped, cut or changed on the way leaves others (so may a short text of the
        # client's, which then takes the slow path too).
        if data.count(b"\\u0000") != 2 * (len(pieces) // 2):
            return None
        return b"".join(pieces)


def _starts(raw: msgspec.Raw, prefix: bytes) -> bool:
    return memoryview(raw)[:1] == prefix
