"""The edge's WebSocket connections (WebSocket mode of `/v1/responses`): uvicorn's wsproto protocol,
counted in the HTTP connection limits, framing the messages it sends itself and writing the frames
of one turn of the event loop together."""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.utils import ClientDisconnected
from uvicorn.protocols.websockets.wsproto_impl import WSProtocol
from wsproto.connection import ConnectionState

from iop.edge.http import HttpLimits

TEXTS = "iop.texts"
"""A `websocket.send` may carry a list of texts under this key, each its own frame, written at once;
the connection's scope names it among its `extensions` (iop/edge/websocket.py sends an answer's
events so)."""


def ws_frame(opcode: int, payload: bytes) -> bytes:
    """One unfragmented, unmasked WebSocket frame (RFC 6455 section 5.2): a server's frame."""
    n = len(payload)
    if n < 126:
        head = bytes((0x80 | opcode, n))
    elif n < 65536:
        head = bytes((0x80 | opcode, 126)) + n.to_bytes(2, "big")
    else:
        head = bytes((0x80 | opcode, 127)) + n.to_bytes(8, "big")
    return head + payload


class TurnWrites:
    """A connection's transport whose writes within one turn of the event loop leave together.

    A WebSocket answer is one frame per event, and the events of one reply from the node arrive
    together: uvicorn writes each frame at once, a system call (and a wake-up of the client) per
    event. Here they are joined and written when the turn's callbacks have run.
    """

    __slots__ = ("_parts", "_transport")

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._parts: list[bytes | bytearray | memoryview] = []

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not self._parts:
            asyncio.get_running_loop().call_soon(self._flush)
        self._parts.append(data)

    def _flush(self) -> None:
        parts, self._parts = self._parts, []
        if parts and not self._transport.is_closing():
            self._transport.write(parts[0] if len(parts) == 1 else b"".join(parts))

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(len(p) for p in self._parts)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


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

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(TurnWrites(transport))  # type: ignore[arg-type]

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
            frame = b"".join(ws_frame(0x1, text.encode()) for text in texts)
        elif (text := message.get("text")) is not None:
            frame = ws_frame(0x1, text.encode())
        else:
            frame = ws_frame(0x2, bytes(message.get("bytes") or b""))
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
