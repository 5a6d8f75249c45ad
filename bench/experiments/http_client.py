"""Upstream-call cost: iop.node.http1.HttpPool vs httpx.AsyncClient against a minimal loopback upstream.

    python -m bench.experiments.http_client [--requests N] [--max-seconds S]

The upstream runs in a subprocess (raw asyncio) so this process's CPU time is the client's alone.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager

import httpx

from bench.procs import REPO
from iop.node.http1 import HttpPool

CHAT = (
    b'{"id":"chatcmpl-1","object":"chat.completion","created":1700000000,"model":"m","choices":[{"index":0,'
    b'"message":{"role":"assistant","content":"Hello there, how can I help?"},"finish_reason":"stop"}],'
    b'"usage":{"prompt_tokens":9,"completion_tokens":8,"total_tokens":17}}'
)
EVENTS = [
    b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"%s"}}]}\n\n'
    % word
    for word in (b"Hello", b" there", b",", b" how", b" can", b" I", b" help", b"?")
] + [b"data: [DONE]\n\n"]
PLAIN = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(CHAT), CHAT)
SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
LENGTH = re.compile(rb"(?i)\ncontent-length: *(\d+)\r\n")
BODY = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":false}'
STREAM_BODY = BODY.replace(b'"stream":false', b'"stream":true')


class Upstream(asyncio.Protocol):
    """Answers each request at once: a fixed chat completion, or a short SSE stream if asked to stream."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.buf = b""

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while (end := self.buf.find(b"\r\n\r\n")) >= 0:
            head = LENGTH.search(self.buf, 0, end + 2)
            assert head is not None, "the client sends content-length"
            length = int(head.group(1))
            if len(self.buf) < end + 4 + length:
                return
            body = self.buf[end + 4 : end + 4 + length]
            self.buf = self.buf[end + 4 + length :]
            if b'"stream":true' in body:
                self.transport.write(SSE_HEAD)
                for event in EVENTS:  # one write per event, as a token server flushes
                    self.transport.write(b"%x\r\n%s\r\n" % (len(event), event))
                self.transport.write(b"0\r\n\r\n")
            else:
                self.transport.write(PLAIN)


async def serve() -> None:
    server = await asyncio.get_running_loop().create_server(Upstream, "127.0.0.1", 0, backlog=1024)
    print(server.sockets[0].getsockname()[1], flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent goes


Call = Callable[[bool], Awaitable[int]]


def lean_call(pool: HttpPool) -> Call:
    async def call(stream: bool) -> int:
        response = await pool.post("/chat/completions", STREAM_BODY if stream else BODY)
        try:
            if stream:
                return sum([len(piece) async for piece in response.iter_body()])
            return len(await response.read())
        finally:
            await response.aclose()

    return call


def httpx_call(client: httpx.AsyncClient) -> Call:
    async def call(stream: bool) -> int:
        if stream:
            async with client.stream("POST", "/chat/completions", content=STREAM_BODY) as response:
                return sum([len(piece) async for piece in response.aiter_raw()])
        response = await client.post("/chat/completions", content=BODY)
        return len(response.content)

    return call


async def measure(
    call: Call, stream: bool, concurrency: int, requests: int, max_seconds: float
) -> tuple[int, float, float]:
    """Run `requests` calls (or as many as fit in max_seconds) by `concurrency` workers: (done, wall s, CPU s)."""
    await asyncio.gather(*(call(stream) for _ in range(concurrency)))  # warm: connections open
    done = 0
    start_wall, start_cpu = time.perf_counter(), time.process_time()
    deadline = start_wall + max_seconds

    async def worker() -> None:
        nonlocal done
        while done < requests and time.perf_counter() < deadline:
            done += 1
            assert await call(stream) > 0

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done, time.perf_counter() - start_wall, time.process_time() - start_cpu


async def run(port: int, requests: int, max_seconds: float) -> None:
    base = f"http://127.0.0.1:{port}/v1"
    pool = HttpPool(base, headers={"content-type": "application/json"})
    client = httpx.AsyncClient(base_url=base, headers={"content-type": "application/json"})
    clients = {"http1.HttpPool": lean_call(pool), "httpx.AsyncClient": httpx_call(client)}
    print(f"{'client':<18} {'mode':<10} {'conc':>4} {'requests':>8} {'req/s':>8} {'CPU s/1k req':>12}")
    try:
        for stream in (False, True):
            for concurrency in (1, 32):
                for name, call in clients.items():
                    n, wall, cpu = await measure(call, stream, concurrency, requests, max_seconds)
                    mode = "stream" if stream else "plain"
                    print(f"{name:<18} {mode:<10} {concurrency:>4} {n:>8} {n / wall:>8.0f} {cpu / n * 1000:>12.3f}")
    finally:
        await pool.close()
        await client.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=5000, help="requests per row (default 5000)")
    parser.add_argument("--max-seconds", type=float, default=10.0, help="time cap per row (default 10)")
    parser.add_argument("--upstream", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.upstream:
        asyncio.run(serve())
        return
    with upstream_process() as upstream:
        assert upstream.stdout is not None
        port = int(upstream.stdout.readline())
        asyncio.run(run(port, args.requests, args.max_seconds))


@contextmanager
def upstream_process() -> Iterator[subprocess.Popen[bytes]]:
    """This module's upstream in a process of its own; its first stdout line is its port."""
    argv = [sys.executable, "-m", "bench.experiments.http_client", "--upstream"]
    with subprocess.Popen(argv, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE) as upstream:
        try:
            yield upstream
        finally:
            upstream.terminate()
            upstream.wait(timeout=10)


if __name__ == "__main__":
    main()
