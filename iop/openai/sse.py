"""Server-sent events decoded from bytes as they arrive from an upstream."""

from __future__ import annotations

import re

import msgspec

_LINE_END = re.compile(rb"\r\n|\r|\n")


class SseEvent(msgspec.Struct, frozen=True):
    event: str | None
    data: bytes


class SseDecoder:
    """Server-sent events out of bytes split anywhere (mid-line, mid-character, between CR and LF)."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._cr_ended = False
        self._event: str | None = None
        self._data: list[bytes] = []

    def feed(self, data: bytes) -> list[SseEvent]:
        if self._cr_ended and data[:1] == b"\n":
            data = data[1:]  # the LF of a CRLF whose CR ended the previous piece
        if data:
            self._cr_ended = False
        if b"\r" not in data:
            return self._feed_lf(data)
        scanned = len(self._buffer)  # what is buffered holds no line end
        self._buffer += data
        events: list[SseEvent] = []
        start = 0
        for end in _LINE_END.finditer(self._buffer, scanned):
            self._line(bytes(self._buffer[start : end.start()]), events)
            start = end.end()
            self._cr_ended = end.group() == b"\r" and start == len(self._buffer)
        del self._buffer[:start]
        return events

    def _feed_lf(self, data: bytes) -> list[SseEvent]:
        """`feed` of a piece with no CR (the buffer never holds a line end): lines split by LF,
        a stream's own `data: ` lines taken without the general parse."""
        if b"\n" not in data:
            self._buffer += data
            return []
        lines = (bytes(self._buffer) + data if self._buffer else data).split(b"\n")
        self._buffer = bytearray(lines.pop())
        events: list[SseEvent] = []
        for line in lines:
            if line[:6] == b"data: ":
                self._data.append(line[6:])
            else:
                self._line(line, events)
        return events

    def finish(self) -> list[SseEvent]:
        """What the stream's end completes: a last line or event missing its terminator is still read."""
        events: list[SseEvent] = []
        if self._buffer:
            self._line(bytes(self._buffer), events)
            self._buffer.clear()
        self._line(b"", events)
        return events

    def _line(self, line: bytes, events: list[SseEvent]) -> None:
        if not line:
            if self._data:
                events.append(SseEvent(self._event, b"\n".join(self._data)))
            self._event, self._data = None, []
            return
        if line[:1] == b":":
            return  # a comment (keep-alive)
        name, _, value = line.partition(b":")
        if value[:1] == b" ":
            value = value[1:]
        if name == b"data":
            self._data.append(value)
        elif name == b"event":
            self._event = value.decode(errors="replace")
