"""Token usage of a native chat stream, asked of the upstream even when the client did not ask.

A chat server sends the usage of a stream only under `stream_options.include_usage`, as one
extra chunk with empty `choices` before `[DONE]`. iop needs the counts (the ledger, the node's
report), so it always asks; a client that did not ask must not see the extra chunk, so
`UsageChunkFilter` takes it out again. Everything else passes through byte for byte.
"""

from __future__ import annotations

import re
from typing import Any

_EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")
_NO_CHOICES = re.compile(rb'"choices"\s*:\s*\[\s*\]')


def ask_for_usage(payload: dict[str, Any]) -> bool:
    """Make a streamed chat request ask for usage (in place); True when the client had not asked."""
    options = payload.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage"):
        return False
    payload["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
    return True


DONE = b"data: [DONE]\n\n"


class UsageChunkFilter:
    """Chat SSE bytes in, the same bytes out without the usage-only chunk (split anywhere).

    The usage chunk is the last before `[DONE]`, so the client's `[DONE]` goes out in its place at
    once: waiting for the upstream's own would hold the client's end one upstream write longer
    than a client that asked for nothing sees direct. What the upstream sends after it is dropped.
    """

    def __init__(self) -> None:
        self._held = b""
        self.ended = False
        """The usage chunk arrived and the client has its [DONE]."""

    def feed(self, data: bytes) -> bytes:
        if self.ended:
            return b""
        buffer = self._held + data if self._held else data
        out: list[bytes] = []
        start = 0
        for end in _EVENT_END.finditer(buffer):
            event = buffer[start : end.end()]
            start = end.end()
            # The usage chunk: `usage` and no choices. Only such events are looked at twice.
            if b'"usage"' in event and _NO_CHOICES.search(event):
                out.append(DONE)
                self.ended = True
                break
            out.append(event)
        self._held = b"" if self.ended else buffer[start:]
        return b"".join(out)

    def close(self) -> bytes:
        """What is left when the stream ends: a last event without its blank line."""
        held, self._held = self._held, b""
        return held
