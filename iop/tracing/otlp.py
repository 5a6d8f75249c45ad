"""OTLP's trace protobuf (`ExportTraceServiceRequest`) written by hand: what the exporter sends.

Only the few messages and fields iop fills (opentelemetry-proto's trace.proto, common.proto,
resource.proto); tests/otlp.py reads the result with OpenTelemetry's own generated classes.
Encoding is pure: bytes in, bytes out, nothing here does I/O.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

_DOUBLE = struct.Struct("<d")
_FIXED64 = struct.Struct("<Q")
_INT64 = (1 << 64) - 1
_INT64_BOUND = 1 << 63


class Encodable(Protocol):
    """What the encoder reads of a finished span (iop.tracing.Span)."""

    name: str
    kind: int
    trace_id: int
    span_id: int
    parent_id: int
    trace_state: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: list[tuple[int, str, dict[str, Any] | None]] | None
    error: str


def _varint(n: int) -> bytes:
    if n < 0x80:
        return bytes((n,))
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(tag: int, payload: bytes) -> bytes:
    """A length-delimited field; `tag` is its number shifted left by 3, or'ed with wire type 2."""
    n = len(payload)
    return (bytes((tag, n)) if n < 0x80 else bytes((tag,)) + _varint(n)) + payload


def _value(v: Any) -> bytes:
    """An AnyValue: string 1, bool 2, int 3, double 4, array 5."""
    if isinstance(v, str):
        return _field(0x0A, v.encode("utf-8", "replace"))
    if isinstance(v, bool):
        return b"\x10\x01" if v else b"\x10\x00"
    if isinstance(v, int):
        if -_INT64_BOUND <= v < _INT64_BOUND:
            return b"\x18" + _varint(v & _INT64)
        return _field(0x0A, str(v).encode())  # no int64 holds it: its digits, not a wrapped number
    if isinstance(v, float):
        return b"\x21" + _DOUBLE.pack(v)
    if isinstance(v, (list, tuple)):
        return _field(0x2A, b"".join([_field(0x0A, _value(x)) for x in v]))  # ArrayValue.values
    return _field(0x0A, str(v).encode("utf-8", "replace"))


_KEYS: dict[str, bytes] = {}
"""Encoded attribute keys (KeyValue.key), the few names iop uses, made once."""


def attributes(tag: int, attrs: Mapping[str, Any]) -> bytes:
    """Repeated KeyValue (key 1, value 2) under field `tag`."""
    out = []
    keys = _KEYS
    for k, v in attrs.items():
        key = keys.get(k)
        if key is None:
            key = _field(0x0A, k.encode("utf-8", "replace"))
            if len(keys) < 4096:
                keys[k] = key
        if type(v) is str:
            raw = v.encode("utf-8", "replace")
            n = len(raw)
            if n < 0x7E:  # the common case, every length one byte: KeyValue{key, value: AnyValue{string}}
                inner = key + bytes((0x12, n + 2, 0x0A, n)) + raw
                out.append(bytes((tag, len(inner))) + inner if len(inner) < 0x80 else _field(tag, inner))
                continue
            value = _field(0x0A, raw)
        elif v is None:
            continue
        else:
            value = _value(v)
        out.append(_field(tag, key + _field(0x12, value)))
    return b"".join(out)


def span(s: Encodable) -> bytes:
    """One Span message."""
    out = [
        b"\x0a\x10",  # trace_id: 16 bytes
        s.trace_id.to_bytes(16, "big"),
        b"\x12\x08",  # span_id: 8 bytes
        s.span_id.to_bytes(8, "big"),
    ]
    if s.trace_state:
        out.append(_field(0x1A, s.trace_state.encode("latin-1", "replace")))
    if s.parent_id:
        out += (b"\x22\x08", s.parent_id.to_bytes(8, "big"))
    out += (
        _field(0x2A, s.name.encode("utf-8", "replace")),
        b"\x30",  # kind
        bytes((s.kind,)),
        b"\x39",  # start_time_unix_nano: fixed64
        _FIXED64.pack(s.start_ns),
        b"\x41",  # end_time_unix_nano
        _FIXED64.pack(s.end_ns),
        attributes(0x4A, s.attributes),
    )
    if s.events:
        for at, name, attrs in s.events:
            event = b"\x09" + _FIXED64.pack(at) + _field(0x12, name.encode())
            if attrs:
                event += attributes(0x1A, attrs)
            out.append(_field(0x5A, event))
    if s.error:
        out.append(_field(0x7A, _field(0x12, s.error.encode("utf-8", "replace")) + b"\x18\x02"))  # STATUS_CODE_ERROR
    return b"".join(out)


def resource_prefix(resource: Mapping[str, Any], scope: str, version: str) -> tuple[bytes, bytes]:
    """The constant parts of a process's ResourceSpans: its Resource, and its ScopeSpans' scope."""
    instrumentation = _field(0x0A, scope.encode()) + _field(0x12, version.encode())
    return _field(0x0A, attributes(0x0A, resource)), _field(0x0A, instrumentation)


def request(prefix: tuple[bytes, bytes], spans: Iterable[Encodable]) -> bytes:
    """An ExportTraceServiceRequest of one resource's spans, under one instrumentation scope."""
    resource, scope = prefix
    scope_spans = scope + b"".join([_field(0x12, span(s)) for s in spans])
    return _field(0x0A, resource + _field(0x12, scope_spans))
