"""The work stream gone or unusable under a running edge: recovery, and what health and status say.

These tests take the stream away for real on a real nats-server: deleted, or replaced by one that
cannot hold the work. A really full disk (a filled tmpfs, root only) is in test_edge_process.py.
"""

from __future__ import annotations

from nats.js.api import StreamConfig

from iop import wire
from iop.nats import streams
from iop.nats.server import EmbeddedNats
from tests.harness import deployment, deployment_running, eventually

YAML = """
models: [{alias: m, pool: [p]}]
nodes:
  - id: n
    adapters: [{id: sim, type: mock, latency_ms: 0, tokens: 2, token_interval_ms: 0}]
    providers: [{id: p, adapter: sim, capacity: 2}]
"""
CHAT = {"model": "m", "messages": [{"role": "user", "content": "x"}]}


async def test_work_stream_deleted_under_a_running_edge_is_recreated_and_requests_go_on(
    nats_server: EmbeddedNats,
) -> None:
    async with deployment_running(deployment(YAML), nats_server.url) as h, h.http() as http:
        assert (await http.post("/v1/chat/completions", json=CHAT)).status_code == 200
        await h.edge.js.delete_stream(wire.WORK_STREAM)
        # Before: 503 bus_error ("no response from stream") for every pool request, until a restart.
        for _ in range(3):
            r = await http.post("/v1/chat/completions", json=CHAT)
            assert r.status_code == 200, r.text
        info = await h.edge.js.consumer_info(wire.WORK_STREAM, wire.consumer_name("p"))
        assert info.config.max_ack_pending == 2
        assert (await http.get("/healthz")).json()["ok"] is True
        assert (await h.status()).edge.storage_error is None
        print(f"\nwork stream deleted: re-created {h.edge.work_stream.repairs} time(s), requests served")


async def test_an_unusable_work_stream_is_reported_in_healthz_and_status_until_it_recovers(
    nats_server: EmbeddedNats,
) -> None:
    # A publish that fails is retried until the request's deadline (a cluster may be electing a
    # stream leader): a short queue timeout keeps the test short.
    dep = deployment("edge: {queue: {timeout_s: 1}}\n" + YAML)
    async with deployment_running(dep, nats_server.url) as h, h.http() as http:
        js = h.edge.js
        await js.delete_stream(wire.WORK_STREAM)
        # A stream of that name that cannot hold the work: the provider's consumer cannot be made.
        await js.add_stream(StreamConfig(name=wire.WORK_STREAM, subjects=["elsewhere.>"]))
        r = await http.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 503 and r.json()["error"]["code"] == "bus_error"
        health = await http.get("/healthz")
        # Before: /healthz said ok while every pool request failed.
        assert health.status_code == 503 and health.json()["storage"] is False
        assert "work stream" in health.json()["reason"]
        status = await h.status()
        assert status.edge.storage_error is not None and "work stream" in status.edge.storage_error
        # The operator frees what was wrong: requests find the stream usable again (a failed repair
        # is not tried again for REPAIR_AGAIN_S, so that waiting requests do not all retry it).
        await js.delete_stream(wire.WORK_STREAM)

        async def served() -> bool:
            return (await http.post("/v1/chat/completions", json=CHAT)).status_code == 200

        took = await eventually(served, timeout_s=10, every_s=0.1)
        print(f"\nunusable work stream reported; served again {took:.2f}s after it was freed")
        assert (await http.get("/healthz")).status_code == 200


async def test_healthz_clears_a_storage_error_by_itself_once_the_stream_is_usable(nats_server: EmbeddedNats) -> None:
    dep = deployment("edge: {queue: {timeout_s: 1}}\n" + YAML)
    async with deployment_running(dep, nats_server.url) as h, h.http() as http:
        js = h.edge.js
        await js.delete_stream(wire.WORK_STREAM)
        await js.add_stream(StreamConfig(name=wire.WORK_STREAM, subjects=["elsewhere.>"]))
        assert (await http.post("/v1/chat/completions", json=CHAT)).status_code == 503
        await js.delete_stream(wire.WORK_STREAM)

        # No pool request comes: /healthz itself checks again (at most once a second).
        async def healthy() -> bool:
            return (await http.get("/healthz")).status_code == 200

        took = await eventually(healthy, timeout_s=10, every_s=0.1)
        print(f"\nstorage error cleared by /healthz alone {took:.2f}s after the stream was freed")
        assert (await h.status()).edge.storage_error is None
        assert (await http.post("/v1/chat/completions", json=CHAT)).status_code == 200
        assert (await h.status()).edge.storage_error is None
        await streams.ensure_work_stream(js)  # idempotent: the edge left the stream as it should be
