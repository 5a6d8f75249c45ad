"""Reading the ledger: `iop usage` against a real edge, several edges, restarts, keys, readiness."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from contextlib import AsyncExitStack
from pathlib import Path

import pytest

from iop.contracts.usage import parse_query
from iop.edge.ledger import LEDGER_STREAM, RequestRecord
from iop.edge.tail import TAIL_PER_KEY, TailFeed
from iop.edge.usage_query import read_records
from iop.errors import Unavailable
from iop.nats.server import EmbeddedNats
from tests.harness import EdgeHandle, deployment, deployment_running, eventually, running_edge, until

MOCK = """
models: [{alias: sim, pool: [sim-1]}]
nodes:
  - id: n1
    adapters: [{id: sim, type: mock, latency_ms: 0, tokens: 4, token_interval_ms: 0}]
    providers: [{id: sim-1, adapter: sim, capacity: 2}]
"""
BODY = {"model": "sim", "messages": [{"role": "user", "content": "hi"}]}


async def written(h: EdgeHandle, n: int) -> None:
    ledger = h.edge.ledger
    assert ledger is not None
    await until(lambda: ledger.written >= n, ledger.changed, timeout_s=15)


async def all_records(h: EdgeHandle) -> list[RequestRecord]:
    got: list[RequestRecord] = []
    await read_records(h.edge.js, parse_query("1h", None, None), got.extend)
    return got


async def iop(*args: str) -> subprocess.CompletedProcess[str]:
    """`iop ARGS` as a real subprocess (off the event loop, which serves the edge meanwhile)."""
    command = [sys.executable, "-m", "iop", *args]
    return await asyncio.to_thread(subprocess.run, command, capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--since", "yesterday"], "--since"),
        (["--until", "5q"], "--until"),
        (["--since", "1h", "--until", "2h"], "--until"),
        (["--by", "model,colour"], "--by"),
        (["--json", "--csv"], "--json"),
    ],
)
async def test_iop_usage_refuses_bad_input_in_one_line_with_exit_2(args: list[str], named: str) -> None:
    done = await iop("usage", "--edge", "http://127.0.0.1:9", *args)
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1 and named in done.stderr and "Traceback" not in done.stderr


async def test_iop_usage_prints_the_table_csv_json_and_follows(nats_server: EmbeddedNats) -> None:
    async with deployment_running(deployment(MOCK), nats_server.url) as h, h.http() as http:
        for _ in range(3):
            assert (await http.post("/v1/chat/completions", json=BODY)).status_code == 200
        await written(h, 3)
        table = await iop("usage", "--edge", h.url, "--since", "1h", "--by", "model,provider")
        assert table.returncode == 0, table.stderr
        lines = table.stdout.splitlines()
        assert lines[1].split()[:5] == ["MODEL", "PROVIDER", "REQUESTS", "ERRORS", "TOKENS-IN"]
        assert lines[2].split()[:3] == ["sim", "sim-1", "3"] and lines[2].split()[5] == "12"
        csv = await iop("usage", "--edge", h.url, "--csv")
        assert csv.stdout.splitlines()[1].startswith("sim,3,0,")
        data = json.loads((await iop("usage", "--edge", h.url, "--json", "--by", "day")).stdout)
        assert data["rows"][0]["requests"] == 3 and data["by"] == ["day"]

        # Following from a time in the past replays what is there, then goes on live.
        follower = await asyncio.create_subprocess_exec(
            *[sys.executable, "-m", "iop", "usage", "--edge", h.url, "--tail", "--json", "--since", "1h"],
            stdout=subprocess.PIPE,
        )
        try:
            assert follower.stdout is not None
            async with asyncio.timeout(20):
                replayed = [json.loads(await follower.stdout.readline()) for _ in range(3)]
            assert [r["alias"] for r in replayed] == ["sim"] * 3
            r = await http.post("/v1/chat/completions", json=BODY, headers={"x-request-id": "followed-1"})
            assert r.status_code == 200
            async with asyncio.timeout(20):
                line = await follower.stdout.readline()
            assert json.loads(line)["id"] == "followed-1"
        finally:
            follower.kill()
            await follower.wait()


async def test_two_edges_write_one_ledger_that_survives_edge_and_nats_restarts(tmp_path: Path) -> None:
    store = tmp_path / "nats"
    server = EmbeddedNats("127.0.0.1:0", store)
    await server.start()
    dep = deployment(MOCK)
    try:
        async with deployment_running(dep, server.url) as h1, running_edge(dep, server.url) as h2:
            for h, tag in ((h1, "one"), (h2, "two")):
                async with h.http() as http:
                    for i in range(2):
                        r = await http.post("/v1/chat/completions", json=BODY, headers={"x-request-id": f"{tag}-{i}"})
                        assert r.status_code == 200
                await written(h, 2)
            edges = {r.edge for r in await all_records(h2)}
            assert edges == {h1.edge.edge_id, h2.edge.edge_id}
        await server.stop()
        server = EmbeddedNats("127.0.0.1:0", store)  # the new edge is given its address
        await server.start()
        # A new edge after both stopped and NATS restarted on its file store reads all four.
        async with running_edge(dep, server.url) as h3, h3.http() as http:
            r = await http.get("/usage", params={"since": "1h", "by": "model"})
            assert r.json()["rows"][0]["requests"] == 4
            assert sorted(x.id for x in await all_records(h3)) == ["one-0", "one-1", "two-0", "two-1"]
    finally:
        await server.stop()


async def test_key_names_reach_the_record_and_metrics_need_a_key(
    nats_server: EmbeddedNats, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("IOP_TEST_KEYS", "alice:k-alice,k-anon")
    dep = deployment("edge: {api_keys_env: IOP_TEST_KEYS}\n" + MOCK)
    async with deployment_running(dep, nats_server.url) as h, h.http() as http:
        for key in ("k-alice", "k-anon"):
            r = await http.post("/v1/chat/completions", json=BODY, headers={"authorization": f"Bearer {key}"})
            assert r.status_code == 200
        assert (await http.post("/v1/chat/completions", json=BODY)).status_code == 401
        assert (await http.get("/metrics")).status_code == 401
        assert (await http.get("/usage")).status_code == 401
        ok = await http.get("/metrics", headers={"authorization": "Bearer k-alice"})
        assert ok.status_code == 200 and 'iop_requests_total{alias="sim"' in ok.text
        await written(h, 2)
        keys = sorted(r.key for r in await all_records(h))
        # The 401 is counted and logged but not in the ledger; no key itself is ever stored.
        assert keys == ["alice", "client-2"]
        assert 'status="401"' in ok.text


async def test_metrics_public_serves_without_a_key(nats_server: EmbeddedNats, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IOP_TEST_KEYS", "k1")
    dep = deployment("edge: {api_keys_env: IOP_TEST_KEYS, metrics_public: true}\n" + MOCK)
    async with running_edge(dep, nats_server.url) as h, h.http() as http:
        r = await http.get("/metrics")
        assert r.status_code == 200 and "iop_provider_capacity" in r.text


async def test_readyz_needs_nats_and_a_usable_provider_in_every_pool(nats_server: EmbeddedNats) -> None:
    dep = deployment(MOCK)
    async with running_edge(dep, nats_server.url) as h, h.http() as http:
        r = await http.get("/readyz")
        assert r.status_code == 503 and r.json()["reasons"] == ["pool 'sim' has no usable provider"]
        assert (await http.get("/healthz")).status_code == 200  # alive all the same
        from tests.harness import running_node

        async with running_node(dep, "n1", nats_server.url):
            await h.edge.registry.wait_connected(["n1"], timeout_s=10)
            r = await http.get("/readyz")
            assert r.status_code == 200 and r.json() == {"ready": True, "reasons": []}


async def test_request_ids_are_returned_generated_and_refused_when_unsafe(nats_server: EmbeddedNats) -> None:
    async with deployment_running(deployment(MOCK), nats_server.url) as h, h.http() as http:
        r = await http.post("/v1/chat/completions", json=BODY)
        assert r.headers["x-request-id"].startswith("req_")
        assert (await http.get("/v1/models")).headers["x-request-id"].startswith("req_")
        r = await http.post("/v1/chat/completions", json=BODY, headers={"x-request-id": "a b"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "x-request-id"
        r = await http.post("/v1/chat/completions", json=BODY, headers={"x-request-id": "x" * 129})
        assert r.status_code == 400


async def test_a_client_reads_only_its_own_usage_and_an_admin_reads_all(
    nats_server: EmbeddedNats, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("IOP_TEST_KEYS", "alice:k-alice,bob:k-bob")
    monkeypatch.setenv("IOP_TEST_ADMIN", "ops:k-ops")
    dep = deployment("edge: {api_keys_env: IOP_TEST_KEYS, admin_keys_env: IOP_TEST_ADMIN}\n" + MOCK)
    async with deployment_running(dep, nats_server.url) as h, h.http() as http:
        for key in ("k-alice", "k-bob", "k-bob"):
            r = await http.post("/v1/chat/completions", json=BODY, headers={"authorization": f"Bearer {key}"})
            assert r.status_code == 200
        # Without a key nothing is learnt, not even which methods exist, and nothing is recorded.
        for _ in range(3):
            assert (await http.get("/v1/chat/completions")).status_code == 401
        await written(h, 3)
        assert sorted(r.key for r in await all_records(h)) == ["alice", "bob", "bob"]

        def by_key(r: object) -> dict[str, int]:
            assert hasattr(r, "json")
            return {row["key"]: row["requests"] for row in r.json()["rows"]}

        as_alice = await http.get("/usage?by=key", headers={"authorization": "Bearer k-alice"})
        assert as_alice.status_code == 200 and by_key(as_alice) == {"alice": 1}
        as_ops = await http.get("/usage?by=key", headers={"authorization": "Bearer k-ops"})
        assert as_ops.status_code == 200 and by_key(as_ops) == {"alice": 1, "bob": 2}
        assert (await http.get("/usage")).status_code == 401


async def ledger_consumers(h: EdgeHandle) -> int:
    return int((await h.edge.js.stream_info(LEDGER_STREAM)).state.consumer_count)


async def test_usage_tail_followers_share_one_consumer_and_are_limited_per_key_and_in_total(
    nats_server: EmbeddedNats, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("IOP_TEST_KEYS", "alice:k-alice,bob:k-bob")
    dep = deployment("edge: {api_keys_env: IOP_TEST_KEYS}\n" + MOCK)
    alice, bob = ({"authorization": f"Bearer k-{n}"} for n in ("alice", "bob"))
    async with deployment_running(dep, nats_server.url) as h, h.http() as http, AsyncExitStack() as tails:
        before = await ledger_consumers(h)
        followers = []
        for headers in [alice] * TAIL_PER_KEY + [bob]:
            r = await tails.enter_async_context(http.stream("GET", "/usage/tail", headers=headers))
            assert r.status_code == 200
            followers.append(r.aiter_lines())
        # One more for alice is refused; bob is not held back by her.
        r = await http.get("/usage/tail", headers=alice)
        assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_followers", r.text
        # Five followers, one consumer: what one status page follower costs.
        assert await ledger_consumers(h) == before + 1
        assert (await http.post("/v1/chat/completions", json=BODY, headers=alice)).status_code == 200
        for lines in followers[:TAIL_PER_KEY]:
            async with asyncio.timeout(10):
                assert json.loads(await anext(lines))["key"] == "alice"
        await tails.aclose()

        async def none_left() -> bool:
            return await ledger_consumers(h) == before

        await eventually(none_left)  # the last follower gone, the shared consumer goes too
        # The total: a feed of this edge's ledger with room for two followers takes no third.
        feed = TailFeed(h.edge.js, per_key=10, total=2)
        held = [await feed.join(None, None, None), await feed.join("alice", None, None)]
        with pytest.raises(Unavailable) as refused:
            await feed.join("bob", None, None)
        assert refused.value.code == "too_many_followers" and refused.value.status == 503
        for f in held:
            await feed.leave(f)
        await eventually(none_left)
