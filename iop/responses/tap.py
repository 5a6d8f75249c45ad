"""The send of a Responses answer whose state the edge holds: the response object it relays says
`store` and `previous_response_id` as the edge applied them, and the final one is kept before its
last bytes leave, so the client's next turn (on any edge) finds it."""

from __future__ import annotations

import re
from typing import Any

import msgspec
from starlette.types import Message, Send

from iop.responses.expand import Responses, Turn
from iop.responses.live import Recording

_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode
_FRAME_ENDS = (b"\r\n\r\n", b"\n\n", b"\r\r")
_FRAME_END = re.compile(b"|".join(re.escape(e) for e in _FRAME_ENDS))
_RESPONSE_KEY = b'"response":'
"""In the lifecycle events only (a key; inside a JSON string its quotes would be escaped)."""
_LIFECYCLE = frozenset(
    {
        "response.created",
        "response.queued",
        "response.in_progress",
        "response.completed",
        "response.incomplete",
        "response.failed",
    }
)
_FINAL = frozenset({"response.completed", "response.incomplete", "response.failed"})


class KeepingSend:
    """Wraps the ASGI send of one answered Responses request (200 answers only; errors pass as they are)."""

    def __init__(
        self, send: Send, responses: Responses, owner: str, turn: Turn, stream: bool, recording: Recording | None = None
    ) -> None:
        self.send = send
        self.recording = recording
        """A background response's recording: it keeps the final event before the answer is kept."""
        self.responses = responses
        self.owner = owner
        self.turn = turn
        self.stream = stream
        self.ok = False
        self.pending = b""
        self.kept = False
        self.start: Message | None = None

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.ok = message["status"] == 200
            if self.ok and not self.stream:
                # Held for the body, which leaves after the keep's write: head and body in one write.
                self.start = message
                return
            await self.send(message)
            return
        if not self.ok or message["type"] != "http.response.body":
            await self.send(message)
            return
        data = self.pending + message.get("body", b"")
        more = bool(message.get("more_body", False))
        if not self.stream:
            # A whole answer may arrive in several sends: it is one JSON object.
            self.pending = data if more else b""
            if not more:
                body = await self._whole(data)
                if self.start is not None:
                    start, self.start = self.start, None
                    await self.send(start)
                await self.send({"type": "http.response.body", "body": body})
            return
        frames, self.pending = _split(data) if more else (data, b"")
        out = await self._frames(frames)
        if out or not more:
            await self.send({"type": "http.response.body", "body": out, "more_body": more})

    def _patch(self, response: dict[str, Any]) -> None:
        response["store"] = self.turn.store
        response["previous_response_id"] = self.turn.previous
        response["background"] = self.turn.background
        own = self.turn.response_id or self.turn.own_id
        if own is not None:
            response["id"] = own

    async def _whole(self, data: bytes) -> bytes:
        try:
            response = _decode(data)
        except msgspec.DecodeError:
            return data
        if not isinstance(response, dict) or response.get("object") != "response":
            return data
        self._patch(response)
        await self._keep(response)
        return _encode(response)

    async def _frames(self, data: bytes) -> bytes:
        """`data` (whole frames) as the client gets it: only the lifecycle events that carry the
        response object are decoded and patched; the deltas and item events between them pass as
        slices of `data`, never split into frames."""
        at = data.find(_RESPONSE_KEY)
        if at < 0:
            if self.recording is not None:
                await self.recording.feed(data)
            return data  # deltas and item events: nothing to change, nothing decoded
        out: list[bytes] = []
        pos = 0
        while at >= 0:
            start = _frame_start(data, pos, at)
            found = _FRAME_END.search(data, at)
            end = found.end() if found is not None else len(data)
            await self._passing(out, data[pos:start])
            if out and _is_final(data[start:at]):
                # The events before the final one leave now, not after the keep's write to the store.
                await self.send({"type": "http.response.body", "body": b"".join(out), "more_body": True})
                out.clear()
            frame = await self._frame(data[start:end])
            await self._passing(out, frame)  # (a final frame was recorded in `_frame`)
            pos = end
            at = data.find(_RESPONSE_KEY, pos)
        await self._passing(out, data[pos:])
        return b"".join(out)

    async def _passing(self, out: list[bytes], data: bytes) -> None:
        if data:
            if self.recording is not None and not self.recording.ended:
                await self.recording.feed(data)
            out.append(data)

    async def _frame(self, frame: bytes) -> bytes:
        if _RESPONSE_KEY not in frame:
            return frame
        lines = frame.splitlines()
        payload = b"\n".join(line[5:].lstrip(b" ") for line in lines if line.startswith(b"data:"))
        try:
            event = _decode(payload)
        except msgspec.DecodeError:
            return frame
        kind = event.get("type") if isinstance(event, dict) else None
        if not isinstance(kind, str) or kind not in _LIFECYCLE or not isinstance(event.get("response"), dict):
            return frame
        self._patch(event["response"])
        if kind in _FINAL:
            out = b"event: " + str(kind).encode() + b"\ndata: " + _encode(event) + b"\n\n"
            if self.recording is not None:
                await self.recording.feed(out)  # recorded and kept before the answer is
            await self._keep(event["response"])
            if self.recording is not None:
                await self.recording.release()  # followers hear the end once the answer is kept
            return out
        return b"event: " + str(kind).encode() + b"\ndata: " + _encode(event) + b"\n\n"

    async def _keep(self, response: dict[str, Any]) -> None:
        if not self.kept:
            self.kept = True
            await self.responses.keep(self.owner, self.turn, response)


def _is_final(head: bytes) -> bool:
    """Whether a frame whose bytes before its `"response":` key are `head` may be a final event (its
    type named before that key, as upstreams send it; a wrong guess costs one more send, nothing else)."""
    return b"response.completed" in head or b"response.incomplete" in head or b"response.failed" in head


def _split(data: bytes) -> tuple[bytes, bytes]:
    """`data` as its whole SSE frames and the start of the next one."""
    cut = _frame_start(data, 0, len(data))
    return data[:cut], data[cut:]


def _frame_start(data: bytes, lo: int, hi: int) -> int:
    """Where the frame holding `data[hi]` starts: just past the last frame end in `data[lo:hi]`, or `lo`.

    Searched from the end, not matched from `lo`: in a run of three or more line breaks the two
    may part the blank lines differently, which SSE reads the same (a blank line ends no event)."""
    cut = lo
    for end in _FRAME_ENDS:
        i = data.rfind(end, lo, hi)
        if i >= 0 and i + len(end) > cut:
            cut = i + len(end)
    return cut
