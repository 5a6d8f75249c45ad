"""The edge's WebSocket connections (WebSocket mode of `/v1/responses`): uvicorn's wsproto protocol,
counted in the HTTP connection limits, framing the messages it sends itself."""

from __future__ import annotations

import asyncio
import struct
from typing import Any

from uvicorn.protocols.utils import ClientDisconnected
from uvicorn.protocols.websockets.wsproto_impl import WSProtocol
from wsproto.connection import ConnectionState

from iop.edge.http import HttpLimits

TEXTS = "iop.texts"
"""A `websocket.send` may carry a list of texts under this key, UTF-8 bytes, each its own frame,
written at once; the connection's scope names it among its `extensions` (iop/edge/websocket.py
sends the events of each piece of an answer so)."""


def frame_head(opcode: int, n: int) -> bytes:
    """The header of one unfragmented, unmasked WebSocket frame of `n` bytes (RFC 6455 section 5.2)."""
    if n < 126:
        return bytes((0x80 | opcode, n))
    if n < 65536:
        return bytes((0x80 | opcode, 126)) + n.to_bytes(2, "big")
    return bytes((0x80 | opcode, 127)) + n.to_bytes(8, "big")


_TEXT_HEADS = [frame_head(0x1, n) for n in range(126)]
_TEXT_HEAD_16 = struct.Struct(">BBH").pack


def text_frames(texts: list[bytes]) -> bytes:
    """Server text frames of `texts`, one each, as one piece."""
    parts: list[bytes] = []
    for text in texts:
        n = len(text)
        parts.append(_TEXT_HEADS[n] if n < 126 else _TEXT_HEAD_16(0x81, 126, n) if n < 65536 else frame_head(0x1, n))
        parts.append(text)
    return b"".join(parts)


def ws_protocol_class(limits: HttpLimits) -> type[asyncio.Protocol]:
    """The WebSocket protocol a connection upgrades to, for `uvicorn.Config(ws=...)`, bound to `limits`."""

    class Bound(LimitedWebSocketProtocol):
        pass

    Bound.limits = limits
    return Bound


class LimitedWebSocketProtocol(WSProtocol):
    """uvicorn's wsproto protocol, counted in `limits` like the HTTP connection it was upgraded from.

    The upgrade hands the transport over, so the HTTP protocol never hears the connection close:
    this one counts it instead (the connection cap itself counts both kinds, in uvicorn's set).
    """

    limits: HttpLimits = HttpLimits()

    async def send(self, message: Any) -> None:
        """A text or binary message of an open connection framed here: one header and the payload,
        as wsproto would frame it (the edge negotiates no extension: `ws_per_message_deflate` is
        off), without its per-message objects. Everything else goes through uvicorn as before."""
        kind = message["type"]
        if kind != "websocket.send" or not self.handshake_complete or self.close_sent or self.response_started:
            await super().send(message)
            return
        await self.writable.wait()
        if self.disconnected or self.conn.state is not ConnectionState.OPEN:
            if TEXTS in message:
                raise ClientDisconnected
            await super().send(message)  # uvicorn's own answer to a send on a closing connection
            return
        texts = message.get(TEXTS)
        if texts is not None:
            frame = text_frames(texts)
        elif (text := message.get("text")) is not None:
            frame = text_frames([text.encode()])
        else:
            payload = bytes(message.get("bytes") or b"")
            frame = frame_head(0x2, len(payload)) + payload
        if not self.transport.is_closing():
            self.transport.write(frame)

    def handle_connect(self, event: Any) -> None:
        super().handle_connect(event)
        # Read by the application when it runs (the task starts on the loop's next turn).
        self.scope["extensions"][TEXTS] = {}

    def connection_lost(self, exc: Exception | None) -> None:
        self.limits.open -= 1
        self.limits.closed.set()
        super().connection_lost(exc)
