"""What a node credential could put into the edge's streams through the reply subject of a JetStream
request it may make (see docs/security.md, "Nodes in accounts of their own"): the server delivers its
answer wherever the request says. In the edge's account such an answer would land in a KV bucket,
another provider's queue or another node's subject; each node's requests come from an account of
its own, where those subjects are nobody's."""

from __future__ import annotations

import pytest

from iop import wire
from iop.errors import IopError
from iop.nats import connection
from iop.nats.server import EmbeddedNats
from iop.node.catalog import CatalogSource
from tests.harness import deployment, running_edge
from tests.test_security import TWO_NODES, rogue

BUCKETS = ("KV_iop_catalog", "KV_iop_responses", "KV_iop_qualify")


async def test_a_node_s_jetstream_answers_land_only_in_its_own_account(nats_server: EmbeddedNats) -> None:
    dep = deployment(TWO_NODES.replace("UPSTREAM", "http://127.0.0.1:9"))
    await nats_server.authorize(dep.nodes)
    async with running_edge(dep, nats_server.url) as h, rogue(nats_server, "a") as a, rogue(nats_server, "b") as b:
        js = h.edge.js
        # No callback: what arrives stays counted in the subscription's queue.
        subs = [
            await b.nc.subscribe(subject)
            for subject in (wire.cancel_subject("b"), wire.credit_subject("b"), wire.catalog_subject("b"))
        ]
        await connection.flush(b.nc)
        before = {name: (await js.stream_info(name)).state.messages for name in BUCKETS}
        other = wire.consumer_name("b-prov")
        queued = (await js.consumer_info(wire.WORK_STREAM, other)).num_pending
        own = "$JS.API.DIRECT.GET.KV_iop_catalog.$KV.iop_catalog.a"  # requests node a may make
        pull = f"$JS.API.CONSUMER.MSG.NEXT.{wire.WORK_STREAM}.{wire.consumer_name('a-prov')}"
        for reply in (
            "$KV.iop_catalog.b",  # another node's catalog
            "$KV.iop_responses.r.owner.resp_junk",  # a stored response of somebody's
            "$KV.iop_qualify.junk",
            wire.work_subject("b-prov"),  # another provider's queue
            wire.cancel_subject("b"),  # another node's subjects
            wire.credit_subject("b"),
            wire.catalog_subject("b"),
        ):
            await a.nc.publish(own, b"", reply=reply)
            await a.nc.publish(pull, b'{"batch": 1, "no_wait": true}', reply=reply)
        await connection.flush(a.nc)
        got = await CatalogSource(a.nc, "a").get()  # answered after everything sent before it
        assert got is not None and got[1].id == "a"
        after = {name: (await js.stream_info(name)).state.messages for name in BUCKETS}
        assert after == before
        assert (await js.consumer_info(wire.WORK_STREAM, other)).num_pending == queued
        await connection.flush(b.nc)
        assert (await CatalogSource(b.nc, "b").get()) is not None  # b's own key: still the edge's entry
        assert [sub.pending_msgs for sub in subs] == [0, 0, 0]


async def test_a_node_whose_catalog_entry_is_not_json_says_so_and_takes_the_next_one(nats_server: EmbeddedNats) -> None:
    # What lands there through a reply subject may be any bytes (a work item is msgpack, not JSON).
    dep = deployment(TWO_NODES.replace("UPSTREAM", "http://127.0.0.1:9"))
    await nats_server.authorize(dep.nodes)
    async with running_edge(dep, nats_server.url) as h, rogue(nats_server, "b") as b:
        kv = await h.edge.js.key_value("iop_catalog")
        good = (await kv.get("b")).value
        assert good is not None
        await kv.put("b", b"\x85\xa1not json")
        source = CatalogSource(b.nc, "b")
        with pytest.raises(IopError, match="unreadable"):
            await source.get()  # follow() logs this one and goes on; before, it ended following
        await kv.put("b", good)
        got = await source.get()
        assert got is not None and got[1].id == "b"
