"""The upstream body of a request the upstream serves natively: the client's bytes, a field or two replaced.

A native request differs from the client's body only in its top-level `model` (the provider's
model name) and, for a chat stream, `stream_options` (iop always asks for usage). The body is
split into its top-level fields as raw JSON (msgspec skips their contents without building a
single Python object), the one or two fields are replaced, and the fields are written back
verbatim: one scan and one copy. Decoding and re-encoding a 3 MB agent turn as Python objects
cost ~20x that (every string built, and re-encoded as UTF-8 when it is not ASCII).
"""

from __future__ import annotations

from typing import Any

import msgspec

from iop.errors import BadRequest
from iop.openai.usage_chunk import ask_for_usage

_top_level = msgspec.json.Decoder(dict[str, msgspec.Raw]).decode
_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode


def native_body(body: bytes, model: str | None, chat_stream: bool) -> tuple[bytes, bool]:
    """The body to send upstream, and whether iop asked for usage the client did not ask for.

    Unchanged (the same bytes object) when nothing is to be replaced.
    """
    if model is None and not chat_stream:
        return body, False
    try:
        fields = _top_level(body)
    except msgspec.DecodeError as exc:  # the edge checked it already; an older edge may not have
        raise BadRequest(f"request body is not a JSON object: {exc}", code="invalid_json") from None
    if model is not None:
        fields["model"] = msgspec.Raw(_encode(model))
    asked = False
    if chat_stream:
        raw = fields.get("stream_options")
        payload: dict[str, Any] = {"stream_options": _decode(raw)} if raw is not None else {}
        asked = ask_for_usage(payload)
        if asked:
            fields["stream_options"] = msgspec.Raw(_encode(payload["stream_options"]))
    return _encode(fields), asked
