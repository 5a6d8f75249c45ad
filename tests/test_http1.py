"""iop.node.http1 against real servers on loopback: uvicorn for the normal paths, raw sockets for the odd ones."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import re
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from iop.node import http1
from iop.node.http1 import ConnectFailed, HttpPool, ProtocolError, Timeout
from tests.fakes import serve_asgi


@dataclass
class RawServer:
    url: str = ""
    connections: int = 0
    requests: list[bytes] = field(default_factory=list)


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, RawServer], Awaitable[None]]


@asynccontextmanager
async def raw_server(handler: Handler, ssl_context: ssl.SSLContext | None = None) -> AsyncIterator[RawServer]:
    """A socket server whose handler writes exact bytes; counts connections, ends its handlers on exit."""
    srv = RawServer()
    tasks: set[asyncio.Task[Any]] = set()

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        tasks.add(task)
        srv.connections += 1
        try:
            await handler(reader, writer, srv)
        except ConnectionError:
            pass  # the client hung up, as some tests make it do
        except asyncio.CancelledError:
            return  # only the teardown below cancels (a stuck handler); 3.11 would log it as an error
        finally:
            writer.close()
            tasks.discard(task)

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0, ssl=ssl_context)
    port = server.sockets[0].getsockname()[1]
    srv.url = f"{'https' if ssl_context else 'http'}://127.0.0.1:{port}/v1"
    try:
        yield srv
    finally:
        server.close()
        if tasks:  # the clients have closed: handlers end by themselves, or are stopped
            await asyncio.wait(list(tasks), timeout=2)
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await server.wait_closed()


async def read_request(reader: asyncio.StreamReader, srv: RawServer) -> bytes | None:
    """One request (head and body), recorded on `srv`; None when the client closed the connection."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    match = re.search(rb"(?i)content-length: (\d+)", head)
    assert match is not None
    request = head + await reader.readexactly(int(match.group(1)))
    srv.requests.append(request)
    return request


async def until_closed(reader: asyncio.StreamReader) -> None:
    with contextlib.suppress(ConnectionError):
        await reader.read()


OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"


def answering(*responses: bytes) -> Handler:
    """A handler answering each request on a connection with the next of `responses` (the last repeats)."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, srv: RawServer) -> None:
        i = 0
        while await read_request(reader, srv) is not None:
            writer.write(responses[min(i, len(responses) - 1)])
            i += 1

    return handler


async def fetch(pool: HttpPool, body: bytes = b"{}") -> tuple[int, bytes]:
    response = await pool.post("/chat/completions", body)
    try:
        return response.status, await response.read()
    finally:
        await response.aclose()


async def test_http1_content_length_body_and_request_headers() -> None:
    seen: list[dict[str, str]] = []

    async def handle(request: Request) -> Response:
        seen.append(dict(request.headers) | {"path": request.url.path, "body": (await request.body()).decode()})
        return JSONResponse({"ok": True}, headers={"x-a": "1"})

    async with serve_asgi(Starlette(routes=[Route("/v1/chat/completions", handle, methods=["POST"])])) as url:
        pool = HttpPool(url + "/v1/", headers={"Authorization": "Bearer k", "content-type": "application/json"})
        try:
            response = await pool.post("/chat/completions", b'{"a": 1}', headers={"X-Request-Id": "r1"})
            assert (response.status, response.headers["x-a"], response.headers["content-length"]) == (200, "1", "11")
            assert await response.read() == b'{"ok":true}'
            await response.aclose()
            await response.aclose()  # idempotent
        finally:
            await pool.close()
    port = url.rsplit(":", 1)[1]
    assert seen == [
        {
            "host": f"127.0.0.1:{port}",
            "connection": "keep-alive",
            "accept-encoding": "identity",
            "authorization": "Bearer k",
            "content-type": "application/json",
            "x-request-id": "r1",
            "content-length": "8",
            "path": "/v1/chat/completions",
            "body": '{"a": 1}',
        }
    ]


async def test_http1_large_body_arrives_whole_behind_its_head_on_a_kept_connection() -> None:
    # Bodies past JOIN_BELOW are written beside the head, not copied behind it: same bytes on the wire.
    big = b'{"x":"' + bytes(range(48, 112)) * (3 * http1.JOIN_BELOW // 64) + b'"}'
    async with raw_server(answering(OK)) as srv:
        pool = HttpPool(srv.url)
        try:
            assert await fetch(pool, big) == (200, b"ok")
            assert await fetch(pool, b"{}") == (200, b"ok")
        finally:
            await pool.close()
    assert srv.connections == 1
    head, _, body = srv.requests[0].partition(b"\r\n\r\n")
    assert body == big and f"content-length: {len(big)}".encode() in head
    assert srv.requests[1].endswith(b"content-length: 2\r\n\r\n{}")


async def test_http1_a_body_in_pieces_arrives_as_their_concatenation() -> None:
    big = bytes(range(48, 112)) * (3 * http1.JOIN_BELOW // 64)
    small: list[bytes | memoryview] = [b'{"a":', memoryview(b"[1, 2]}")[3:]]
    large: list[bytes | memoryview] = [b'{"x":"', memoryview(big)[5:], b'"}']
    async with raw_server(answering(OK)) as srv:
        pool = HttpPool(srv.url)
        try:
            for body in (large, small):
                response = await pool.post("/v1/chat/completions", body)
                assert (response.status, await response.read()) == (200, b"ok")
                await response.aclose()
        finally:
            await pool.close()
    sent = [request.partition(b"\r\n\r\n") for request in srv.requests]
    assert sent[0][2] == b'{"x":"' + big[5:] + b'"}' and f"content-length: {len(big) + 3}".encode() in sent[0][0]
    assert sent[1][2] == b'{"a": 2]}' and b"content-length: 9" in sent[1][0]


async def test_http1_chunked_body_with_extensions_and_trailers_keeps_the_connection() -> None:
    chunked = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5;name=val\r\nhello\r\n6;x\r\n world\r\n0\r\nX-Trailer: yes\r\nX-Other: 2\r\n\r\n"
    )
    async with raw_server(answering(chunked)) as srv:
        pool = HttpPool(srv.url)
        try:
            assert [await fetch(pool) for _ in range(3)] == [(200, b"hello world")] * 3
        finally:
            await pool.close()
    assert (srv.connections, len(srv.requests)) == (1, 3)


@pytest.mark.parametrize(
    "response",
    [
        b"HTTP/1.0 200 OK\r\n\r\nhello",
        b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nhello",
        b"HTTP/1.1 200 OK\r\nConnection: close\r\ncontent-length: 5\r\n\r\nhello",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n\r\nhello",  # a coding not ending in chunked: RFC 9112 §6.3
    ],
)
async def test_http1_read_until_close_and_connection_close_are_not_reused(response: bytes) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, srv: RawServer) -> None:
        await read_request(reader, srv)
        writer.write(response)
        await writer.drain()  # then the wrapper closes: the end of the body

    async with raw_server(handler) as srv:
        pool = HttpPool(srv.url)
        try:
            assert [await fetch(pool), await fetch(pool)] == [(200, b"hello")] * 2
        finally:
            await pool.close()
    assert srv.connections == 2


async def test_http1_sse_stream_arrives_in_pieces() -> None:
    acks = [asyncio.Event() for _ in range(4)]

    async def events() -> AsyncIterator[bytes]:
        for i, ack in enumerate(acks):
            yield f"data: {i}\n\n".encode()
            await ack.wait()  # the client has event i: the next one is a separate read

    async def handle(request: Request) -> Response:
        return StreamingResponse(events(), media_type="text/event-stream")

    async with serve_asgi(Starlette(routes=[Route("/v1/chat/completions", handle, methods=["POST"])])) as url:
        pool = HttpPool(url + "/v1")
        response = await pool.post("/chat/completions", b"{}")
        pieces: list[bytes] = []
        try:
            async with asyncio.timeout(5):
                async for piece in response.iter_body():
                    acks[len(pieces)].set()
                    pieces.append(piece)
        finally:
            await response.aclose()
            await pool.close()
    assert response.headers["transfer-encoding"] == "chunked"
    assert pieces == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n", b"data: 3\n\n"]


async def test_http1_keep_alive_reuses_one_connection() -> None:
    async with raw_server(answering(OK)) as srv:
        pool = HttpPool(srv.url)
        try:
            assert [await fetch(pool) for _ in range(5)] == [(200, b"ok")] * 5
        finally:
            await pool.close()
    assert (srv.connections, len(srv.requests)) == (1, 5)
    assert srv.requests[0].startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")


async def test_http1_idle_connection_closed_by_the_server_is_dropped_before_reuse() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, srv: RawServer) -> None:
        await read_request(reader, srv)
        writer.write(OK)  # keep-alive by default, then closed all the same

    async with raw_server(handler) as srv:
        pool = HttpPool(srv.url)
        try:
            assert await fetch(pool) == (200, b"ok")
            [idle] = pool._idle
            await asyncio.wait_for(idle.lost, 5)  # the server's FIN reached the idle connection
            assert await fetch(pool) == (200, b"ok")
        finally:
            await pool.close()
    assert (srv.connections, len(srv.requests)) == (2, 2)


async def test_http1_reused_connection_closed_before_any_answer_byte_is_retried_once() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, srv: RawServer) -> None:
        await read_request(reader, srv)
        writer.write(OK)
        if srv.connections == 1:
            await read_request(reader, srv)  # the race: the server drops the connection as a request comes
            return
        while await read_request(reader, srv) is not None:
            writer.write(OK)

    async with raw_server(handler) as srv:
        pool = HttpPool(srv.url)
        try:
            assert [await fetch(pool), await fetch(pool)] == [(200, b"ok")] * 2
        finally:
            await pool.close()
    assert (srv.connections, len(srv.requests)) == (2, 3)


async def test_http1_never_retries_once_answer_bytes_arrived() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, srv: RawServer) -> None:
        await read_request(reader, srv)
        writer.write(OK)
        await read_request(reader, srv)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-le")  # then the connection closes mid-head
        await writer.drain()

    async with raw_server(handler) as srv:
        pool = HttpPool(srv.url)
        try:
            assert await fetch(pool) == (200, b"ok")
            with pytest.raises(ProtocolError, match="connection closed before the response head"):
                await fetch(pool)
        finally:
            await pool.close()
    assert (srv.connections, len(srv.requests)) == (1, 2)


async def test_http1_connection_refused_is_connect_failed() -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens on it now
    pool = HttpPool(f"http://127.0.0.1:{port}/v1")
    with pytest.raises(ConnectFailed, match=f"cannot connect to http://127.0.0.1:{port}"):
        await pool.post("/chat/completions", b"{}")
    await pool.close()


async def test_http1_https_context_is_made_once_and_names_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict[str, Any]] = []

    async def create_connection(*args: Any, **kwargs: Any) -> Any:
        calls.append({"args": args[1:], **kwargs})
        raise ssl.SSLError("certificate verify failed")

    monkeypatch.setattr(asyncio.get_running_loop(), "create_connection", create_connection)
    pool = HttpPool("https://upstream.example:8443/v1")
    for _ in range(2):
        with pytest.raises(ConnectFailed, match="certificate verify failed"):
            await pool.post("/chat/completions", b"{}")
    assert isinstance(pool.ssl, ssl.SSLContext)
    assert calls == [{"args": ("upstream.example", 8443), "ssl": pool.ssl, "server_hostname": "upstream.example"}] * 2


async def test_http1_https_with_a_private_ca(pki: Path) -> None:
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(pki / "server.pem", pki / "server.key")
    async with raw_server(answering(OK), ssl_context=server_ctx) as srv:
        pool = HttpPool(srv.url, ssl_context=ssl.create_default_context(cafile=str(pki / "ca.pem")))
        untrusting = HttpPool(srv.url)
        try:
            assert [await fetch(pool), await fetch(pool)] == [(200, b"ok")] * 2
            with pytest.raises(ConnectFailed, match="CERTIFICATE_VERIFY_FAILED"):
                await untrusting.post("/chat/completions", b"{}")
        finally:
            await pool.close()
            await untrusting.close()
    assert len(srv.requests) == 2


async def test_http1_read_timeout_waiting_for_the_head() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, srv: RawServer) -> None:
        await read_request(reader, srv)
        await until_closed(reader)

    async with raw_server(handler) as srv:
        pool = HttpPool(srv.url, read_timeout_s=0.2)
        try:
            with pytest.raises(Timeout, match=r"no response bytes for 0\.2 s"):
                await pool.post("/chat/completions", b"{}")
            assert pool._idle == []
        finally:
            await pool.close()


async def test_http1_read_timeout_is_the_gap_between_bytes() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, srv: RawServer) -> None:
        await read_request(reader, srv)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for _ in range(6):
            await asyncio.sleep(0.08)  # a model's think time: the stream lasts longer than one timeout
            writer.write(b"1\r\nx\r\n")
        await until_closed(reader)  # then it stalls

    async with raw_server(handler) as srv:
        pool = HttpPool(srv.url, read_timeout_s=0.4)
        response = await pool.post("/chat/completions", b"{}")
        received = b""
        try:
            with pytest.raises(Timeout):
                async for piece in response.iter_body():
                    received += piece
        finally:
            await response.aclose()
            await pool.close()
    assert received == b"x" * 6


@pytest.mark.parametrize(
    ("response", "message"),
    [
        (b"HTTP/1.1 abc\r\n\r\n", "malformed status line"),
        (b"SSH-2.0-OpenSSH_9.6\r\n\r\n", "malformed status line"),
        (b"HTTP/1.1 200 OK\r\nx-big: " + b"a" * 70_000 + b"\r\n\r\n", "response head larger than 65536"),
        (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "malformed header line"),
        (b"HTTP/1.1 200 OK\r\ncontent-length: 12x\r\n\r\n", "malformed content-length"),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n", "malformed chunk size"),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nabc\r\n", "not followed by CRLF"),
        (b"HTTP/2 200\r\n\r\n", "malformed status line"),
        (b"HTTP/1.1 200 OK\r\nX-Folded: a\r\n  b\r\n\r\n", "malformed header line"),  # obs-fold: RFC 9112 §5.2
        (b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-length: 3\r\n\r\nok", "malformed content-length"),
        (
            b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ntransfer-encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
            "malformed content-length",  # both framings at once: a smuggling attempt or a broken server
        ),
        (b"HTTP/1.1 101 Switching Protocols\r\nupgrade: h2c\r\n\r\n", "unexpected 101 Switching Protocols"),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n0\r\nx-big: " + b"a" * 70_000 + b"\r\n\r\n", "larger"),
    ],
)
async def test_http1_malformed_response_is_protocol_error(response: bytes, message: str) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, srv: RawServer) -> None:
        await read_request(reader, srv)
        writer.write(response)
        await until_closed(reader)

    async with raw_server(handler) as srv:
        pool = HttpPool(srv.url)
        try:
            with pytest.raises(ProtocolError, match=message):
                await fetch(pool)
            assert pool._idle == []
        finally:
            await pool.close()


@pytest.mark.parametrize(
    "response",
    [
        b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n0123456789",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\na\r\n0123456789\r\n",
    ],
)
async def test_http1_connection_closed_mid_body_is_protocol_error(response: bytes) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, srv: RawServer) -> None:
        await read_request(reader, srv)
        writer.write(response)
        await writer.drain()

    async with raw_server(handler) as srv:
        pool = HttpPool(srv.url)
        response_ = await pool.post("/chat/completions", b"{}")
        received = b""
        try:
            with pytest.raises(ProtocolError, match="connection closed mid-body"):
                async for piece in response_.iter_body():
                    received += piece
        finally:
            await response_.aclose()
            await pool.close()
    assert received == b"0123456789"


@pytest.mark.parametrize("stage", ["head", "body"])
async def test_http1_cancellation_closes_the_connection(stage: str) -> None:
    reached, disconnected = asyncio.Event(), asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, srv: RawServer) -> None:
        if srv.connections > 1:
            return await answering(OK)(reader, writer, srv)
        await read_request(reader, srv)
        if stage == "body":
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
        else:
            reached.set()
        await until_closed(reader)
        disconnected.set()

    async def consume(pool: HttpPool) -> None:
        response = await pool.post("/chat/completions", b"{}")
        try:
            async for _ in response.iter_body():
                reached.set()
        finally:
            await response.aclose()

    async with raw_server(handler) as srv:
        pool = HttpPool(srv.url)
        try:
            task = asyncio.create_task(consume(pool))
            await asyncio.wait_for(reached.wait(), 5)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.wait_for(disconnected.wait(), 5)
            assert pool._idle == []
            assert await fetch(pool) == (200, b"ok")
        finally:
            await pool.close()
    assert srv.connections == 2


async def test_http1_concurrent_requests_each_get_a_connection() -> None:
    n = 50
    arrived = 0
    all_in = asyncio.Event()

    async def handle(request: Request) -> Response:
        nonlocal arrived
        arrived += 1
        if arrived % n == 0:
            all_in.set()
        await all_in.wait()  # answer only once all n are in: each needs its own connection
        return JSONResponse({"n": arrived})

    async with serve_asgi(Starlette(routes=[Route("/v1/chat/completions", handle, methods=["POST"])])) as url:
        pool = HttpPool(url + "/v1")
        try:
            async with asyncio.timeout(10):
                first = await asyncio.gather(*(fetch(pool) for _ in range(n)))
                assert (len(pool._conns), len(pool._idle)) == (n, n)
                all_in.clear()
                second = await asyncio.gather(*(fetch(pool) for _ in range(n)))
        finally:
            await pool.close()
    assert [status for status, _ in first + second] == [200] * 2 * n
    assert len(pool._conns) == 0  # all closed by close(), and none were added in the second round


async def test_http1_slow_consumer_keeps_buffered_bytes_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    piece = bytes(range(256)) * 256  # 64 KiB
    count = 256  # 16 MiB in all, many times the socket buffers (made small below) and the bound
    server_blocked = asyncio.Event()  # set while the server waits for the client to read

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, srv: RawServer) -> None:
        await read_request(reader, srv)
        writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for _ in range(count):
            writer.write(b"10000\r\n" + piece + b"\r\n")
            if writer.transport.get_write_buffer_size() > 64 * 1024:
                server_blocked.set()
                await writer.drain()
                server_blocked.clear()
        writer.write(b"0\r\n\r\n")
        await until_closed(reader)

    async with raw_server(handler) as srv:
        pool = HttpPool(srv.url)
        response = await pool.post("/chat/completions", b"{}")
        conn = response._conn
        assert conn is not None and conn.transport is not None
        conn.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        paused = asyncio.Event()
        pause = conn.transport.pause_reading

        def pause_reading() -> None:
            paused.set()
            pause()

        monkeypatch.setattr(conn.transport, "pause_reading", pause_reading)
        total, largest, digest = 0, 0, hashlib.sha256()
        try:
            async with asyncio.timeout(10):
                async for data in response.iter_body():
                    if total == 0:  # a slow consumer: the network outruns it until reading pauses
                        await paused.wait()
                        await server_blocked.wait()
                        assert http1.HIGH_WATER < conn.buffered <= http1.MAX_BUFFERED
                    largest = max(largest, len(data))
                    digest.update(data)
                    total += len(data)
        finally:
            await response.aclose()
            await pool.close()
    assert total == count * len(piece)
    assert digest.digest() == hashlib.sha256(piece * count).digest()
    assert largest <= http1.MAX_BUFFERED


class _FakeTransport(asyncio.Transport):
    def write(self, data: bytes | bytearray | memoryview) -> None:
        pass


@pytest.mark.parametrize(
    ("raw", "status", "headers", "body"),
    [
        (b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\n\r\nabc", 200, {"content-length": "3"}, b"abc"),
        (b"HTTP/1.1 200 OK\nContent-Length: 3\n\nabc", 200, {"content-length": "3"}, b"abc"),
        (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\ncontent-length: 2\r\n\r\nok", 201, {}, b"ok"),
        (b"HTTP/1.1 204 No Content\r\nX-A: 1\r\nx-a: 2\r\n\r\n", 204, {"x-a": "1, 2"}, b""),
        (
            b"HTTP/1.1 200 OK\r\nX-Spaced:  a b \t\r\ntransfer-encoding: chunked\r\n\r\n"
            b'3;ext="q"\r\nabc\r\nA\r\n0123456789\r\n0;last\r\nx-t: 1\r\n\r\n',
            200,
            {"x-spaced": "a b"},
            b"abc0123456789",
        ),
    ],
)
async def test_http1_parser_gives_the_same_answer_however_bytes_are_split(
    raw: bytes, status: int, headers: dict[str, str], body: bytes
) -> None:
    for size in (len(raw), 1, 2, 7):
        conn = http1._Conn(asyncio.get_running_loop(), 5.0)
        conn.connection_made(_FakeTransport())
        conn.send([b"POST / HTTP/1.1\r\n\r\n"])
        for i in range(0, len(raw), size):
            conn.data_received(raw[i : i + size])
        assert conn.state == http1._DONE and conn.keep_alive and conn.exc is None
        assert conn.status == status and headers.items() <= conn.headers.items()
        assert b"".join(conn.pieces) == body


def fed(raw: bytes, size: int) -> http1._Conn:
    """A connection that sent a request and received `raw` in reads of `size` bytes."""
    conn = http1._Conn(asyncio.get_running_loop(), 5.0)
    conn.connection_made(_FakeTransport())
    conn.send([b"POST / HTTP/1.1\r\n\r\n"])
    for i in range(0, len(raw), size):
        conn.data_received(raw[i : i + size])
    return conn


async def test_http1_interim_answers_headers_are_not_the_answers() -> None:
    raw = b"HTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
    for size in (len(raw), 1):
        conn = fed(raw, size)
        assert (conn.state, conn.status, conn.headers, b"".join(conn.pieces)) == (
            http1._DONE,
            200,
            {"content-length": "2"},
            b"ok",
        )


@pytest.mark.parametrize("after", [b"garbage", b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nno"])
async def test_http1_bytes_past_the_body_end_it_and_the_connection_is_not_kept(after: bytes) -> None:
    conn = fed(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok" + after, 1024)
    assert (conn.state, b"".join(conn.pieces), conn.exc) == (http1._DONE, b"ok", None)
    assert not conn.keep_alive


class _AbortableTransport(_FakeTransport):
    aborted = False

    def abort(self) -> None:
        self.aborted = True


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"HTTP/1.1 200 OK\r\nx-big: " + b"a" * 70_000, "response head larger than 65536"),
        (b"HTTP/1.1 200 OK\r\n" + b"x-many: a\r\n" * 7000, "response head larger than 65536"),
        (
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1\r\nx\r\n0\r\nx-t: " + b"a" * 70_000,
            "chunk framing or trailers larger than 65536",
        ),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1;" + b"e" * 70_000, "larger than 65536"),
    ],
)
async def test_http1_head_and_framing_held_are_bounded_however_slowly_they_come(raw: bytes, message: str) -> None:
    conn = http1._Conn(asyncio.get_running_loop(), 5.0)
    transport = _AbortableTransport()
    conn.connection_made(transport)
    conn.send([b"POST / HTTP/1.1\r\n\r\n"])
    for i in range(0, len(raw), 1000):
        conn.data_received(raw[i : i + 1000])
        if conn.exc is not None:
            break
    assert isinstance(conn.exc, ProtocolError) and re.search(message, str(conn.exc))
    assert transport.aborted and conn.closed
