"""What a node credential can put into the edge's KV buckets through the reply subject of a JetStream
request it may make (see docs/security.md, "Known limits"): the server delivers its answer wherever the
request says, and a bucket stores whatever arrives on `$KV.<bucket>.>`. Open until nodes live in their
own NATS account; this test flips to passing (and strict xfail then fails) when that is closed."""

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


@pytest.mark.xfail(
    strict=True,
    reason="open: a node's JetStream request may name $KV.<bucket>.<key> as its reply subject; the fix is "
    "nodes in their own NATS account importing only the JetStream API they need",
)
async def test_a_node_credential_cannot_write_another_nodes_catalog_or_the_response_bucket(
    nats_server: EmbeddedNats,
) -> None:
    dep = deployment(TWO_NODES.replace("UPSTREAM", "http://127.0.0.1:9"))
    await nats_server.authorize(dep.nodes)
    async with running_edge(dep, nats_server.url) as h, rogue(nats_server, "a") as a:
        js = h.edge.js
        before = {name: (await js.stream_info(name)).state.messages for name in BUCKETS}
        info = f"$JS.API.STREAM.INFO.{wire.WORK_STREAM}"  # a request node a may make
        pull = f"$JS.API.CONSUMER.MSG.NEXT.{wire.WORK_STREAM}.{wire.consumer_name('a-prov')}"
        for reply in ("$KV.iop_catalog.b", "$KV.iop_responses.r.owner.resp_junk", "$KV.iop_qualify.junk"):
            await a.nc.publish(info, b"", reply=reply)
            await a.nc.publish(pull, b'{"batch": 1, "no_wait": true}', reply=reply)
        await connection.flush(a.nc)
        await a.nc.request(info, b"", timeout=5)  # answered after everything sent before it
        after = {name: (await js.stream_info(name)).state.messages for name in BUCKETS}
        assert after == before  # today: node b's catalog entry is a stream-info answer, and both buckets grew


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
