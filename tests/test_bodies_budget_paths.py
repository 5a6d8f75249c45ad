"""Every POST path that buffers a body counts it against edge.queue.max_waiting_mb while it arrives, not
only once it is whole: `/v1/responses` (read by the front before the endpoint), its compact path and
count_tokens, as the chat path does."""

from __future__ import annotations

import asyncio

import pytest

from iop.nats.server import EmbeddedNats
from tests.harness import deployment, deployment_running

YAML = """
edge: {queue: {max_waiting_mb: 1}}
models: [{alias: m, pool: [p]}]
nodes:
  - id: n
    adapters: [{id: sim, type: mock, latency_ms: 0, tokens: 3, token_interval_ms: 0}]
    providers: [{id: p, adapter: sim, capacity: 1}]
"""


@pytest.mark.parametrize(
    "path", ["/v1/chat/completions", "/v1/responses", "/v1/responses/compact", "/v1/messages/count_tokens"]
)
async def test_a_body_arriving_past_max_waiting_mb_is_refused_before_it_is_whole(
    nats_server: EmbeddedNats, path: str
) -> None:
    async with deployment_running(deployment(YAML), nats_server.url) as h:
        port = int(h.url.rsplit(":", 1)[1])
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        size = 3 * 1024 * 1024  # under max_body_mb (32), over the 1 MiB budget
        head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        writer.write(f"{head}Content-Length: {size}\r\n\r\n".encode())
        writer.write(b'{"model": "m", "input": "' + b"x" * (2 * 1024 * 1024))  # two thirds, then it stalls
        await writer.drain()
        async with asyncio.timeout(10):  # the edge answers without the rest
            answer = b""
            while b"max_waiting_mb" not in answer and not reader.at_eof():
                answer += await reader.read(65536)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 503 "), answer[:300]
        assert b"max_waiting_mb" in answer, answer[:300]
        assert h.edge.bodies.bytes == 0
