"""A small WebSocket client for the tests, on wsproto (the library the edge serves WebSockets with)."""

from __future__ import annotations

import asyncio
import json
from typing import Any
from urllib.parse import urlsplit

from wsproto import ConnectionType, WSConnection
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Event,
    Ping,
    RejectConnection,
    RejectData,
    Request,
    TextMessage,
)
from wsproto.utilities import LocalProtocolError


class Refused(Exception):
    """The server answered the handshake with HTTP instead of a socket."""

    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        super().__init__(status)
        self.status = status
        self.headers = headers
        self.body = body

    def json(self) -> Any:
        return json.loads(self.body)


class Closed(Exception):
    """The server closed the socket."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(code, reason)
        self.code = code
        self.reason = reason


class WsClient:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, conn: WSConnection) -> None:
        self.reader = reader
        self.writer = writer
        self.conn = conn
        self.pending: list[Event] = []
        self.text: list[str] = []

    @classmethod
    async def connect(
        cls, base_url: str, path: str = "/v1/responses", headers: dict[str, str] | None = None
    ) -> WsClient:
        """Open a socket; Refused when the server answers with HTTP."""
        where = urlsplit(base_url)
        reader, writer = await asyncio.open_connection(where.hostname, where.port)
        conn = WSConnection(ConnectionType.CLIENT)
        extra = [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
        writer.write(conn.send(Request(host=where.netloc, target=path, extra_headers=extra)))
        client = cls(reader, writer, conn)
        status = 0
        got: dict[str, str] = {}
        body = b""
        while True:
            event = await client._next_event()
            if isinstance(event, AcceptConnection):
                return client
            if isinstance(event, RejectConnection):
                status = event.status_code
                got = {k.decode().lower(): v.decode() for k, v in event.headers}
                if not event.has_body:
                    break
            elif isinstance(event, RejectData):
                body += event.data
                if event.body_finished:
                    break
        writer.close()
        raise Refused(status, got, body)

    async def _next_event(self, timeout_s: float = 30.0) -> Event:
        async with asyncio.timeout(timeout_s):
            while not self.pending:
                data = await self.reader.read(65536)
                self.conn.receive_data(data or None)
                self.pending.extend(self.conn.events())
                if not data and not self.pending:
                    raise Closed(1006, "connection lost")
        return self.pending.pop(0)

    async def send_json(self, value: Any) -> None:
        await self.send_text(json.dumps(value))

    async def send_text(self, text: str) -> None:
        self.writer.write(self.conn.send(TextMessage(data=text)))
        await self.writer.drain()

    async def recv_json(self, timeout_s: float = 30.0) -> dict[str, Any]:
        while True:
            event = await self._next_event(timeout_s)
            if isinstance(event, TextMessage):
                self.text.append(event.data)
                if event.message_finished:
                    text, self.text = "".join(self.text), []
                    value: dict[str, Any] = json.loads(text)
                    return value
            elif isinstance(event, BytesMessage):
                raise AssertionError("the server sent a binary frame")
            elif isinstance(event, Ping):
                self.writer.write(self.conn.send(event.response()))
            elif isinstance(event, CloseConnection):
                raise Closed(event.code, event.reason or "")

    async def until(self, *types: str, timeout_s: float = 30.0) -> list[dict[str, Any]]:
        """Every event up to and including the first of one of `types`."""
        events = []
        while True:
            event = await self.recv_json(timeout_s)
            events.append(event)
            if event.get("type") in types:
                return events

    async def close(self) -> None:
        if self.writer.is_closing():
            return
        try:
            self.writer.write(self.conn.send(CloseConnection(code=1000)))
            await self.writer.drain()
        except (ConnectionError, LocalProtocolError):
            pass  # the server closed it first
        self.writer.close()
