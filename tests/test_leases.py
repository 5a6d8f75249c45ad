"""A tenant's max_concurrent across edges: the division of its units (pure), then three real edges on one NATS."""

from __future__ import annotations

import asyncio
import time
from contextlib import AsyncExitStack

import msgspec
import nats.js.errors

from iop.edge.leases import LEASES_BUCKET, Share, TenantLeases, fair_parts, lease_key
from iop.nats import connection
from iop.nats.server import EmbeddedNats
from tests.fakes import fake_upstream
from tests.harness import EdgeHandle, deployment, eventually, running_edge, running_node


def test_fair_parts_divide_the_bound_max_min_and_alike_on_every_edge() -> None:
    assert fair_parts(4, {"a": 10, "b": 10, "c": 10}) == {"a": 2, "b": 1, "c": 1}
    assert fair_parts(4, {"a": 1, "b": 10}) == {"a": 1, "b": 3}
    assert fair_parts(6, {"a": 0, "b": 2, "c": 9}) == {"a": 0, "b": 2, "c": 4}
    assert sum(fair_parts(5, {"x": 7, "y": 7}).values()) == 5


def test_lease_keys_hold_any_alias_and_tenant() -> None:
    assert lease_key("qwen/coder:7b", "ops@example.com") == "c.qwen=2Fcoder=3A7b.ops=40example=2Ecom"
    assert lease_key("m", "") == "c.m.="


YAML = """
edge:
  queue: {timeout_s: 30, max_waiting: 100}
  tenant_defaults: {max_concurrent: 3}
models: [{alias: m, pool: [p]}]
nodes:
  - id: n
    adapters: [{id: up, type: openai, base_url: "URL", api: both}]
    providers: [{id: p, adapter: up, capacity: 20}]
"""


def ask(i: int) -> dict[str, object]:
    return {"model": "m", "messages": [{"role": "user", "content": f"q{i}"}]}


async def held_in_bucket(edge: EdgeHandle) -> dict[str, Share]:
    kv = await edge.edge.js.key_value(LEASES_BUCKET)
    try:
        entry = await kv.get(lease_key("m", ""))
    except nats.js.errors.KeyNotFoundError:
        return {}
    return msgspec.msgpack.decode(entry.value or b"", type=dict[str, Share])


async def test_max_concurrent_holds_across_three_edges_and_every_unit_comes_back(nats_server: EmbeddedNats) -> None:
    """Five requests on each of three edges, a bound of 3: three run at a time, all 15 are served (none
    refused: they wait), each edge's waiters get units, and once all ended no edge holds one."""
    gate = asyncio.Event()
    async with fake_upstream(gate=gate) as up, AsyncExitStack() as stack:
        dep = deployment(YAML.replace("URL", up.url))
        edges = [await stack.enter_async_context(running_edge(dep, nats_server.url)) for _ in range(3)]
        await stack.enter_async_context(running_node(dep, "n", nats_server.url))
        https = [await stack.enter_async_context(e.http()) for e in edges]
        for e in edges:
            await e.edge.registry.wait_connected(["n"], timeout_s=10)
            e.edge.leases.linger_s = 0.2
        tasks = [asyncio.create_task(https[i % 3].post("/v1/chat/completions", json=ask(i))) for i in range(15)]
        await up.wait_for(lambda u: u.in_flight == 3)

        async def the_rest_wait() -> bool:  # (some may still be on their way to their edge)
            return sum(len(e.edge.scheduler.pools["m"].waiters) for e in edges) == 12

        await eventually(the_rest_wait, timeout_s=10)
        assert up.in_flight == 3

        gate.set()
        served = list(await asyncio.gather(*tasks))
        assert [r.status_code for r in served] == [200] * 15
        assert up.peak == 3 and up.total == 15

        async def none_held() -> bool:
            return all(s.held == 0 for s in (await held_in_bucket(edges[0])).values())

        await eventually(none_held, timeout_s=5)
        writes = sum(e.edge.leases.writes for e in edges)
        conflicts = sum(e.edge.leases.conflicts for e in edges)
        print(f"\nlease writes {writes}, compare-and-set conflicts {conflicts}")
        # No counter left taken: a fresh burst on one edge runs at the whole bound again.
        gate.clear()
        again = [asyncio.create_task(https[1].post("/v1/chat/completions", json=ask(100 + i))) for i in range(4)]
        await up.wait_for(lambda u: u.in_flight == 3)
        metrics = (await https[1].get("/metrics")).text
        assert 'iop_tenant_lease_here{pool="m",tenant=""} 3.0' in metrics
        assert 'iop_tenant_lease_all_edges{pool="m",tenant=""} 3.0' in metrics
        gate.set()
        assert [r.status_code for r in await asyncio.gather(*again)] == [200] * 4
        assert up.peak == 3


async def test_an_edge_that_stops_renewing_its_units_loses_them_to_the_others(nats_server: EmbeddedNats) -> None:
    """Units an edge holds return after the lease TTL when it no longer renews them (as after a SIGKILL)."""
    async with fake_upstream() as up, AsyncExitStack() as stack:
        dep = deployment(YAML.replace("URL", up.url))
        edges = [await stack.enter_async_context(running_edge(dep, nats_server.url)) for _ in range(2)]
        ghost = TenantLeases("ghost", ttl_s=1.5)
        edges[1].edge.leases.ttl_s = 1.5  # how long it counts an entry after it saw it written
        await ghost.open(edges[0].edge.js)
        # The ghost takes the whole bound, then goes silent (its tasks stopped, nothing given back).
        ghost.bound("m", "", 3)
        ghost.changed("m", "", 0, 3)
        await eventually(lambda: _true(ghost.bound("m", "", 3) == 3), timeout_s=5)
        for task in (ghost._renew, ghost._watch):  # it dies without a word
            assert task is not None
            task.cancel()
        await stack.enter_async_context(running_node(dep, "n", nats_server.url))
        await edges[1].edge.registry.wait_connected(["n"], timeout_s=10)
        async with edges[1].http() as http:
            r = await http.post("/v1/chat/completions", json=ask(1))  # waits until the ghost's units expire
        assert r.status_code == 200
        assert up.peak == 1


async def _true(value: bool) -> bool:
    return value


async def test_an_edge_watches_the_leases_anew_after_a_quiet_while_and_still_hears_the_others(
    nats_server: EmbeddedNats,
) -> None:
    nc = await connection.connect(nats_server.url, "test-leases")
    try:
        js = nc.jetstream()
        a, b = TenantLeases("a"), TenantLeases("b")
        a.rewatch_s = 0.1
        await a.open(js)
        await b.open(js)
        quiet_until = asyncio.get_running_loop().time() + 0.5
        await eventually(lambda: _true(asyncio.get_running_loop().time() >= quiet_until))  # a few rewatches
        b.bound("m", "t", 2)
        b.changed("m", "t", 0, 2)
        key = lease_key("m", "t")
        await eventually(lambda: _true("b" in a.values.get(key, (0, {}))[1]), timeout_s=5)
        assert a.values[key][1]["b"].held == 2
        await a.stop()
        await b.stop()
    finally:
        await nc.close()


STREAM_INFO_ANSWER = b'{"type":"io.nats.jetstream.api.v1.stream_info_response","config":{"name":"x"}}'
"""What a node credential can make the JetStream server store under any key (tests/test_node_reply_subjects.py)."""


async def test_an_unreadable_lease_entry_is_written_over_keeping_the_shares_the_edges_knew(
    nats_server: EmbeddedNats,
) -> None:
    nc = await connection.connect(nats_server.url, "test-leases")
    try:
        js = nc.jetstream()
        a, b = TenantLeases("a"), TenantLeases("b")
        await a.open(js)
        await b.open(js)
        key = lease_key("m", "t")
        a.bound("m", "t", 3)
        a.changed("m", "t", 0, 2)
        await eventually(lambda: _true(a.bound("m", "t", 3) == 2 and "a" in b.values.get(key, (0, {}))[1]))
        junk = await a.kv.put(key, STREAM_INFO_ANSWER)
        await eventually(lambda: _true(a.values[key][0] >= junk and b.values[key][0] >= junk))
        b.bound("m", "t", 3)
        b.changed("m", "t", 0, 3)  # wants all 3: a's 2 are still a's, so it gets the third
        await eventually(lambda: _true(b.bound("m", "t", 3) == 1), timeout_s=5)
        entry = await a.kv.get(key)
        shares = msgspec.msgpack.decode(entry.value or b"", type=dict[str, Share])
        assert (shares["a"].held, shares["b"].held) == (2, 1)
        await a.stop()
        await b.stop()
    finally:
        await nc.close()


async def test_an_edge_whose_clock_is_a_minute_behind_still_counts_for_the_others(nats_server: EmbeddedNats) -> None:
    """Expiry is judged by when each edge saw an entry written, not by the writer's clock: an edge
    whose clock is behind (its entries' `expires` in the others' past) still holds its units for them."""
    nc = await connection.connect(nats_server.url, "test-leases")
    try:
        js = nc.jetstream()
        late, b = TenantLeases("late"), TenantLeases("b")
        late.wall = lambda: time.time() - 60
        await late.open(js)
        await b.open(js)
        key = lease_key("m", "t")
        late.bound("m", "t", 3)
        late.changed("m", "t", 0, 3)
        await eventually(lambda: _true(late.bound("m", "t", 3) == 3 and "late" in b.values.get(key, (0, {}))[1]))
        b.bound("m", "t", 3)
        b.changed("m", "t", 0, 3)  # both want all 3: the late edge gives units back, b gets them
        await eventually(lambda: _true(b.bound("m", "t", 3) > 0), timeout_s=5)
        assert (b.bound("m", "t", 3), late.bound("m", "t", 3)) == (2, 1)  # (fair_parts: the remainder to b)
        await late.stop()
        await b.stop()
    finally:
        await nc.close()


async def test_a_share_whose_expiry_is_no_time_still_expires(nats_server: EmbeddedNats) -> None:
    """No edge writes a NaN `expires`; one that is there (junk) counts for one TTL, like any entry seen once."""
    nc = await connection.connect(nats_server.url, "test-leases")
    try:
        b = TenantLeases("b", ttl_s=0.5)
        await b.open(nc.jetstream())
        key = lease_key("m", "t")
        await b.kv.put(key, msgspec.msgpack.encode({"ghost": Share(3, 3, float("nan"))}))
        await eventually(lambda: _true("ghost" in b.values.get(key, (0, {}))[1]))
        b.bound("m", "t", 3)
        b.changed("m", "t", 0, 3)
        await eventually(lambda: _true(b.bound("m", "t", 3) == 3), timeout_s=5)
        await b.stop()
    finally:
        await nc.close()
