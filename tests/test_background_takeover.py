"""A background response outlives its edge: when the edge that runs it stops, or dies (SIGKILL), or
dies and starts again, another edge runs it again and the store keeps its one answer, for the key
that asked (iop/responses/takeover.py)."""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from iop import config
from iop.edge.keys import EdgeKeys, Key
from iop.nats import connection
from iop.nats.access import SECRET_FILE, Credentials
from iop.nats.server import EmbeddedNats
from iop.responses import takeover
from iop.responses.records import Stored
from iop.responses.store import ResponseStore, owner_of
from tests.fakes import bound_socket, fake_upstream
from tests.harness import EdgeHandle, deployment, edge_process, eventually, running_edge, running_node, sse_events

KEY_A = "sk-client-a-0123456789"
KEY_B = "sk-client-b-0123456789"
DEPLOYMENT = """
edge: {{api_keys_env: IOP_TEST_KEYS}}
models: [{{alias: m, pool: [p]}}]
nodes:
  - id: n
    adapters: [{{id: up, type: openai, base_url: "{url}", api: chat}}]
    providers: [{{id: p, adapter: up, model: served-model, capacity: 2}}]
"""


CLUSTER = """
edge: {{api_keys_env: IOP_TEST_KEYS, nats: {{url: "{nats}", replicas: 3}}}}
models: [{{alias: m, pool: [p]}}]
nodes:
  - id: n
    adapters: [{{id: up, type: openai, base_url: "{url}", api: chat}}]
    providers: [{{id: p, adapter: up, model: served-model, capacity: 2}}]
"""


@asynccontextmanager
async def three_servers(base: Path) -> AsyncIterator[list[EmbeddedNats]]:
    """A 3-server NATS cluster (JetStream R3), ready for streams."""
    socks = [bound_socket() for _ in range(3)]
    routes = [f"127.0.0.1:{s.getsockname()[1]}" for s in socks]
    for sock in socks:
        sock.close()
    servers = []
    for i, listen in enumerate(routes):
        store = base / f"s{i}"
        store.mkdir(parents=True)
        if i == 0:
            Credentials.load(store)  # the members share one secret
        else:
            shutil.copy(base / "s0" / SECRET_FILE, store / SECRET_FILE)
        cluster = config.ClusterSettings(name="takeover", listen=listen, routes=routes, server_name=f"s{i}")
        servers.append(EmbeddedNats("127.0.0.1:0", store, cluster=cluster))
    try:
        await asyncio.gather(*(s.start() for s in servers))
        nc = await connection.connect(",".join(s.url for s in servers), "test-cluster", wait_s=10)
        try:
            await connection.wait_jetstream(nc, 30)
        finally:
            await nc.close()
        yield servers
    finally:
        for s in servers:
            await s.stop()


@pytest.fixture(autouse=True)
def keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IOP_TEST_KEYS", f"a:{KEY_A}, b:{KEY_B}")


def auth(key: str = KEY_A) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def start(http: httpx.AsyncClient, key: str = KEY_A) -> dict[str, Any]:
    r = await http.post("/v1/responses", json={"model": "m", "input": "hi", "background": True}, headers=auth(key))
    assert r.status_code == 200, r.text
    queued: dict[str, Any] = r.json()
    assert queued["status"] == "queued"
    return queued


async def completed(http: httpx.AsyncClient, response_id: str, timeout_s: float = 60) -> dict[str, Any]:
    """The response once an edge polled through `http` says it completed."""
    got: dict[str, Any] = {}

    async def done() -> bool:
        nonlocal got
        got = (await http.get(f"/v1/responses/{response_id}", headers=auth())).json()
        return got.get("status") not in ("queued", "in_progress")

    await eventually(done, timeout_s=timeout_s, every_s=0.2)
    return got


def text_of(response: dict[str, Any]) -> str:
    return str(response["output"][0]["content"][0]["text"])


async def test_background_takeover_of_a_stopping_edge_completes_on_another(nats_server: EmbeddedNats) -> None:
    gate = asyncio.Event()
    async with fake_upstream(api="chat", gate=gate) as up:
        dep = deployment(DEPLOYMENT.format(url=up.url))
        try:
            async with running_node(dep, "n", nats_server.url), running_edge(dep, nats_server.url) as other:
                async with running_edge(dep, nats_server.url) as first, first.http() as http:
                    await first.edge.registry.wait_connected(["n"], timeout_s=10)
                    queued = await start(http)
                    await up.wait_for(lambda u: u.in_flight == 1)
                # The first edge released it when it stopped: the other runs it again at once.
                await up.wait_for(lambda u: u.total == 2, timeout_s=30)
                gate.set()
                async with other.http() as http:
                    final = await completed(http, queued["id"])
                    assert (final["status"], final["id"], text_of(final)) == ("completed", queued["id"], "w0 w1 w2")
                    assert (await http.get(f"/v1/responses/{queued['id']}", headers=auth(KEY_B))).status_code == 404
                    await eventually(lambda: _no_lease(other.edge), timeout_s=10)
        finally:
            gate.set()


async def test_background_takeover_of_a_revoked_key_keeps_it_failed_and_runs_nothing(
    nats_server: EmbeddedNats,
) -> None:
    gate = asyncio.Event()
    async with fake_upstream(api="chat", gate=gate) as up:
        dep = deployment(DEPLOYMENT.format(url=up.url))
        try:
            async with running_node(dep, "n", nats_server.url), running_edge(dep, nats_server.url) as other:
                async with running_edge(dep, nats_server.url) as first, first.http() as http:
                    await first.edge.registry.wait_connected(["n"], timeout_s=10)
                    made = (await http.post("/admin/keys", json={"name": "bot"})).json()
                    response_id = (await start(http, made["key"]))["id"]
                    await up.wait_for(lambda u: u.in_flight == 1)
                    assert (await http.delete(f"/admin/keys/{made['id']}")).status_code == 200

                    async def revoked_there() -> bool:
                        return made["id"] not in other.edge.managed_keys.by_id

                    await eventually(revoked_there)
                # The first edge released it when it stopped: the other claims it, and refuses to run it.
                await _refused(other, owner_of(made["key"].encode()), response_id)
                assert up.total == 1  # only the first run's request reached the upstream
        finally:
            gate.set()


async def test_background_takeover_by_an_edge_without_its_env_key_keeps_it_failed(nats_server: EmbeddedNats) -> None:
    gate = asyncio.Event()
    async with fake_upstream(api="chat", gate=gate) as up:
        dep = deployment(DEPLOYMENT.format(url=up.url))
        only_b = EdgeKeys(clients=[Key("b", KEY_B.encode())], admins=[])  # key a was removed from its env
        try:
            async with running_node(dep, "n", nats_server.url), running_edge(dep, nats_server.url, only_b) as other:
                async with running_edge(dep, nats_server.url) as first, first.http() as http:
                    await first.edge.registry.wait_connected(["n"], timeout_s=10)
                    response_id = (await start(http))["id"]
                    await up.wait_for(lambda u: u.in_flight == 1)
                await _refused(other, owner_of(KEY_A.encode()), response_id)
                assert up.total == 1
        finally:
            gate.set()


async def _refused(edge: Any, owner: str, response_id: str) -> None:
    """`edge` took the response over and kept it failed, its key no longer accepted: nothing runs it."""
    store = edge.edge.responses.store
    kept: dict[str, Any] = {}

    async def ended() -> bool:
        nonlocal kept
        stored = await store.response(owner, response_id)
        kept = stored.response if stored is not None else {}
        return kept.get("status") not in (None, "queued", "in_progress")

    await eventually(ended, timeout_s=30, every_s=0.2)
    assert kept["status"] == "failed"
    assert kept["error"] == {  # Responses' error codes are a fixed set: iop's code is the type
        "code": "server_error",
        "message": "the key that created this response was revoked",
        "type": "invalid_api_key",
    }

    async def nothing_left() -> bool:
        # The run deletes its lease, then its work record: the lease's watch may hear of the first
        # before the second is written, so both are waited for.
        return await _no_lease(edge.edge) and await store.work(owner, response_id) is None

    await eventually(nothing_left, timeout_s=10)


async def _no_lease(edge: Any) -> bool:
    """Nothing is left of the run but its answer: no lease, no work record."""
    return not edge.responses.takeover.leases and not edge.responses.running


async def test_background_takeover_after_its_edge_is_killed_on_a_cluster(tmp_path: Path) -> None:
    """Each edge and the node on its own server of an R3 cluster: the lease's compare-and-set and
    the probe of the dead edge's subscriptions cross servers."""
    gate = asyncio.Event()
    async with fake_upstream(api="chat", gate=gate) as up, three_servers(tmp_path / "nats") as (s0, s1, s2):
        path = tmp_path / "deployment.yaml"
        path.write_text(CLUSTER.format(url=up.url, nats=",".join(s.address for s in (s0, s1, s2))))
        dep = deployment(path.read_text())
        try:
            async with (
                running_node(dep, "n", s2.url),
                running_edge(dep, s1.url) as survivor,
                survivor.http() as http_b,
            ):
                async with (
                    edge_process(path, s0.url) as (doomed, url),
                    httpx.AsyncClient(base_url=url) as http_a,
                ):
                    queued = await start(http_a)
                    await up.wait_for(lambda u: u.in_flight == 1, timeout_s=30)
                    # A follower on the other edge, from before the death to the end.
                    follower = asyncio.create_task(
                        http_b.get(f"/v1/responses/{queued['id']}?stream=true", headers=auth(), timeout=90)
                    )
                    doomed.kill()  # SIGKILL, by PID, a process this test started
                    killed = time.monotonic()
                    await doomed.proc.wait()
                await up.wait_for(lambda u: u.total == 2, timeout_s=30)  # run again by the survivor
                print(f"\nbackground response run again {time.monotonic() - killed:.1f} s after its edge was killed")
                gate.set()
                final = await completed(http_b, queued["id"])
                assert (final["status"], final["id"], text_of(final)) == ("completed", queued["id"], "w0 w1 w2")
                events = sse_events((await follower).text)
                assert events[-1]["type"] == "response.completed" and events[-1]["response"] == final
                await eventually(lambda: _no_lease(survivor.edge), timeout_s=10)
        finally:
            gate.set()
    assert up.total == 2  # one run per edge that ran it; the answer kept once


async def test_background_takeover_by_the_same_edge_started_again(nats_server: EmbeddedNats, tmp_path: Path) -> None:
    gate = asyncio.Event()
    async with fake_upstream(api="chat", gate=gate) as up:
        path = tmp_path / "deployment.yaml"
        path.write_text(DEPLOYMENT.format(url=up.url))
        dep = deployment(path.read_text())
        try:
            async with running_node(dep, "n", nats_server.url):
                async with edge_process(path, nats_server.url) as (edge, url), httpx.AsyncClient(base_url=url) as http:
                    queued = await start(http)
                    await up.wait_for(lambda u: u.in_flight == 1, timeout_s=30)
                    edge.kill()
                    await edge.proc.wait()
                async with edge_process(path, nats_server.url) as (_, url), httpx.AsyncClient(base_url=url) as http:
                    await up.wait_for(lambda u: u.total == 2, timeout_s=30)
                    gate.set()
                    final = await completed(http, queued["id"])
                    assert (final["status"], text_of(final)) == ("completed", "w0 w1 w2")
        finally:
            gate.set()


async def queued_on_a_gone_edge(store: ResponseStore, owner: str, rid: str) -> takeover.Held:
    """A queued background response whose lease an edge that is gone holds."""
    queued = {"id": rid, "object": "response", "status": "queued", "background": True, "output": []}
    request = {"model": "m", "input": "hi", "background": True}
    held = await takeover.hold(store, owner, rid, "gone-edge", takeover.Work(request, "a"))
    await store.keep(owner, Stored(queued, []), [])
    return held


async def test_background_takeover_gives_up_after_three_and_keeps_it_failed(nats_server: EmbeddedNats) -> None:
    """A response whose runs keep dying with their edges (here: its lease says so) is kept failed."""
    async with fake_upstream(api="chat") as up:
        dep = deployment(DEPLOYMENT.format(url=up.url))
        async with running_edge(dep, nats_server.url) as h, h.http() as http:
            store = h.edge.responses.store
            assert store is not None
            owner, rid = owner_of(KEY_A.encode()), "resp_doomed0123456789"
            held = await queued_on_a_gone_edge(store, owner, rid)
            last = takeover.Lease("", takeovers=takeover.MAX_TAKEOVERS)  # released after its third takeover
            await store.kv.update(held.key, msgspec.json.encode(last), last=held.revision)
            final = await completed(http, rid, timeout_s=30)
            assert final["status"] == "failed" and "run 4 times" in final["error"]["message"]
            await eventually(lambda: _no_lease(h.edge), timeout_s=10)

            async def work_gone() -> bool:
                return await store.work(owner, rid) is None

            # The lease goes first, then the work record: this edge may hear the one before the other.
            await eventually(work_gone, timeout_s=10)
    assert up.total == 0


@asynccontextmanager
async def one_running(
    nats_server: EmbeddedNats, gate: asyncio.Event
) -> AsyncIterator[tuple[Any, EdgeHandle, httpx.AsyncClient, dict[str, Any], str]]:
    """One edge and one node; a background response running upstream, held there until `gate` is
    set: (the upstream, the edge, its client, the queued response, its lease's key)."""
    async with fake_upstream(api="chat", gate=gate) as up:
        dep = deployment(DEPLOYMENT.format(url=up.url))
        try:
            async with running_node(dep, "n", nats_server.url), running_edge(dep, nats_server.url) as h:
                await h.edge.registry.wait_connected(["n"], timeout_s=10)
                async with h.http() as http:
                    queued = await start(http)
                    await up.wait_for(lambda u: u.in_flight == 1)
                    yield up, h, http, queued, f"l.{owner_of(KEY_A.encode())}.{queued['id']}"
        finally:
            gate.set()


async def test_background_takeover_an_edge_that_lost_the_lease_stops_its_run(nats_server: EmbeddedNats) -> None:
    """Another runner took the lease (this edge was cut off, as far as the others could tell): the
    edge stops its own run rather than finish an answer it may not keep; here that runner is gone
    too, so the edge takes the response back and completes it."""
    gate = asyncio.Event()
    async with one_running(nats_server, gate) as (up, h, http, queued, key):
        store = h.edge.responses.store
        assert store is not None
        entry = await store.kv.get(key)
        other = takeover.Lease("elsewhere-0000", takeovers=1)
        await store.kv.update(key, msgspec.json.encode(other), last=entry.revision)
        await up.wait_for(lambda u: u.total == 2, timeout_s=30)  # its own run stopped; run again
        gate.set()
        final = await completed(http, queued["id"])
        assert (final["status"], text_of(final)) == ("completed", "w0 w1 w2")
    assert up.total == 2


STREAM_INFO_ANSWER = b'{"type":"io.nats.jetstream.api.v1.stream_info_response","config":{"name":"x"}}'
"""What a node credential can make the JetStream server store under any key (tests/test_node_reply_subjects.py)."""


@pytest.mark.parametrize("junk", [STREAM_INFO_ANSWER, b""], ids=["api-answer", "empty"])
async def test_background_takeover_a_lease_written_over_with_junk_is_run_again_not_dropped(
    nats_server: EmbeddedNats, junk: bytes
) -> None:
    """What is not a lease where a running response's lease was: its run can no longer keep its
    answer (the lease's revision moved), so the response is taken over like a released one."""
    gate = asyncio.Event()
    async with one_running(nats_server, gate) as (up, h, http, queued, key):
        store = h.edge.responses.store
        assert store is not None
        await store.kv.put(key, junk)
        await up.wait_for(lambda u: u.total == 2, timeout_s=30)  # run again
        gate.set()
        final = await completed(http, queued["id"], timeout_s=30)
        assert (final["status"], text_of(final)) == ("completed", "w0 w1 w2")
        await eventually(lambda: _no_lease(h.edge), timeout_s=10)
    assert up.total == 2


async def test_background_takeover_of_a_response_whose_request_is_unreadable_keeps_it_failed(
    nats_server: EmbeddedNats,
) -> None:
    """Its work record written over (as a node can, tests/test_node_reply_subjects.py): the response
    cannot run again, and is kept failed rather than queued for good."""
    async with fake_upstream(api="chat") as up:
        dep = deployment(DEPLOYMENT.format(url=up.url))
        async with running_edge(dep, nats_server.url) as h, h.http() as http:
            store = h.edge.responses.store
            assert store is not None
            owner, rid = owner_of(KEY_A.encode()), "resp_unreadable0123456"
            held = await queued_on_a_gone_edge(store, owner, rid)
            await store.kv.put(f"w.{owner}.{rid}", STREAM_INFO_ANSWER)
            await store.kv.update(held.key, msgspec.json.encode(takeover.Lease("")), last=held.revision)
            final = await completed(http, rid, timeout_s=30)
            assert final["status"] == "failed" and "request" in final["error"]["message"]
            await eventually(lambda: _no_lease(h.edge), timeout_s=10)
    assert up.total == 0
