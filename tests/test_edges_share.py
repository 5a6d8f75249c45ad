"""Two edges on one pool: each sees the slots the other holds (from the nodes' heartbeats).

These deployments bind every request when a slot frees (`standby: 0`): what they prove is where
each edge's late binding puts a request; standby across edges is tests/test_standby.py's."""

from __future__ import annotations

import asyncio
import logging

import pytest

from iop import wire
from iop.nats import connection
from iop.nats.server import EmbeddedNats
from tests.fakes import fake_upstream
from tests.harness import deployment, eventually, running_edge, running_node, two_edges, until


def ask(content: str) -> dict[str, object]:
    return {"model": "m", "messages": [{"role": "user", "content": content}]}


async def test_an_edge_dispatches_where_the_other_edge_left_a_slot_free(nats_server: EmbeddedNats) -> None:
    url = nats_server.url
    gate = asyncio.Event()
    async with fake_upstream(gate=gate) as up_x, fake_upstream(gate=gate) as up_y:
        dep = deployment(f"""
edge:
  queue: {{timeout_s: 30, max_waiting: 100, standby: 0}}
models: [{{alias: m, pool: [x, y]}}]
nodes:
  - id: n
    adapters:
      - {{id: ux, type: openai, base_url: "{up_x.url}", api: both}}
      - {{id: uy, type: openai, base_url: "{up_y.url}", api: both}}
    providers: [{{id: x, adapter: ux, capacity: 1}}, {{id: y, adapter: uy, capacity: 1}}]
""")
        async with two_edges(dep, url) as (e1, e2, http1, http2):
            first = asyncio.create_task(http1.post("/v1/chat/completions", json=ask("one")))
            # Checked on every heartbeat (each second): the request has reached its upstream.
            await until(lambda: up_x.in_flight + up_y.in_flight == 1, e1.edge.registry.changed)
            held = "x" if up_x.in_flight else "y"
            free = "y" if held == "x" else "x"
            s2 = e2.edge.scheduler
            # The node's next heartbeat tells the second edge that the first holds `held`.
            await until(lambda: s2.providers[held].elsewhere == 1, e2.edge.registry.changed)
            assert s2.providers[held].free == 0 and s2.providers[free].free == 1

            # Two requests at the second edge: one goes to the free provider, the other waits in
            # this edge's FIFO (not in the broker behind the first edge's request).
            more = [asyncio.create_task(http2.post("/v1/chat/completions", json=ask(f"two{i}"))) for i in range(2)]
            await until(lambda: s2.waiting("m") == 1, s2.changed)
            assert s2.providers[free].in_flight == 1 and s2.providers[held].in_flight == 0
            await until(lambda: up_x.in_flight + up_y.in_flight == 2, e2.edge.registry.changed, timeout_s=5)

            gate.set()
            answers = [await t for t in (first, *more)]
            assert [a.status_code for a in answers] == [200, 200, 200]
            assert up_x.peak == 1 and up_y.peak == 1
            # Once the first edge's request is done, the heartbeat clears what the second edge counted.
            await until(lambda: s2.providers[held].elsewhere == 0, e2.edge.registry.changed)


ONE_SLOT = """
edge:
  queue: {timeout_s: 30, max_waiting: 100, standby: 0}
models: [{alias: m, pool: [x]}]
nodes:
  - id: n
    adapters: [{id: ux, type: openai, base_url: "URL", api: both}]
    providers: [{id: x, adapter: ux, capacity: 1}]
"""


async def test_a_slot_another_edge_frees_reaches_this_edges_waiter_without_a_heartbeat(
    nats_server: EmbeddedNats,
) -> None:
    """The edges tell each other what they take and free (iop.edges.slots): no heartbeat in between."""
    url = nats_server.url
    async with fake_upstream() as up:
        dep = deployment(ONE_SLOT.replace("URL", up.url))
        async with two_edges(dep, url) as (_, e2, http1, http2):
            s2 = e2.edge.scheduler
            node_seen = e2.edge.registry.nodes["n"]
            # A heartbeat may land between a slot's release and the grant by chance (a few ms of each
            # second): such a round proves nothing either way, and the next one is tried.
            proven = 0
            for i in range(3):
                await up.wait_for(lambda u: u.in_flight == 0)
                await eventually(lambda: _true(s2.providers["x"].elsewhere == 0))
                up.gate = asyncio.Event()
                first = asyncio.create_task(http1.post("/v1/chat/completions", json=ask(f"hold{i}")))
                await up.wait_for(lambda u: u.in_flight == 1)
                await eventually(lambda: _true(s2.providers["x"].elsewhere == 1))
                second = asyncio.create_task(http2.post("/v1/chat/completions", json=ask(f"wait{i}")))
                await until(lambda: s2.waiting("m") == 1, s2.changed)
                heartbeat = node_seen.last_seen_mono
                up.gate.set()
                await until(lambda: not s2.pools["m"].waiters, s2.changed)
                if node_seen.last_seen_mono == heartbeat:
                    proven += 1
                assert (await first).status_code == 200 and (await second).status_code == 200
                if proven:
                    break
            assert proven, "each grant came only after a node heartbeat"
            assert up.peak == 1


async def test_an_edge_that_stops_announcing_is_counted_from_the_heartbeats(nats_server: EmbeddedNats) -> None:
    """An edge gone without a word (here: only its announcements stopped) still holds its slots."""
    url = nats_server.url
    async with fake_upstream(gate=asyncio.Event()) as up:
        dep = deployment(ONE_SLOT.replace("URL", up.url))
        async with two_edges(dep, url) as (e1, e2, http1, _):
            share2 = e2.edge.registry.share
            await eventually(lambda: _true(e1.edge.edge_id in share2.announced))
            await e1.edge.registry.share.stop()
            first = asyncio.create_task(http1.post("/v1/chat/completions", json=ask("silent")))
            await up.wait_for(lambda u: u.in_flight == 1)
            # Once silent for EDGE_SLOTS_SILENT_S, its word no longer counts; the node's heartbeat does.
            s2 = e2.edge.scheduler
            await until(lambda: s2.providers["x"].elsewhere == 1, e2.edge.registry.changed, timeout_s=10)
            # The count goes by the silence at once; the periodic sweep forgets the edge itself a
            # moment later (a heartbeat can land between the two).
            await eventually(lambda: _true(e1.edge.edge_id not in share2.announced))
            assert up.gate is not None
            up.gate.set()
            assert (await first).status_code == 200
            await until(lambda: s2.providers["x"].elsewhere == 0, e2.edge.registry.changed)


async def _true(value: bool) -> bool:
    return value


async def test_an_announcement_past_a_providers_capacity_counts_as_oversubscribed(nats_server: EmbeddedNats) -> None:
    """Another edge (here: its message, sent by the test) took the slot this edge holds: counted and shown."""
    url = nats_server.url
    async with fake_upstream(gate=asyncio.Event()) as up:
        dep = deployment(ONE_SLOT.replace("URL", up.url))
        async with running_edge(dep, url) as e, running_node(dep, "n", url), e.http() as http:
            await e.edge.registry.wait_connected(["n"], timeout_s=10)
            first = asyncio.create_task(http.post("/v1/chat/completions", json=ask("mine")))
            await up.wait_for(lambda u: u.in_flight == 1)
            nc = await connection.connect(url, "test-other-edge")
            try:
                share, x = e.edge.registry.share, e.edge.scheduler.providers["x"]
                await nc.publish(wire.EDGE_SLOTS_SUBJECT, wire.encode(wire.EdgeSlots("other", True, {"x": 1})))
                await eventually(lambda: _true(x.elsewhere == 1))
                assert share.oversubscribed == {"x": 1}
                metrics = (await http.get("/metrics")).text
                assert 'iop_provider_oversubscribed_total{node="n",provider="x"} 1.0' in metrics
                assert 'iop_provider_elsewhere{node="n",provider="x"} 1.0' in metrics
                # The same count again is no new request past the cap; its slot freed, nothing is held there.
                await nc.publish(wire.EDGE_SLOTS_SUBJECT, wire.encode(wire.EdgeSlots("other", False, {"x": 1})))
                await nc.publish(wire.EDGE_SLOTS_SUBJECT, wire.encode(wire.EdgeSlots("other", False, {"x": 0})))
                await eventually(lambda: _true(x.elsewhere == 0))
                assert share.oversubscribed == {"x": 1}
            finally:
                await nc.close()
            assert up.gate is not None
            up.gate.set()
            assert (await first).status_code == 200


async def test_an_announcement_of_fewer_than_no_slots_counts_as_none(nats_server: EmbeddedNats) -> None:
    """Counts below 0 (no edge sends them) would make a provider look freer than its capacity: 0."""
    url = nats_server.url
    dep = deployment(ONE_SLOT.replace("URL", "http://127.0.0.1:9"))
    async with running_edge(dep, url) as e:
        nc = await connection.connect(url, "test-other-edge")
        try:
            share, x = e.edge.registry.share, e.edge.scheduler.providers["x"]
            await nc.publish(wire.EDGE_SLOTS_SUBJECT, wire.encode(wire.EdgeSlots("other", True, {"x": -3})))
            await nc.publish(wire.EDGE_SLOTS_SUBJECT, wire.encode(wire.EdgeSlots("late", True, {"x": 0})))
            await eventually(lambda: _true(share.received == 2))
            assert x.elsewhere == 0
        finally:
            await nc.close()


async def test_junk_on_the_announcements_subject_is_logged_once_not_per_message(
    nats_server: EmbeddedNats, caplog: pytest.LogCaptureFixture
) -> None:
    """A node can have the JetStream server answer onto `iop.edges.slots` (docs/security.md): one line
    says so, however many come; real announcements are still heard."""
    url = nats_server.url
    dep = deployment(ONE_SLOT.replace("URL", "http://127.0.0.1:9"))
    async with running_edge(dep, url) as e:
        nc = await connection.connect(url, "test-other-edge")
        try:
            share = e.edge.registry.share
            with caplog.at_level(logging.WARNING, "iop.edge"):
                for _ in range(20):
                    await nc.publish(
                        wire.EDGE_SLOTS_SUBJECT, b'{"type":"io.nats.jetstream.api.v1.stream_info_response"}'
                    )
                await nc.publish(wire.EDGE_SLOTS_SUBJECT, wire.encode(wire.EdgeSlots("other", True, {"x": 1})))
                await eventually(lambda: _true(share.received == 1))
            assert sum("undecodable" in r.getMessage() for r in caplog.records) == 1
            assert share.undecodable.count == 20
        finally:
            await nc.close()


async def test_waiters_of_an_edge_not_yet_heard_in_full_wait_for_its_full_announcement(
    nats_server: EmbeddedNats,
) -> None:
    """A change from an edge this one has no full word of yet (it missed it, or started since) is not
    kept: were that edge to die before its next full one, nothing would ever forget its waiters, and
    they would keep taking slots' turns here."""
    url = nats_server.url
    dep = deployment(ONE_SLOT.replace("URL", "http://127.0.0.1:9"))
    async with running_edge(dep, url) as e:
        nc = await connection.connect(url, "test-other-edge")
        try:
            share = e.edge.registry.share
            waiting = {"m": [("quiet", 1, 1.0, 1, 0)]}
            await nc.publish(wire.EDGE_SLOTS_SUBJECT, wire.encode(wire.EdgeSlots("ghost", False, {}, waiting)))
            await eventually(lambda: _true(share.received == 1))
            assert "ghost" not in share.fair.elsewhere
            await nc.publish(wire.EDGE_SLOTS_SUBJECT, wire.encode(wire.EdgeSlots("ghost", True, {}, waiting)))
            await eventually(lambda: _true(share.received == 2))
            assert share.fair.elsewhere["ghost"] == {"m": [("quiet", 1, 1.0, 1, 0)]}
        finally:
            await nc.close()
