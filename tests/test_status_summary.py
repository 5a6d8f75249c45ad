"""`GET /status?view=summary` (`iop status --summary`): counts by state, pools, only what is not healthy."""

from __future__ import annotations

import asyncio
import sys

import httpx

from iop.client import EdgeClient
from iop.contracts.status import NodeAttention, StateCounts, StatusSummary, decode_summary
from iop.nats.server import EmbeddedNats
from iop.statusview import render_summary
from tests.fakes import fake_upstream
from tests.harness import EdgeHandle, deployment, deployment_running, eventually, running_edge, running_node


async def summary_of(h: EdgeHandle) -> StatusSummary:
    async with EdgeClient(h.url) as edge:
        return await edge.summary()


async def test_status_summary_counts_by_state_and_lists_only_what_is_not_healthy(nats_server: EmbeddedNats) -> None:
    async with fake_upstream(fail_status=500) as bad, fake_upstream() as good:
        dep = deployment(f"""
models: [{{alias: m, pool: [prov-a, prov-b, prov-c]}}]
nodes:
  - id: node-a
    adapters: [{{id: up, type: openai, base_url: "{bad.url}", api: both}}]
    providers: [{{id: prov-a, adapter: up, capacity: 4}}]
  - id: node-b
    adapters: [{{id: up, type: openai, base_url: "{good.url}", api: both}}]
    providers: [{{id: prov-b, adapter: up, capacity: 1}}]
  - id: node-c
    adapters: [{{id: up, type: openai, base_url: "{good.url}", api: both}}]
    providers: [{{id: prov-c, adapter: up, capacity: 2}}]
""")
        async with (
            running_edge(dep, nats_server.url) as h,
            running_node(dep, "node-a", nats_server.url),
            running_node(dep, "node-b", nats_server.url),
            h.http() as http,
        ):
            await h.edge.registry.wait_connected(["node-a", "node-b"], timeout_s=10)
            body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
            for _ in range(3):  # prov-a, with the most free slots, fails each one first: its breaker opens
                assert (await http.post("/v1/chat/completions", json=body)).status_code == 200
            got: list[StatusSummary] = []

            async def opened() -> bool:
                got[:] = [await summary_of(h)]  # served from a cache at most 0.25 s old
                return got[0].providers.breaker_open == 1

            await eventually(opened)
            s = got[0]
            assert (s.nodes, s.nodes_connected) == (3, 2)
            assert s.providers == StateCounts(ready=1, breaker_open=1, disconnected=1)
            assert (s.total_capacity, s.usable_capacity, s.waiting) == (7, 1, 0)
            (pool,) = s.pools
            assert (pool.alias, pool.providers, pool.total_capacity, pool.usable_capacity) == ("m", 3, 7, 1)
            assert pool.states == s.providers
            # node-b is healthy: counted, not listed. node-a lists its broken provider; node-c is gone.
            assert [n.id for n in s.attention] == ["node-a", "node-c"]
            a, c = s.attention
            (broken,) = a.unhealthy
            assert (broken.id, broken.state, broken.pools, broken.consecutive_failures) == (
                "prov-a",
                "breaker_open",
                ["m"],
                3,
            )
            assert broken.breaker_open_for_s is not None and 0 < broken.breaker_open_for_s <= 5
            assert c == NodeAttention(
                id="node-c", connected=False, last_seen_s_ago=None, providers=1, capacity=2, in_flight=0
            )
            text = render_summary(s)
            assert "providers: ready 1, breaker-open 1, disconnected 1" in text
            assert "prov-b" not in text and "node-b" not in text
            cli = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "iop", "status", "--summary", "--edge", h.url, stdout=asyncio.subprocess.PIPE
            )
            out, _ = await asyncio.wait_for(cli.communicate(), 30)
            assert cli.returncode == 0 and "breaker-open" in out.decode() and "prov-a" in out.decode()
            r = await http.get("/status", params={"view": "everything"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "view"


def _pool_of(n: int) -> str:
    providers = ", ".join(f"{{id: p{i}, adapter: sim, capacity: 2}}" for i in range(n))
    members = ", ".join(f"p{i}" for i in range(n))
    return f"""
models: [{{alias: m, pool: [{members}]}}]
nodes:
  - id: n1
    adapters: [{{id: sim, type: mock, latency_ms: 0, tokens: 3, token_interval_ms: 0}}]
    providers: [{providers}]
"""


async def _sizes(nats_url: str, n: int) -> tuple[int, int]:
    """Bytes of the summary and of the full document for a pool of `n` healthy providers."""
    async with deployment_running(deployment(_pool_of(n)), nats_url) as h, httpx.AsyncClient(base_url=h.url) as http:

        async def ready() -> bool:
            r = await http.get("/status?view=summary")
            return decode_summary(r.content).providers.ready == n

        await eventually(ready)
        summary = (await http.get("/status?view=summary")).content
        full = (await http.get("/status")).content
        return len(summary), len(full)


async def test_status_summary_does_not_grow_with_healthy_providers(nats_server: EmbeddedNats) -> None:
    small, large = await _sizes(nats_server.url, 3), await _sizes(nats_server.url, 30)
    print(f"\n/status bytes, summary / full: 3 providers {small}, 30 providers {large}")
    assert large[1] > small[1] + 27 * 100  # the full document lists every provider
    assert abs(large[0] - small[0]) < 24  # the summary only counts them: a few more digits
