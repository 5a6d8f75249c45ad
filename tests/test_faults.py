"""Faults with real processes: a node SIGKILLed mid-stream and restarted, an edge restarted.

Measured figures are printed (`pytest -s`) and recorded in docs/reliability.md.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import nats

from iop import wire
from iop.client import EdgeClient
from iop.contracts.status import NodeStatus, Status
from iop.nats import streams
from iop.nats.server import EmbeddedNats
from tests.fakes import fake_upstream
from tests.harness import (
    broker_counts,
    deployment,
    edge_process,
    eventually,
    node_process,
    running_edge,
    sse_events,
    stream_messages,
    until,
)

REPO = Path(__file__).resolve().parents[1]


# --- node killed mid-stream, node restarted ---------------------------------------------------


def node_yaml(live_url: str, held_url: str) -> str:
    return f"""
edge:
  queue: {{timeout_s: 20, max_waiting: 100}}
models:
  - {{alias: live, pool: [p-live]}}
  - {{alias: held, pool: [p-held]}}
nodes:
  - id: n1
    adapters:
      - {{id: a-live, type: openai, base_url: "{live_url}", api: both}}
      - {{id: a-held, type: openai, base_url: "{held_url}", api: both}}
    providers:
      - {{id: p-live, adapter: a-live, capacity: 1}}
      - {{id: p-held, adapter: a-held, capacity: 1}}
"""


CHAT = {"messages": [{"role": "user", "content": "x"}]}


async def test_node_killed_mid_stream_fails_fast_frees_the_slot_and_restarts(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    held_gate = asyncio.Event()
    async with fake_upstream(tokens=100_000, token_interval_s=0.02) as live, fake_upstream(gate=held_gate) as held:
        text = node_yaml(live.url, held.url)
        cfg = tmp_path / "iop.yaml"
        cfg.write_text(text)
        dep = deployment(text)
        nc = await nats.connect(nats_server.url)
        js = nc.jetstream()
        try:
            async with running_edge(dep, nats_server.url) as h, h.http() as http:
                reg = h.edge.registry
                async with node_process(cfg, "n1", nats_server.url) as node:
                    await reg.wait_connected(["n1"], timeout_s=10)
                    # One stream whose first bytes reached the client, one request that has none yet.
                    body = {"model": "live", "stream": True, **CHAT}
                    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                        assert r.status_code == 200
                        it = r.aiter_text()
                        first = await anext(it)
                        assert first.startswith("data: ")
                        pending = asyncio.create_task(http.post("/v1/chat/completions", json={"model": "held", **CHAT}))
                        await held.wait_for(lambda u: u.in_flight == 1)
                        assert await broker_counts(js, "p-live") == (1, 0)

                        killed = time.monotonic()
                        node.kill()
                        lost = asyncio.create_task(until(lambda: not reg.connected("n1"), reg.changed, 10))
                        rest = "".join([t async for t in it])
                        stream_failed_s = time.monotonic() - killed
                    answer = await pending
                    unanswered_failed_s = time.monotonic() - killed
                    await lost
                    events = sse_events(first + rest)
                    assert events[-1]["error"]["code"] == "node_lost"
                    assert answer.status_code == 502 and answer.json()["error"]["code"] == "node_lost"

                    async def slots_free() -> bool:
                        counts = [await broker_counts(js, p) for p in ("p-live", "p-held")]
                        return counts == [(0, 0), (0, 0)] and await stream_messages(js) == 0

                    slots_free_s = time.monotonic() - killed + await eventually(slots_free)
                    # The killed node's upstream connection closed with it.
                    await live.wait_for(lambda u: u.disconnects == 1)

                # Restart: it re-announces, binds its consumers, serves; the edge does nothing.
                live.tokens, live.token_interval_s = 3, 0.0
                restarted = time.monotonic()
                async with node_process(cfg, "n1", nats_server.url) as node2:
                    await reg.wait_connected(["n1"], timeout_s=10)
                    connected_s = time.monotonic() - restarted
                    r2 = await http.post("/v1/chat/completions", json={"model": "live", **CHAT})
                    serve_s = time.monotonic() - restarted
                    assert r2.status_code == 200, r2.text
                    # Neither request of the dead node ran again: their messages are gone for good.
                    assert await stream_messages(js) == 0
                    assert (live.total, held.total) == (2, 1)
                    assert await broker_counts(js, "p-held") == (0, 0)

                    # Restarted at once, as a supervisor would: the edge still counts the dead
                    # instance as connected, so the new one is refused, retries, and is let in once
                    # the old one is declared lost.
                    st = reg.nodes["n1"]
                    old_instance = st.instance
                    node2.kill()
                    killed_again = time.monotonic()
                    async with node_process(cfg, "n1", nats_server.url):
                        await until(lambda: st.connected and st.instance not in (None, old_instance), reg.changed)
                        r3 = await http.post("/v1/chat/completions", json={"model": "live", **CHAT})
                        assert r3.status_code == 200, r3.text
                        back_s = time.monotonic() - killed_again
                    assert live.total == 3
        finally:
            held_gate.set()
            await nc.close()
    print(
        f"\nnode SIGKILL: stream error event after {stream_failed_s:.2f}s, 502 after {unanswered_failed_s:.2f}s, "
        f"broker slots free after {slots_free_s:.2f}s; restart: connected after {connected_s:.2f}s, "
        f"served after {serve_s:.2f}s; restarted at once: serving {back_s:.2f}s after the kill"
    )
    assert stream_failed_s < wire.HEARTBEAT_INTERVAL_S * wire.HEARTBEATS_MISSED + 1.0
    assert unanswered_failed_s < wire.HEARTBEAT_INTERVAL_S * wire.HEARTBEATS_MISSED + 1.0
    assert slots_free_s < wire.HEARTBEAT_INTERVAL_S * wire.HEARTBEATS_MISSED + 1.5


async def edge_status(url: str) -> Status:
    async with EdgeClient(url) as edge:
        return await edge.status()


def node_of(status: Status, node_id: str) -> NodeStatus:
    return next(n for n in status.nodes if n.id == node_id)


async def test_edge_restart_the_node_serves_the_new_edge_without_restarting(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    async with fake_upstream(tokens=100_000, token_interval_s=0.02) as live, fake_upstream() as held:
        cfg = tmp_path / "iop.yaml"
        cfg.write_text(node_yaml(live.url, held.url))
        nc = await nats.connect(nats_server.url)
        js = nc.jetstream()
        try:
            async with node_process(cfg, "n1", nats_server.url) as node:
                async with edge_process(cfg, nats_server.url) as (edge1, url1):

                    async def seen_by_edge1() -> bool:
                        return node_of(await edge_status(url1), "n1").connected

                    await eventually(seen_by_edge1)
                    instance = node_of(await edge_status(url1), "n1").instance
                    client = httpx.AsyncClient(base_url=url1, timeout=10)
                    try:
                        body = {"model": "live", "stream": True, **CHAT}
                        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                            assert r.status_code == 200
                            await anext(r.aiter_text())
                            killed = time.monotonic()
                            edge1.kill()
                            await edge1.proc.wait()
                    except httpx.HTTPError:
                        pass  # the edge died under the client: its connection breaks, nothing more
                    finally:
                        await client.aclose()
                # The node finds out by itself that nobody reads this answer any more: it stops the
                # upstream call and frees the broker slot, with no edge to tell it.
                await live.wait_for(lambda u: u.disconnects == 1, timeout_s=15)
                abandoned_s = time.monotonic() - killed

                async def slot_free() -> bool:
                    return await broker_counts(js, "p-live") == (0, 0) and await stream_messages(js) == 0

                await eventually(slot_free)
                live.tokens, live.token_interval_s = 3, 0.0
                restarted = time.monotonic()
                async with edge_process(cfg, nats_server.url) as (_, url2), httpx.AsyncClient(base_url=url2) as http:

                    async def seen_by_edge2() -> bool:
                        return node_of(await edge_status(url2), "n1").connected

                    await eventually(seen_by_edge2)
                    r2 = await http.post("/v1/chat/completions", json={"model": "live", **CHAT}, timeout=10)
                    serve_s = time.monotonic() - restarted
                    assert r2.status_code == 200, r2.text
                    # The very same node process and instance, never restarted.
                    assert node_of(await edge_status(url2), "n1").instance == instance
                    assert node.proc.returncode is None
                    assert sum(line.startswith("iop node n1 serving") for line in node.lines) == 1, node.lines
                assert live.total == 2
        finally:
            await nc.close()
    print(
        f"\nedge SIGKILL: node stopped the orphaned request after {abandoned_s:.2f}s; "
        f"new edge served after {serve_s:.2f}s"
    )
    assert abandoned_s < wire.PROBE_INTERVAL_S * 3 + 1


async def test_node_and_edge_killed_together_the_redelivery_never_runs(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    from nats.js import api as js_api

    async with fake_upstream(tokens=100_000, token_interval_s=0.02) as live, fake_upstream() as held:
        cfg = tmp_path / "iop.yaml"
        cfg.write_text(node_yaml(live.url, held.url))
        nc = await nats.connect(nats_server.url)
        js = nc.jetstream()
        try:
            # A short ack_wait, so that the broker redelivers within the test; nobody updates it,
            # since the capacity matches what the deployment says.
            await streams.ensure_work_stream(js)
            await js.add_consumer(
                wire.WORK_STREAM,
                js_api.ConsumerConfig(
                    durable_name=wire.consumer_name("p-live"),
                    filter_subject=wire.work_subject("p-live"),
                    ack_policy=js_api.AckPolicy.EXPLICIT,
                    ack_wait=1.0,
                    max_ack_pending=1,
                ),
            )
            async with (
                node_process(cfg, "n1", nats_server.url) as node1,
                edge_process(cfg, nats_server.url) as (
                    edge1,
                    url1,
                ),
            ):

                async def seen() -> bool:
                    return node_of(await edge_status(url1), "n1").connected

                await eventually(seen)
                client = httpx.AsyncClient(base_url=url1, timeout=10)
                try:
                    body = {"model": "live", "stream": True, **CHAT}
                    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                        await anext(r.aiter_text())  # bytes reached the client
                        # Both die at once: no edge is left to terminate the work message.
                        node1.kill()
                        edge1.kill()
                        await asyncio.gather(node1.proc.wait(), edge1.proc.wait())
                except httpx.HTTPError:
                    pass
                finally:
                    await client.aclose()
            assert await broker_counts(js, "p-live") == (1, 0)
            async with (
                edge_process(cfg, nats_server.url) as (_, url2),
                node_process(cfg, "n1", nats_server.url) as node2,
            ):
                # The broker redelivers after ack_wait; the new node asks the dead edge (no responder)
                # and drops it.
                await node2.wait_line(r"redelivered request \w+ dropped")

                async def slot_free() -> bool:
                    return await broker_counts(js, "p-live") == (0, 0) and await stream_messages(js) == 0

                await eventually(slot_free)
                live.tokens, live.token_interval_s = 3, 0.0
                async with httpx.AsyncClient(base_url=url2, timeout=10) as http:
                    r2 = await http.post("/v1/chat/completions", json={"model": "live", **CHAT})
                assert r2.status_code == 200, r2.text
            assert live.total == 2  # the first request once, the new one once
        finally:
            await nc.close()
