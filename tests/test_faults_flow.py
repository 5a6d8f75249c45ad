"""Flow control of answers: a slow client bounds what the edge buffers and holds nobody else back."""

from __future__ import annotations

import asyncio
import socket
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import nats

from iop import wire
from iop.nats import connection
from iop.nats.server import EmbeddedNats
from iop.node.adapters.mock import mock_token
from iop.node.running import Running
from iop.node.runtime import NodeRuntime
from tests.harness import EdgeHandle, deployment, running_edge, running_node, sse_events, until, wait_gone

BULK_BYTES = 16 * 1024 * 1024
"""Far more than the window plus every socket buffer on the way: the producer must be held back."""

# Writes its pid to a file named after the prompt, then `size` bytes of known text as fast as it can.
BULK = """
import os, pathlib, sys
d, size = pathlib.Path(sys.argv[1]), int(sys.argv[2])
(d / sys.stdin.read().strip()).write_text(str(os.getpid()))
piece = "0123456789abcdef" * 4096
out = sys.stdout
for _ in range(size // len(piece)):
    out.write(piece)
out.flush()
"""


def flow_yaml(script: Path, pids: Path) -> str:
    return f"""
edge:
  queue: {{timeout_s: 20, max_waiting: 100}}
models:
  - {{alias: sim, pool: [sim-1]}}
  - {{alias: fast, pool: [fast-1]}}
  - {{alias: bulk, route: n/bulk-cli}}
nodes:
  - id: n
    adapters:
      - {{id: sim, type: mock, latency_ms: 0, tokens: 20, token_interval_ms: 0}}
      - {{id: fast, type: mock, latency_ms: 0, tokens: 20000, token_interval_ms: 0}}
      - {{id: bulk, type: cli, command: ["{sys.executable}", "{script}", "{pids}", "{BULK_BYTES}"], timeout_s: 60}}
    providers:
      - {{id: sim-1, adapter: sim, capacity: 4}}
      - {{id: fast-1, adapter: fast, capacity: 1}}
      - {{id: bulk-cli, adapter: bulk}}
"""


@asynccontextmanager
async def flow_deployment(nats_url: str, tmp_path: Path) -> AsyncIterator[tuple[EdgeHandle, NodeRuntime, Path]]:
    script = tmp_path / "bulk.py"
    script.write_text(BULK)
    pids = tmp_path / "pids"
    pids.mkdir()
    dep = deployment(flow_yaml(script, pids))
    async with running_edge(dep, nats_url) as h, running_node(dep, "n", nats_url) as node:
        await h.edge.registry.wait_connected(["n"], timeout_s=10)
        yield h, node, pids


def slow_client(h: EdgeHandle) -> httpx.AsyncClient:
    """A client with a small, fixed socket receive buffer that reads only when the test says so."""
    transport = httpx.AsyncHTTPTransport(socket_options=[(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 * 1024)])
    return httpx.AsyncClient(base_url=h.url, transport=transport, timeout=60)


def bulk_request(tag: str) -> dict[str, object]:
    return {"model": "bulk", "stream": True, "messages": [{"role": "user", "content": tag}]}


async def held_bulk(node: NodeRuntime) -> Running:
    """The bulk request, once its window is full (the node waits for credit)."""

    def blocked() -> Running | None:
        return next((r for r in node.requests() if r.item.alias == "bulk" and r.window.blocked), None)

    await until(lambda: blocked() is not None, node.changed)
    run = blocked()
    assert run is not None
    return run


def bulk_text(events: list[dict[str, Any]]) -> str:
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices"))


async def test_slow_client_is_bounded_and_holds_nobody_back(nats_server: EmbeddedNats, tmp_path: Path) -> None:
    async with flow_deployment(nats_server.url, tmp_path) as (h, node, _), slow_client(h) as slow, h.http() as http:

        async def one(i: int) -> str:
            body = {"model": "sim", "stream": i % 2 == 0, "messages": [{"role": "user", "content": f"{i}"}]}
            resp = await http.post("/v1/chat/completions", json=body)
            assert resp.status_code == 200, resp.text
            if i % 2:
                return str(resp.json()["choices"][0]["message"]["content"])
            return bulk_text(sse_events(resp.text))

        t0 = time.monotonic()
        await asyncio.gather(*(one(i) for i in range(24)))
        alone_s = time.monotonic() - t0
        async with slow.stream("POST", "/v1/chat/completions", json=bulk_request("slow")) as r:
            assert r.status_code == 200
            run = await held_bulk(node)

            # While that client reads nothing, others are served as usual by the same edge and node.
            t0 = time.monotonic()
            answers = await asyncio.gather(*(one(i) for i in range(24)))
            others_s = time.monotonic() - t0
            assert answers == ["".join(mock_token(i) for i in range(20))] * 24

            # The edge never held more than the window of this answer, and the command was held
            # back (its output waits in its pipe), far from done.
            assert h.edge.relay.peak_buffered_bytes <= wire.WINDOW_BYTES
            assert run.window.sent_bytes - run.window.credit_bytes <= wire.WINDOW_BYTES
            assert run.window.sent_bytes < BULK_BYTES / 2
            assert run.task is not None and not run.task.done()
            sent_while_stalled = run.window.sent_bytes

            # Now the client reads: the whole answer arrives, nothing lost.
            text = "".join([t async for t in r.aiter_text()])
        content = bulk_text(sse_events(text))
        assert len(content) == BULK_BYTES and content == "0123456789abcdef" * (BULK_BYTES // 16)
        peak = h.edge.relay.peak_buffered_bytes
    print(
        f"\nslow client: 24 other requests took {others_s:.2f}s ({alone_s:.2f}s without it); "
        f"edge peak buffer {peak / 1024:.0f} KiB (window {wire.WINDOW_BYTES // 1024} KiB); "
        f"node had sent {sent_while_stalled / 2**20:.1f} MiB of {BULK_BYTES / 2**20:.0f} MiB"
        " while the client read nothing"
    )


async def test_stalled_client_fails_after_the_stall_timeout(nats_server: EmbeddedNats, tmp_path: Path) -> None:
    async with flow_deployment(nats_server.url, tmp_path) as (h, node, pids), slow_client(h) as slow:
        node.stall_timeout_s = 1.0
        bulk = node.resources["bulk-cli"]
        async with slow.stream("POST", "/v1/chat/completions", json=bulk_request("stalled")) as r:
            run = await held_bulk(node)
            # From the node's own start of the wait: the test sees the window full a little later.
            blocked = run.window.blocked_since
            await until(lambda: bulk.failed == 1 and bulk.in_flight == 0, node.changed)
            failed_after_s = time.monotonic() - blocked
            await wait_gone(int((pids / "stalled").read_text()))
            text = "".join([t async for t in r.aiter_text()])
        # The client, reading at last, gets what was sent and then a clear error, never a silent cut.
        last = sse_events(text)[-1]
        assert last["error"]["code"] == "client_stalled"
    print(f"\nstalled client: request failed {failed_after_s:.2f}s after its window filled (timeout 1s)")
    assert 1.0 <= failed_after_s < 3.0


async def test_client_leaving_while_the_window_is_full_frees_everything(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    async with flow_deployment(nats_server.url, tmp_path) as (h, node, pids):
        bulk = node.resources["bulk-cli"]
        async with slow_client(h) as slow, slow.stream("POST", "/v1/chat/completions", json=bulk_request("gone")) as r:
            assert r.status_code == 200
            await held_bulk(node)
        left = time.monotonic()
        # The wait for credit ends with the cancel: process group killed, request over.
        await until(lambda: bulk.in_flight == 0, node.changed)
        await wait_gone(int((pids / "gone").read_text()))
        freed_s = time.monotonic() - left
        assert bulk.failed == 1
    print(f"\nclient left with a full window: command killed and request ended after {freed_s:.3f}s")


async def test_node_stops_waiting_for_credit_when_its_edge_is_gone(nats_server: EmbeddedNats, tmp_path: Path) -> None:
    """No edge at all: the test plays one that takes the work, never grants credit, then vanishes."""
    script = tmp_path / "bulk.py"
    script.write_text(BULK)
    pids = tmp_path / "pids"
    pids.mkdir()
    dep = deployment(flow_yaml(script, pids))
    nc = await nats.connect(nats_server.url)
    try:
        async with running_node(dep, "n", nats_server.url) as node:
            node.probe_interval_s = 0.2
            assert node.nc is not None
            await connection.flush(node.nc)  # the server has its subscriptions: nothing answered "no responders"
            reply_to = wire.reply_prefix("gone-edge") + ".r1"
            inbox = await nc.subscribe(reply_to)  # receives answers and probes, answers nothing
            item = wire.WorkItem(
                id="r1",
                api="chat",
                stream=True,
                alias="bulk",
                body=b'{"model": "bulk", "messages": [{"role": "user", "content": "orphan"}]}',
                reply_to=reply_to,
                deadline=time.time() + 30,
                edge="gone-edge",
            )
            await nc.request(wire.cli_subject("n", "bulk-cli"), wire.encode(item), timeout=5)
            await held_bulk(node)
            await inbox.unsubscribe()
            gone = time.monotonic()
            await until(lambda: not node.requests(), node.changed)
            stopped_s = time.monotonic() - gone
            await wait_gone(int((pids / "orphan").read_text()))
    finally:
        await nc.close()
    print(f"\nedge gone: node stopped the request {stopped_s:.2f}s after (probe every 0.2s, 2 unanswered)")
    assert stopped_s < 0.2 * (2 + 2)


async def test_fast_stream_costs_one_credit_per_many_chunks(nats_server: EmbeddedNats, tmp_path: Path) -> None:
    async with flow_deployment(nats_server.url, tmp_path) as (h, _, _), h.http() as http:
        body = {"model": "fast", "stream": True, "messages": [{"role": "user", "content": "x"}]}
        t0 = time.monotonic()
        r = await http.post("/v1/chat/completions", json=body)
        took = time.monotonic() - t0
        events = sse_events(r.text)
        assert bulk_text(events) == "".join(mock_token(i) for i in range(20000))
        credits = h.edge.relay.credits_sent
    chunks = len(events)
    print(f"\nfast stream: {chunks} chunks in {took:.2f}s ({chunks / took:.0f}/s) with {credits} credit messages")
    assert credits <= chunks / wire.CREDIT_EVERY_CHUNKS + 2
