"""A refresh that adds a node or a provider gives it a NATS account that works at once: its pulls,
acks and catalog read reach the edge's JetStream through the imports the reload made
(iop/nats/auth.py; the embedded server reloads twice, see EmbeddedNats.authorize)."""

from __future__ import annotations

import secrets
from pathlib import Path

import nats
import pytest

from iop import config
from iop.errors import BusError
from iop.nats import auth
from iop.nats.server import EmbeddedNats
from tests.harness import deployment, nats_server_of, running_edge, running_node

BEFORE = """
models:
  - {alias: a-pool, pool: [a-prov]}
nodes:
  - id: a
    adapters: [{id: sim, type: mock, latency_ms: 0, tokens: 3, token_interval_ms: 0}]
    providers: [{id: a-prov, adapter: sim, capacity: 1}]
"""
AFTER = (
    BEFORE.replace(
        "  - {alias: a-pool, pool: [a-prov]}",
        "  - {alias: a-pool, pool: [a-prov]}\n  - {alias: a2-pool, pool: [a-two]}\n  - {alias: b-pool, pool: [b-prov]}",
    ).replace(
        "providers: [{id: a-prov, adapter: sim, capacity: 1}]",
        "providers: [{id: a-prov, adapter: sim, capacity: 1}, {id: a-two, adapter: sim, capacity: 1}]",
    )
    + """  - id: b
    adapters: [{id: sim, type: mock, latency_ms: 0, tokens: 3, token_interval_ms: 0}]
    providers: [{id: b-prov, adapter: sim, capacity: 1}]
"""
)


async def test_a_node_and_a_provider_added_by_a_refresh_serve_through_their_own_account(
    nats_server: EmbeddedNats,
) -> None:
    before, after = deployment(BEFORE), deployment(AFTER)
    await nats_server.authorize(before.nodes)
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    access = nats_server.node_access
    async with (
        running_edge(before, nats_server.url) as h,
        running_node(before, "a", nats_server.address, access=access("a")),
        h.http() as http,
    ):
        await h.edge.registry.wait_connected(["a"], timeout_s=10)
        assert (await http.post("/v1/chat/completions", json={**chat, "model": "a-pool"})).status_code == 200
        await nats_server.authorize(after.nodes)  # what the edge's refresh does before it writes the catalog
        result = await h.edge.refresher.apply(after)
        assert result.error is None, result
        async with running_node(after, "b", nats_server.address, access=access("b")):
            await h.edge.registry.wait_connected(["a", "b"], timeout_s=10)
            for model in ("b-pool", "a2-pool", "a-pool"):
                r = await http.post("/v1/chat/completions", json={**chat, "model": model})
                assert r.status_code == 200, (model, r.text)


OLD_SERVER = (
    'host: "127.0.0.1"\nport: -1\njetstream {{ store_dir: "{store}" }}\n'
    'authorization {{ users: [{{user: old, password: "{password}"}}] }}\n'
)


async def test_a_store_from_before_node_accounts_is_moved_to_the_edge_s_account(tmp_path: Path) -> None:
    store = tmp_path / "nats"
    store.mkdir()
    password = secrets.token_hex(16)
    conf = tmp_path / "old.conf"
    conf.write_text(OLD_SERVER.format(store=store, password=password))
    # What an iop before accounts wrote: its streams in NATS's global account.
    async with nats_server_of(conf) as port:
        nc = await nats.connect(f"nats://127.0.0.1:{port}", user="old", password=password)
        kv = await nc.jetstream().create_key_value(bucket="iop_responses")
        await kv.put("r.owner.resp_1", b"kept")
        await nc.close()
    assert (store / "jetstream" / "$G").is_dir()

    server = EmbeddedNats("127.0.0.1:0", store)
    await server.start()
    try:
        nc = await nats.connect(server.url)
        entry = await (await nc.jetstream().key_value("iop_responses")).get("r.owner.resp_1")
        assert entry.value == b"kept"
        await nc.close()
    finally:
        await server.stop()
    assert not (store / "jetstream" / "$G").exists() and (store / "jetstream" / auth.EDGE_ACCOUNT).is_dir()


async def test_a_cluster_member_on_a_store_from_before_node_accounts_says_so_and_does_not_start(tmp_path: Path) -> None:
    store = tmp_path / "nats"
    (store / "jetstream" / "$G" / "streams").mkdir(parents=True)
    cluster = config.ClusterSettings(name="iop", listen="127.0.0.1:0", server_name="m1")
    server = EmbeddedNats("127.0.0.1:0", store, cluster=cluster)
    with pytest.raises(BusError, match=r"global account \(\$G\).*cluster cannot move it in place"):
        await server.start()
    assert server.pid is None and (store / "jetstream" / "$G").is_dir()
    await server.stop()
