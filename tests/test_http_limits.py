"""The edge against bad HTTP clients: oversized heads, slowloris, idle sockets, stalled bodies, floods."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx
import pytest
import uvicorn

from iop import logs
from iop.edge.http import HeadWithBody, bind
from iop.edge.process import http_server
from iop.edge.root import Edge
from iop.nats import connection
from iop.nats.server import EmbeddedNats
from tests.harness import deployment, eventually, running_node, until

YAML = """
edge:
  allowed_hosts: [iop.test]
  http: {max_head_kb: 16, max_headers: 50, head_timeout_s: 0.5, body_idle_timeout_s: 0.5, max_connections: 16}
models:
  - alias: sim
    pool: [sim-1]
nodes:
  - id: n1
    adapters: [{id: sim, type: mock, latency_ms: 0, tokens: 2, token_interval_ms: 0}]
    providers: [{id: sim-1, adapter: sim, capacity: 4}]
"""

GOOD = {"model": "sim", "messages": [{"role": "user", "content": "hi"}]}


@dataclass
class Served:
    url: str
    port: int
    edge: Edge
    server: uvicorn.Server


@asynccontextmanager
async def edge_on_limits(nats_url: str) -> AsyncIterator[Served]:
    """A real edge behind the same uvicorn server `iop edge` runs, and its node."""
    dep = deployment(YAML)
    nc = await connection.connect(nats_url, "test-edge", wait_s=5)
    edge = Edge(dep, nc, nats_url=nats_url)
    await edge.start()
    sock = bind("127.0.0.1:0")
    port = sock.getsockname()[1]
    server = http_server(edge, grace_s=1)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        async with running_node(dep, "n1", nats_url):
            await edge.registry.wait_connected(["n1"], timeout_s=10)
            yield Served(f"http://127.0.0.1:{port}", port, edge, server)
    finally:
        server.should_exit = True
        await task
        sock.close()
        await edge.stop()
        await nc.close()


@pytest.fixture
async def served(nats_server: EmbeddedNats) -> AsyncIterator[Served]:
    async with edge_on_limits(nats_server.url) as s:
        yield s


async def read_answer(reader: asyncio.StreamReader, timeout_s: float = 10.0) -> tuple[int, dict[str, str], bytes]:
    """Everything the server sends until it closes: status, headers, body."""
    async with asyncio.timeout(timeout_s):
        raw = await reader.read()  # until EOF: every refusal closes the connection
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    status = int(lines[0].split()[1])
    headers = dict((k.lower(), v.strip()) for k, v in (line.split(":", 1) for line in lines[1:]))
    return status, headers, body


def error_code(body: bytes) -> str:
    return str(json.loads(body)["error"]["code"])


async def good_request_ms(url: str) -> float:
    async with httpx.AsyncClient(timeout=10) as client:
        started = time.perf_counter()
        r = await client.post(url + "/v1/chat/completions", json=GOOD)
        assert r.status_code == 200, r.text
        return (time.perf_counter() - started) * 1000


async def test_http_the_edge_turns_nagle_off_on_client_connections_under_asyncio_too(served: Served) -> None:
    """Each write of a streamed answer leaves at once, not after the client's delayed ACK.

    asyncio's loop sets TCP_NODELAY only on connections whose socket says IPPROTO_TCP, and an
    accepted connection takes the listener's proto: bound with socket.socket(), the edge kept Nagle's
    algorithm on, and under IOP_LOOP=asyncio a streamed answer's second event waited ~40 ms for the
    client's ACK, then the rest came in one lump (docs/performance.md). uvloop sets it regardless,
    so this runs on asyncio's loop, where the difference shows.
    """
    assert type(asyncio.get_running_loop()).__module__.startswith("asyncio.")
    async with httpx.AsyncClient(base_url=served.url, timeout=10) as client:
        r = await client.post("/v1/chat/completions", json=GOOD)
        assert r.status_code == 200, r.text
        # The answer came back on this kept-alive connection: the edge holds its side of it now.
        (conn,) = served.server.server_state.connections
        sock = conn.transport.get_extra_info("socket")
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0


async def test_http_endless_header_is_refused_431_and_good_requests_go_on(served: Served) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: iop.test\r\nx-flood: ")
    sent = 0
    latencies = []
    try:
        # Keep streaming one header value until the edge refuses: never more than ~20x the limit.
        while sent < 20 * 16 * 1024 and not reader.at_eof():
            writer.write(b"a" * 4096)
            sent += 4096
            await writer.drain()
            if sent % (64 * 1024) == 0:
                latencies.append(await good_request_ms(served.url))
    except ConnectionError:
        pass  # the edge closed while we were still writing: that is the refusal
    status, headers, body = await read_answer(reader)
    writer.close()
    assert status == 431
    assert headers["content-type"] == "application/json"
    assert error_code(body) == "header_too_large"
    latencies.append(await good_request_ms(served.url))
    print(f"\ngood requests during the header flood: {', '.join(f'{ms:.1f}' for ms in latencies)} ms")
    assert served.edge.http_limits.refused[431] == 1


async def test_http_too_many_headers_is_refused_431(served: Served) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
    headers = b"".join(b"x-h%d: v\r\n" % i for i in range(60))
    writer.write(b"GET /v1/models HTTP/1.1\r\nhost: iop.test\r\n" + headers + b"\r\n")
    status, _, body = await read_answer(reader)
    writer.close()
    assert status == 431
    assert error_code(body) == "header_too_large"


async def test_http_a_head_over_the_limits_in_one_write_is_refused_431_before_the_app_sees_it(served: Served) -> None:
    records = served.edge.observer.records
    many = b"".join(b"x-h%d: v\r\n" % i for i in range(20_000))
    for head in (
        b"x-big: " + b"a" * (100 * 1024) + b"\r\n",  # 100 KiB against a 16 KiB limit
        many,  # 20,000 headers against 50
    ):
        reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
        request = b"POST /v1/chat/completions HTTP/1.1\r\nhost: iop.test\r\ncontent-type: application/json\r\n"
        body = json.dumps(GOOD).encode()
        writer.write(request + head + b"content-length: %d\r\n\r\n" % len(body) + body)
        started = time.monotonic()
        status, _, answer = await read_answer(reader)
        writer.close()
        assert status == 431, answer
        assert error_code(answer) == "header_too_large"
        # At once, not when the head timeout (0.5 s here, 10 s by default) would have said 408.
        assert time.monotonic() - started < served.edge.http_limits.head_timeout_s
    assert served.edge.observer.records == records  # neither reached the application
    await good_request_ms(served.url)


async def test_http_a_client_hanging_up_mid_body_leaves_one_info_line_and_no_error(
    served: Served, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.DEBUG)
    # As under `iop edge` (iop.logs): uvicorn's lines reach the root logger, so caplog sees them,
    # whatever an earlier test's uvicorn (with its own logging config) left behind.
    for name in ("uvicorn", "uvicorn.error"):
        monkeypatch.setattr(logging.getLogger(name), "propagate", True)
    for path in (b"/v1/chat/completions", b"/v1/responses"):
        _, writer = await asyncio.open_connection("127.0.0.1", served.port)
        writer.write(
            b"POST %s HTTP/1.1\r\nhost: iop.test\r\ncontent-type: application/json\r\n"
            b'content-length: 100000\r\n\r\n{"model": ' % path
        )
        await writer.drain()
        writer.close()
    gone = [r for r in caplog.records if r.name == "iop.access" and " 499 " in r.getMessage()]

    async def both_logged() -> bool:
        gone[:] = [r for r in caplog.records if r.name == "iop.access" and " 499 " in r.getMessage()]
        return len(gone) == 2

    await eventually(both_logged)
    assert all(r.levelno == logging.INFO and "client_cancelled" in r.getMessage() for r in gone)
    loud = [(r.name, r.getMessage()) for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    assert loud == [], loud


async def test_http_uvicorn_s_own_lines_and_tracebacks_are_json_under_log_format_json(
    served: Served, capfd: pytest.CaptureFixture[str]
) -> None:
    # `served` built its uvicorn server as `iop edge` does; `iop edge --log-format json` then logs.
    root = logging.getLogger()
    saved = (list(root.handlers), root.level, {n: logging.getLogger(n).level for n in ("nats", "uvicorn", "httpx")})
    capfd.readouterr()
    try:
        logs.setup("info", "json")
        try:
            raise ValueError("a bug")
        except ValueError:
            logging.getLogger("uvicorn.error").exception("Exception in ASGI application")
        logging.getLogger("uvicorn.error").warning("Invalid HTTP request received.")
    finally:
        for h in list(root.handlers):
            root.removeHandler(h)
        for h in saved[0]:
            root.addHandler(h)
        root.setLevel(saved[1])
        for name, level in saved[2].items():
            logging.getLogger(name).setLevel(level)
    lines = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 2, lines
    first, second = (json.loads(line) for line in lines)
    assert (
        first["logger"] == "uvicorn.error" and first["level"] == "error" and "ValueError: a bug" in first["exception"]
    )
    assert second["message"] == "Invalid HTTP request received."


async def test_http_slow_head_is_closed_408(served: Served) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: iop.test\r\n")  # and never the rest
    started = time.monotonic()
    status, _, body = await read_answer(reader)
    waited = time.monotonic() - started
    writer.close()
    assert status == 408
    assert error_code(body) == "header_timeout"
    print(f"\nslow head closed after {waited:.2f}s (head_timeout_s 0.5)")


async def test_http_idle_socket_is_closed(served: Served) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
    status, _, body = await read_answer(reader)  # sends nothing at all
    writer.close()
    assert status == 408
    assert error_code(body) == "header_timeout"


async def test_http_stalled_body_is_closed_408(served: Served) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: iop.test\r\ncontent-type: application/json\r\n"
        b'content-length: 1000\r\n\r\n{"model": '
    )
    status, _, body = await read_answer(reader)
    writer.close()
    assert status == 408
    assert error_code(body) == "body_timeout"
    await good_request_ms(served.url)


async def test_http_connections_past_the_cap_get_503_then_service_resumes(served: Served) -> None:
    held = [await asyncio.open_connection("127.0.0.1", served.port) for _ in range(16)]
    reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
    status, headers, body = await read_answer(reader)
    writer.close()
    assert status == 503
    assert headers["retry-after"] == "1"
    assert error_code(body) == "too_many_connections"
    for _, w in held:
        w.close()
    limits = served.edge.http_limits
    await until(lambda: limits.open < limits.max_connections, limits.closed)
    await good_request_ms(served.url)


async def test_http_garbage_gets_json_400(served: Served) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
    writer.write(b"\x16\x03\x01 this is not http\r\n\r\n")
    status, headers, body = await read_answer(reader)
    writer.close()
    assert status == 400
    assert headers["content-type"] == "application/json"
    assert error_code(body) == "bad_http"


async def test_http_trailing_slash_is_a_json_404_not_a_redirect(served: Served) -> None:
    async with httpx.AsyncClient(timeout=10) as client:
        r = await client.post(served.url + "/v1/chat/completions/", json=GOOD)
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "not_found"


async def test_http_pages_of_other_sites_are_refused_and_the_edge_s_own_are_not(served: Served) -> None:
    async with httpx.AsyncClient(base_url=served.url, timeout=10) as client:
        host = served.url.removeprefix("http://")
        # What a page elsewhere can make a browser send without asking first: a plain POST.
        for path, body, kind in [
            ("/v1/chat/completions", json.dumps(GOOD), "text/plain"),
            ("/admin/refresh", "models: []", "text/plain"),
        ]:
            r = await client.post(path, content=body, headers={"origin": "https://evil.example", "content-type": kind})
            assert r.status_code == 403, r.text
            assert error_code(r.content) == "cross_origin"
        r = await client.get("/status", headers={"origin": "null"})
        assert r.status_code == 403
        # The edge's own page (same origin) and programs (no Origin) are served.
        r = await client.post("/v1/chat/completions", json=GOOD, headers={"origin": f"http://{host}"})
        assert r.status_code == 200, r.text
        r = await client.post("/v1/chat/completions", json=GOOD)
        assert r.status_code == 200, r.text


async def test_http_a_host_that_names_not_the_edge_gets_403_and_its_names_and_addresses_are_served(
    served: Served,
) -> None:
    port = served.port
    async with httpx.AsyncClient(base_url=served.url, timeout=10) as client:
        # DNS rebinding: the page's own name, now pointing at 127.0.0.1; Origin matches Host.
        rebound = f"evil.test:{port}"
        for path in ("/v1/chat/completions", "/admin/refresh", "/status", "/ui", "/healthz"):
            for headers in ({"host": rebound}, {"host": rebound, "origin": f"http://{rebound}"}):
                r = await client.post(path, json=GOOD, headers=headers)
                assert r.status_code == 403, (path, r.text)
                assert r.headers["content-type"] == "application/json"
                err = r.json()["error"]
                assert err["code"] == "host_not_allowed" and err["type"] == "permission_error", err
        for host in ("bad:host:name", "evil.test:80x", f"localhost.evil.test:{port}"):
            r = await client.get("/healthz", headers={"host": host})
            assert r.status_code == 403, host
        # The edge's addresses, loopback names and the configured name (any case, a trailing dot).
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}", f"10.9.8.7:{port}", "IOP.TEST."):
            r = await client.post("/v1/chat/completions", json=GOOD, headers={"host": host})
            assert r.status_code == 200, (host, r.text)
    # A request without Host (HTTP/1.0, a program): no browser sends that.
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /healthz HTTP/1.0\r\n\r\n")
    status, _, _ = await read_answer(reader)
    writer.close()
    assert status == 200


async def test_http_a_body_without_a_content_type_is_415(served: Served) -> None:
    async with httpx.AsyncClient(base_url=served.url, timeout=10) as client:
        r = await client.post("/v1/chat/completions", content=json.dumps(GOOD).encode())
        assert "content-type" not in r.request.headers
        assert r.status_code == 415
        assert error_code(r.content) == "unsupported_media_type"


# --- a response head leaves with its body ----------------------------------------------------------


class _Recorded(asyncio.Transport):
    """What the connection's socket was asked to send, one entry per system call."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[bytes] = []
        self.closed = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.sent.append(bytes(data))

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_write_buffer_size(self) -> int:
        return 0


async def test_a_response_head_is_sent_with_its_body_in_one_write() -> None:
    head = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n"
    rec = _Recorded()
    conn = HeadWithBody(rec, asyncio.get_running_loop())
    conn.write(head)
    assert rec.sent == [] and conn.get_write_buffer_size() == len(head)
    conn.write(b"{}")
    assert rec.sent == [head + b"{}"]  # one system call for the whole answer

    # Streamed pieces go at once; a head with no body after it leaves at the end of the loop's turn.
    conn.write(b"data: 1\n\n")
    assert rec.sent[-1] == b"data: 1\n\n"
    empty = b"HTTP/1.1 204 No Content\r\n\r\n"
    conn.write(empty)
    assert rec.sent[-1] == b"data: 1\n\n"
    await asyncio.sleep(0)  # one turn of the loop, which is what the wrapper waits for
    assert rec.sent[-1] == empty

    # A refusal written and closed at once still reaches the socket before the close.
    conn.write(b"HTTP/1.1 408 Request Timeout\r\nconnection: close\r\n\r\n")
    conn.close()
    assert rec.sent[-1].startswith(b"HTTP/1.1 408") and rec.closed
