"""A lean asyncio HTTP/1.1 client for upstream calls: keep-alive pool, streamed bodies, flow control."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Mapping
from typing import NoReturn, cast
from urllib.parse import urlsplit

import httptools

MAX_HEAD = 64 * 1024
"""A response head, its trailers, or chunk framing between two body bytes larger than this is a ProtocolError."""
HIGH_WATER = 256 * 1024
"""Reading the socket pauses once this many body bytes wait for the consumer."""
MAX_BUFFERED = HIGH_WATER + 256 * 1024
"""Bound on bytes buffered per response: the high-water mark plus one socket read (asyncio reads ≤ 256 KiB)."""

_IDLE, _HEAD, _BODY, _DONE = range(4)
JOIN_BELOW = 64 * 1024
"""Bodies smaller than this are sent in one buffer with the head (one copy is cheaper than a writev)."""
_RESERVED = {"host", "content-length", "transfer-encoding"}


class HttpError(Exception):
    """Base of this module's errors (ConnectFailed, Timeout, ProtocolError); the message says what happened."""


class ConnectFailed(HttpError):
    """DNS, refused or TLS handshake failed: nothing was sent."""


class Timeout(HttpError):
    """Connect timed out, or no response byte for read_timeout_s."""


class ProtocolError(HttpError):
    """Malformed response, or the connection closed mid-response."""


class _PastTheEnd(Exception):
    """Raised in the parser's callback when bytes follow the complete response: parsing stops there."""


class _Conn(asyncio.Protocol):
    """One connection: parses the response as bytes arrive and hands body pieces to one consumer.

    httptools (llhttp, uvicorn's parser) does the framing: status line, headers, content-length,
    chunked coding with extensions and trailers, interim 1xx answers. This class keeps what llhttp
    leaves to its caller: bounds on what a response may make us hold, the end of a body that runs
    until the connection closes, and flow control towards the consumer.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, read_timeout_s: float) -> None:
        self.loop = loop
        self.read_timeout_s = read_timeout_s
        self.transport: asyncio.Transport | None = None
        self.lost: asyncio.Future[None] = loop.create_future()
        self.closed = False
        self.state = _IDLE
        self.received = False  # any byte of the current response: from then on a retry is unsafe
        self.keep_alive = False
        self.status = 0
        self.headers: dict[str, str] = {}
        self.pieces: list[bytes] = []
        self.buffered = 0
        self.paused = False
        self.exc: HttpError | None = None
        # One parser for the connection's life: llhttp starts the next response where one ends.
        self._parser = httptools.HttpResponseParser(self)
        # A bare LF ending a head line: RFC 9112 §2.2 lets a recipient accept it, and iop always has.
        self._parser.set_dangerous_leniencies(lenient_optional_cr_before_lf=True)
        self._until_close = False  # the body ends when the server closes the connection
        self._field_bytes = 0  # header (then trailer) names and values of the current response
        self._quiet = 0  # bytes received since the last body byte: head, chunk framing, trailers
        self._stop: ProtocolError | None = None  # raised by a parser callback
        self._waiter: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._last = 0.0  # loop time of the last byte or of the start of the current wait

    # --- the consumer's side

    def send(self, request: list[bytes | memoryview]) -> None:
        if self.closed:
            raise ProtocolError("connection closed before the request was sent")
        self.state, self.received, self.exc, self._quiet = _HEAD, False, None, 0
        self.pieces, self.buffered = [], 0
        transport = cast(asyncio.Transport, self.transport)
        if self.paused:  # the last body arrived whole but unread: reading was left paused
            self.paused = False
            transport.resume_reading()
        if len(request) == 1:
            transport.write(request[0])
        else:
            transport.writelines(request)

    def wait(self) -> asyncio.Future[None]:
        fut = self._waiter = self.loop.create_future()
        self._last = self.loop.time()
        # One timer per connection, pushed back lazily: re-arming a timer on every piece would cost
        # a TimerHandle per read; this costs one per read_timeout_s of silence at most.
        if self._timer is None:
            self._timer = self.loop.call_at(self._last + self.read_timeout_s, self._on_timer)
        return fut

    async def next_piece(self) -> bytes:
        """Everything buffered as one piece; b"" once the body is complete."""
        while True:
            if self.pieces:
                pieces = self.pieces
                self.pieces, self.buffered = [], 0
                if self.paused:
                    self.paused = False
                    cast(asyncio.Transport, self.transport).resume_reading()
                return pieces[0] if len(pieces) == 1 else b"".join(pieces)
            if self.state == _DONE:
                return b""
            if self.exc is not None:
                raise self.exc
            await self.wait()

    def close(self) -> None:
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.transport is not None:
            # Mid-response there is nothing worth flushing: drop the connection at once.
            if self.state in (_HEAD, _BODY):
                self.transport.abort()
            else:
                self.transport.close()

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, exc: HttpError) -> None:
        if self.exc is None:
            self.exc = exc
        self._wake()

    def _on_timer(self) -> None:
        self._timer = None
        if self._waiter is None or self._waiter.done():
            return  # nobody waits: the next wait() arms a new timer
        due = self._last + self.read_timeout_s
        if self.loop.time() < due:
            self._timer = self.loop.call_at(due, self._on_timer)
        else:
            self._fail(Timeout(f"no response bytes for {self.read_timeout_s:g} s"))

    # --- the transport's side

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self._last = self.loop.time()
        if self.state != _HEAD and self.state != _BODY:
            # Bytes nobody asked for: this connection's framing can no longer be trusted.
            self.keep_alive = False
            if self.state == _IDLE:
                self.close()
            return
        self.received = True
        self._quiet += len(data)
        try:
            self._parser.feed_data(data)
            if self._quiet > MAX_HEAD:  # llhttp buffers nothing, but httptools joins a field's pieces
                where = "response head" if self.state == _HEAD else "chunk framing or trailers"
                raise ProtocolError(f"{where} larger than {MAX_HEAD} bytes")
        except httptools.HttpParserCallbackError as exc:
            stop, self._stop = self._stop, None
            if stop is not None:
                self._fail(stop)
                self.close()
            elif not isinstance(exc.__context__, _PastTheEnd):
                raise  # a bug in a callback below
        except httptools.HttpParserError as exc:
            self._fail(_malformed(exc, self.state == _HEAD))
            self.close()
        except ProtocolError as exc:
            self._fail(exc)
            self.close()
        if self.state != _HEAD:
            self._wake()

    def eof_received(self) -> bool:
        self._ended(None)
        return False  # the transport closes: a server that sent EOF takes no more requests

    def connection_lost(self, exc: Exception | None) -> None:
        self._ended(exc)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self.lost.done():
            self.lost.set_result(None)

    def _ended(self, exc: Exception | None) -> None:
        self.closed = True
        why = f": {exc}" if exc is not None else ""
        if self.state == _HEAD:
            self._fail(ProtocolError(f"connection closed before the response head{why}"))
        elif self.state == _BODY:
            if self._until_close and exc is None:
                self.state = _DONE
                self._wake()
            else:
                self._fail(ProtocolError(f"connection closed mid-body{why}"))

    # --- the parser's callbacks (httptools calls them by name)

    def _abort(self, message: str) -> NoReturn:
        self._stop = ProtocolError(message)
        raise self._stop

    def on_message_begin(self) -> None:
        if self.state == _DONE:
            self.keep_alive = False  # bytes past the body: the framing is off
            raise _PastTheEnd
        self.headers, self._field_bytes = {}, 0  # anew after an interim 1xx

    def on_header(self, name: bytes, value: bytes) -> None:
        self._field_bytes += len(name) + len(value)
        if self._field_bytes > MAX_HEAD:
            self._abort(f"{'response head' if self.state == _HEAD else 'trailers'} larger than {MAX_HEAD} bytes")
        if self.state != _HEAD:
            return  # a trailer: nothing iop reads comes in one
        key, text = name.decode("latin-1").lower(), value.decode("latin-1").rstrip(" \t")
        headers = self.headers
        headers[key] = headers[key] + ", " + text if key in headers else text

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if status < 200:
            if status == 101:
                self._abort("unexpected 101 Switching Protocols: iop never asks to upgrade")
            return  # an interim answer (100 Continue, 103 Early Hints): the real one follows
        self.status, self.state = status, _BODY
        self.keep_alive = self._parser.should_keep_alive()  # version, Connection, framing
        # RFC 9112 §6.3: no length, or a transfer coding that does not end in chunked: read until close.
        coding = self.headers.get("transfer-encoding")
        if coding is None:
            self._until_close = "content-length" not in self.headers
        else:
            self._until_close = not coding.lower().endswith("chunked")

    def on_body(self, piece: bytes) -> None:
        self._quiet = 0
        self._push(piece)

    def on_message_complete(self) -> None:
        if self.state == _BODY:
            self.state = _DONE

    def _push(self, piece: bytes) -> None:
        self.pieces.append(piece)
        self.buffered += len(piece)
        if self.buffered > HIGH_WATER and not self.paused:
            self.paused = True
            cast(asyncio.Transport, self.transport).pause_reading()


class HttpResponse:
    """Status and headers of an answer; the body is read or iterated, then aclose() must be called."""

    __slots__ = ("_conn", "_pool", "headers", "status")

    def __init__(self, pool: HttpPool, conn: _Conn) -> None:
        self._pool = pool
        self._conn: _Conn | None = conn
        self.status = conn.status
        self.headers = conn.headers
        """Lower-case names; repeated headers joined with ", "."""

    def _live(self) -> _Conn:
        if self._conn is None:
            raise HttpError("response already closed")
        return self._conn

    async def read(self) -> bytes:
        conn = self._live()
        pieces = []
        while piece := await conn.next_piece():
            pieces.append(piece)
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    def iter_body(self) -> AsyncIterator[bytes]:
        """Body pieces as they arrive, de-chunked: whatever is buffered when the consumer asks."""
        return _BodyIterator(self._live())

    async def aclose(self) -> None:
        """Return the connection to the pool if the whole body arrived and the server keeps it alive;
        close it otherwise (unread bytes, errors, cancellation). Idempotent."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if conn.state == _DONE and conn.keep_alive and not conn.closed and conn.exc is None:
            self._pool._release(conn)
        else:
            conn.close()


class _BodyIterator(AsyncIterator[bytes]):
    # A class rather than an async generator: an abandoned generator is finalised later by the
    # loop (a task and possibly a warning); this holds nothing that needs finalising.
    __slots__ = ("_conn",)

    def __init__(self, conn: _Conn) -> None:
        self._conn = conn

    async def __anext__(self) -> bytes:
        piece = await self._conn.next_piece()
        if not piece:
            raise StopAsyncIteration
        return piece


class HttpPool:
    """Keep-alive connections to one origin (scheme://host:port), reused LIFO; no limit on how many.

    Sends Host, Content-Length, Connection: keep-alive and Accept-Encoding: identity besides the
    pool's and the request's headers (the request's win; Host/Content-Length/Transfer-Encoding
    given by the caller are ignored). https uses `ssl_context`, or a default context made once.
    """

    def __init__(
        self,
        base_url: str,
        *,
        headers: Mapping[str, str] | None = None,
        connect_timeout_s: float = 10.0,
        read_timeout_s: float = 600.0,
        ssl_context: ssl.SSLContext | None = None,
        max_idle: int = 256,
    ) -> None:
        url = urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        default_port = 443 if url.scheme == "https" else 80
        self.host = url.hostname
        self.port = url.port or default_port
        self.origin = f"{url.scheme}://{url.netloc.rpartition('@')[2]}"
        self.ssl: ssl.SSLContext | None = None
        if url.scheme == "https":
            self.ssl = ssl_context or ssl.create_default_context()
        host = f"[{self.host}]" if ":" in self.host else self.host
        fixed = {
            "host": host if self.port == default_port else f"{host}:{self.port}",
            "connection": "keep-alive",
            "accept-encoding": "identity",
        }
        self._headers = fixed | {k.lower(): v for k, v in (headers or {}).items() if k.lower() not in _RESERVED}
        self._head = _encode_headers(self._headers)
        self._prefix = url.path.rstrip("/")
        self._connect_timeout_s = connect_timeout_s
        self._read_timeout_s = read_timeout_s
        self._max_idle = max_idle
        self._idle: list[_Conn] = []
        self._conns: set[_Conn] = set()
        self._closed = False

    async def post(
        self, path: str, body: bytes | list[bytes | memoryview], headers: Mapping[str, str] | None = None
    ) -> HttpResponse:
        """POST `body` (or the concatenation of its pieces) to base_url's path + `path`; returns
        once the response head arrived."""
        head = self._head
        if headers:
            extra = {k.lower(): v for k, v in headers.items() if k.lower() not in _RESERVED}
            head = _encode_headers(self._headers | extra)
        target = (self._prefix + path).encode("ascii")
        pieces = body if isinstance(body, list) else [body]
        size = sum(len(p) for p in pieces)
        start = b"POST %s HTTP/1.1\r\n%scontent-length: %d\r\n\r\n" % (target, head, size)
        # A large body is written from its own bytes (one writev with the head), not copied behind it.
        request: list[bytes | memoryview] = [start, *pieces] if size >= JOIN_BELOW else [b"".join((start, *pieces))]
        while self._idle:
            conn = self._idle.pop()
            if conn.closed:
                continue  # the server closed it while idle
            try:
                return await self._exchange(conn, request)
            except ProtocolError:
                if conn.received:
                    raise
            # Closed before any byte of an answer: the server dropped this idle connection as the
            # request crossed it and never ran the request, so sending it once more is safe.
            break
        return await self._exchange(await self._connect(), request)

    async def _exchange(self, conn: _Conn, request: list[bytes | memoryview]) -> HttpResponse:
        try:
            conn.send(request)
            while conn.state == _HEAD:
                if conn.exc is not None:
                    raise conn.exc
                await conn.wait()
        except BaseException:
            conn.close()
            raise
        return HttpResponse(self, conn)

    async def _connect(self) -> _Conn:
        if self._closed:
            raise HttpError("pool is closed")
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                _, conn = await loop.create_connection(
                    lambda: _Conn(loop, self._read_timeout_s),
                    self.host,
                    self.port,
                    ssl=self.ssl,
                    server_hostname=self.host if self.ssl is not None else None,
                )
        except TimeoutError as exc:  # before OSError: TimeoutError is one
            raise Timeout(f"connect to {self.origin} timed out after {self._connect_timeout_s:g} s") from exc
        except OSError as exc:  # refused, DNS (gaierror), TLS (ssl.SSLError)
            raise ConnectFailed(f"cannot connect to {self.origin}: {exc}") from exc
        self._conns.add(conn)
        conn.lost.add_done_callback(lambda _: self._conns.discard(conn))
        return conn

    def _release(self, conn: _Conn) -> None:
        conn.state = _IDLE
        if self._closed or len(self._idle) >= self._max_idle:
            conn.close()
        else:
            self._idle.append(conn)

    async def close(self) -> None:
        """Close every connection, in use or idle, and wait (briefly) until they are closed."""
        self._closed = True
        self._idle.clear()
        conns = list(self._conns)
        for conn in conns:
            conn.close()
        if conns:
            await asyncio.wait([conn.lost for conn in conns], timeout=2.0)
            for conn in conns:
                if not conn.lost.done() and conn.transport is not None:
                    conn.transport.abort()  # a TLS close_notify that never completed


def _encode_headers(headers: Mapping[str, str]) -> bytes:
    text = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    # Each line brings exactly one CR and one LF; any more would let a value inject headers.
    if text.count("\r") != len(headers) or text.count("\n") != len(headers):
        raise ValueError("header names and values must not contain CR or LF")
    return text.encode("latin-1")


def _malformed(exc: httptools.HttpParserError, in_head: bool) -> ProtocolError:
    """llhttp's reason, prefixed with the part of the response it is about."""
    reason = str(exc)
    if isinstance(exc, httptools.HttpParserInvalidStatusError) or any(
        word in reason for word in ("HTTP/", "version", "dot", "status", "response line")
    ):
        what = "malformed status line"
    elif "Content-Length" in reason:
        what = "malformed content-length"
    elif "Transfer-Encoding" in reason:
        what = "malformed transfer-encoding"
    elif "chunk size" in reason:
        what = "malformed chunk size"
    elif "after chunk data" in reason:
        what = "chunk data not followed by CRLF"
    else:
        what = "malformed header line" if in_head else "malformed body"
    return ProtocolError(f"{what}: {reason}")
