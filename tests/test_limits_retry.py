"""A 429's Retry-After is when the request is in fact admitted (within ±20 %), whichever edge it returns to."""

from __future__ import annotations

import asyncio
import time
from contextlib import AsyncExitStack

import httpx

from iop.edge.keys import EdgeKeys, Key
from iop.edge.window import Window
from iop.nats.server import EmbeddedNats
from tests.harness import deployment, running_edge, running_node

WINDOW_S = 10.0
"""rpm means per WINDOW_S here: long enough that a whole-second Retry-After can be within 20 %."""

YAML = """
edge:
  tenants: {rate: {rpm: 3}}
models: [{alias: m, pool: [p]}]
nodes:
  - id: n
    adapters: [{type: mock, id: mk, latency_ms: 0, tokens: 2, token_interval_ms: 0}]
    providers: [{id: p, adapter: mk, capacity: 16}]
"""
KEYS = EdgeKeys(clients=[Key("rate", b"kr")], admins=[])
AUTH = {"authorization": "Bearer kr"}
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def seconds(reset: str) -> float:
    return float(reset.removesuffix("ms")) / 1000 if reset.endswith("ms") else float(reset.removesuffix("s"))


async def test_retry_after_is_within_a_fifth_of_when_the_request_is_admitted(nats_server: EmbeddedNats) -> None:
    async with AsyncExitStack() as stack:
        dep = deployment(YAML)
        edges = [await stack.enter_async_context(running_edge(dep, nats_server.url, KEYS)) for _ in range(3)]
        await stack.enter_async_context(running_node(dep, "n", nats_server.url))
        clients: list[httpx.AsyncClient] = []
        for e in edges:
            await e.edge.registry.wait_connected(["n"], timeout_s=10)
            e.edge.limits.window = Window(WINDOW_S)
            clients.append(await stack.enter_async_context(e.http()))
        for i in range(3):  # the window's three, on two edges
            assert (await clients[i % 2].post("/v1/chat/completions", json=BODY, headers=AUTH)).status_code == 200
        refused = await clients[2].post("/v1/chat/completions", json=BODY, headers=AUTH)
        refused_at = time.monotonic()
        assert refused.status_code == 429
        retry_after = int(refused.headers["retry-after"])
        reset = seconds(refused.headers["x-ratelimit-reset-requests"])
        # Asked again every 50 ms, on each edge in turn, until one admits it.
        admitted_at = None
        for i in range(int(WINDOW_S * 2 / 0.05)):
            r = await clients[i % 3].post("/v1/chat/completions", json=BODY, headers=AUTH)
            if r.status_code == 200:
                admitted_at = time.monotonic()
                break
            assert r.status_code == 429
            await asyncio.sleep(0.05)  # the client's pace between tries, not a synchronisation
        assert admitted_at is not None
        waited = admitted_at - refused_at
        print(f"\nRetry-After {retry_after} s, reset {reset:.3f} s; admitted after {waited:.3f} s")
        assert 0.8 * waited <= retry_after <= 1.2 * waited
        assert abs(reset - waited) <= 0.25  # the header's own precision (ms), the polling's 50 ms, the loop
