"""Edge and nodes over a real NATS: the OpenAI API, pool capacity, late binding, CLI, queue, status."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import openai

from iop.contracts.status import PoolProviderStatus
from iop.nats.server import EmbeddedNats
from iop.node.adapters.mock import mock_token
from iop.statusview import render_status
from tests.fakes import fake_upstream
from tests.harness import deployment, deployment_running, eventually, running_edge, running_node, until


def two_provider_yaml(url_a: str, url_b: str, cap_a: int = 1, cap_b: int = 2, queue: str = "") -> str:
    return f"""
edge:
  queue: {{timeout_s: 20, max_waiting: 1000}}
  {queue}
models:
  - alias: m
    pool: [prov-a, prov-b]
nodes:
  - id: node-a
    adapters: [{{id: up, type: openai, base_url: "{url_a}", api: both}}]
    providers: [{{id: prov-a, adapter: up, model: upstream-a, capacity: {cap_a}}}]
  - id: node-b
    adapters: [{{id: up, type: openai, base_url: "{url_b}", api: both}}]
    providers: [{{id: prov-b, adapter: up, model: upstream-b, capacity: {cap_b}}}]
"""


MOCK_YAML = """
models:
  - alias: sim
    pool: [sim-1]
nodes:
  - id: n1
    adapters: [{id: sim, type: mock, latency_ms: 0, tokens: 5, token_interval_ms: 0}]
    providers: [{id: sim-1, adapter: sim, capacity: 2}]
"""

MOCK_TEXT = "".join(mock_token(i) for i in range(5))


def one_provider(url: str, capacity: int, edge: str = "") -> str:
    """A deployment of one pool `m` of one provider `p` on node `n`; `edge`: the edge's settings."""
    return (f"edge: {{{edge}}}\n" if edge else "") + (
        "models: [{alias: m, pool: [p]}]\n"
        "nodes:\n"
        "  - id: n\n"
        f'    adapters: [{{id: up, type: openai, base_url: "{url}", api: both}}]\n'
        f"    providers: [{{id: p, adapter: up, capacity: {capacity}}}]\n"
    )


async def test_chat_and_responses_through_a_pool_to_an_openai_upstream(nats_server: EmbeddedNats) -> None:
    async with fake_upstream() as a, fake_upstream() as b:
        dep = deployment(two_provider_yaml(a.url, b.url))
        async with deployment_running(dep, nats_server.url) as h:
            client = h.client()
            chat = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
            assert chat.choices[0].message.content == "w0 w1 w2"
            assert chat.model in ("upstream-a", "upstream-b")  # the provider's model name went upstream

            stream = await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}], stream=True
            )
            text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
            assert text == "w0 w1 w2"

            resp = await client.responses.create(model="m", input="hi")
            assert resp.output_text == "w0 w1 w2"

            events = [e async for e in await client.responses.create(model="m", input="hi", stream=True)]
            assert events[-1].type == "response.completed"
            deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
            assert deltas == "w0 w1 w2"
        seen = a.bodies + b.bodies
        assert len(seen) == 4
        assert {body["model"] for body in seen} <= {"upstream-a", "upstream-b"}
        assert a.by_path.get("/v1/chat/completions", 0) + b.by_path.get("/v1/chat/completions", 0) == 2


async def test_chat_and_responses_from_the_mock_adapter(nats_server: EmbeddedNats) -> None:
    async with deployment_running(deployment(MOCK_YAML), nats_server.url) as h:
        client = h.client()
        chat = await client.chat.completions.create(model="sim", messages=[{"role": "user", "content": "x"}])
        assert chat.choices[0].message.content == MOCK_TEXT
        assert chat.usage is not None and chat.usage.completion_tokens == 5
        chunks = await client.chat.completions.create(
            model="sim", messages=[{"role": "user", "content": "x"}], stream=True
        )
        assert "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices]) == MOCK_TEXT
        resp = await client.responses.create(model="sim", input="x")
        assert resp.output_text == MOCK_TEXT
        assert resp.usage is not None and resp.usage.output_tokens == 5
        async with client.responses.stream(model="sim", input="x") as rs:
            final = await rs.get_final_response()
        assert final.output_text == MOCK_TEXT


async def _burst(h_client: openai.AsyncOpenAI, n: int, model: str = "m") -> list[str]:
    async def one(i: int) -> str:
        if i % 2:
            r = await h_client.responses.create(model=model, input=f"req {i}")
            text: str = r.output_text
            return text
        c = await h_client.chat.completions.create(model=model, messages=[{"role": "user", "content": f"{i}"}])
        return c.choices[0].message.content or ""

    return await asyncio.gather(*(one(i) for i in range(n)))


async def test_pool_capacity_is_exact_under_load(nats_server: EmbeddedNats) -> None:
    async with fake_upstream(latency_s=0.05) as a, fake_upstream(latency_s=0.05) as b:
        dep = deployment(two_provider_yaml(a.url, b.url, cap_a=1, cap_b=2))
        async with deployment_running(dep, nats_server.url) as h:
            texts = await _burst(h.client(), 30)
        assert texts == ["w0 w1 w2"] * 30
        assert (a.peak, b.peak) == (1, 2)
        assert a.total + b.total == 30


async def test_pool_capacity_holds_with_two_edges_on_one_nats(nats_server: EmbeddedNats) -> None:
    async with fake_upstream(latency_s=0.05) as a, fake_upstream(latency_s=0.05) as b:
        dep = deployment(two_provider_yaml(a.url, b.url, cap_a=1, cap_b=2))
        async with deployment_running(dep, nats_server.url) as h1, running_edge(dep, nats_server.url) as h2:
            await h2.edge.registry.wait_connected(["node-a", "node-b"], timeout_s=10)
            results = await asyncio.gather(_burst(h1.client(), 20), _burst(h2.client(), 20))
        assert all(t == "w0 w1 w2" for r in results for t in r)
        assert (a.peak, b.peak) == (1, 2)
        assert a.total + b.total == 40


async def test_late_binding_never_waits_behind_a_slow_provider(nats_server: EmbeddedNats) -> None:
    slow_gate = asyncio.Event()
    async with fake_upstream(gate=slow_gate) as slow, fake_upstream() as fast:
        dep = deployment(two_provider_yaml(slow.url, fast.url, cap_a=1, cap_b=1))
        async with deployment_running(dep, nats_server.url) as h, h.http() as http:
            body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
            # Occupy the slow provider (its only slot) until the end of the test.
            first = asyncio.create_task(http.post("/v1/chat/completions", json=body))
            await slow.wait_for(lambda u: u.in_flight == 1)
            # Every further request must go to the fast provider, one after another, while the
            # slow one holds its slot: none may be bound to the slow provider and wait there.
            for _ in range(6):
                r = await http.post("/v1/chat/completions", json=body)
                assert r.status_code == 200
                assert r.headers["x-iop-provider"] == "prov-b"
            assert slow.total == 1 and fast.total == 6
            slow_gate.set()
            assert (await first).status_code == 200


def cli_yaml(command: list[str], pool_url: str) -> str:
    cmd = ", ".join(f'"{c}"' for c in command)
    return f"""
models:
  - alias: m
    pool: [prov]
  - alias: agent
    route: node-c/agent-cli
nodes:
  - id: node-c
    adapters:
      - {{id: agent, type: cli, command: [{cmd}], timeout_s: 30}}
      - {{id: up, type: openai, base_url: "{pool_url}", api: both}}
    providers:
      - {{id: agent-cli, adapter: agent}}
      - {{id: prov, adapter: up, capacity: 1}}
"""


# A CLI stand-in that registers itself in a folder, then waits until `n` of its kind are running
# at once: it can only finish if nothing limits how many run together.
RENDEZVOUS = """
import os, sys, time, pathlib
d = pathlib.Path(sys.argv[1]); n = int(sys.argv[2])
(d / str(os.getpid())).touch()
limit = time.monotonic() + 20
while len(list(d.iterdir())) < n:
    if time.monotonic() > limit:
        sys.exit("only %d ran at once" % len(list(d.iterdir())))
    time.sleep(0.01)
print("together:" + sys.stdin.read())
"""


async def test_cli_runs_unlimited_while_the_pool_is_saturated(nats_server: EmbeddedNats, tmp_path: Path) -> None:
    gate = asyncio.Event()
    script = tmp_path / "rendezvous.py"
    script.write_text(RENDEZVOUS)
    room = tmp_path / "room"
    room.mkdir()
    async with fake_upstream(gate=gate) as up:
        dep = deployment(cli_yaml([sys.executable, str(script), str(room), "20"], up.url))
        async with deployment_running(dep, nats_server.url) as h, h.http() as http:
            body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
            held = [asyncio.create_task(http.post("/v1/chat/completions", json=body)) for _ in range(3)]
            await up.wait_for(lambda u: u.in_flight == 1)
            client = h.client()
            answers = await asyncio.gather(
                *(
                    client.chat.completions.create(model="agent", messages=[{"role": "user", "content": f"p{i}"}])
                    for i in range(20)
                )
            )
            assert sorted(a.choices[0].message.content or "" for a in answers) == sorted(
                f"together:p{i}\n" for i in range(20)
            )
            assert up.in_flight == 1 and up.total == 1  # the pool stayed saturated all along
            gate.set()
            assert all(r.status_code == 200 for r in await asyncio.gather(*held))


async def test_queue_full_answers_429_with_retry_after(nats_server: EmbeddedNats) -> None:
    gate = asyncio.Event()
    async with fake_upstream(gate=gate) as a, fake_upstream(gate=gate) as b:
        text = two_provider_yaml(a.url, b.url, 1, 1).replace("max_waiting: 1000", "max_waiting: 2")
        async with deployment_running(deployment(text), nats_server.url) as h, h.http() as http:
            body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
            running = [asyncio.create_task(http.post("/v1/chat/completions", json=body)) for _ in range(4)]
            await a.wait_for(lambda u: u.in_flight == 1)
            await b.wait_for(lambda u: u.in_flight == 1)
            # Two wait: in the pool's queue, or in standby in the broker (edge.queue.standby).
            await until(lambda: h.edge.scheduler.waiting("m") == 2, h.edge.scheduler.changed)
            r = await http.post("/v1/chat/completions", json=body)
            assert r.status_code == 429
            assert r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "queue_full"
            gate.set()
            assert [x.status_code for x in await asyncio.gather(*running)] == [200] * 4


async def test_queue_timeout_fails_and_never_reaches_an_upstream(nats_server: EmbeddedNats) -> None:
    gate = asyncio.Event()
    async with fake_upstream(gate=gate) as a, fake_upstream(gate=gate) as b:
        text = two_provider_yaml(a.url, b.url, 1, 1).replace("timeout_s: 20", "timeout_s: 0.5")
        async with deployment_running(deployment(text), nats_server.url) as h, h.http() as http:
            body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
            running = [asyncio.create_task(http.post("/v1/chat/completions", json=body)) for _ in range(2)]
            await a.wait_for(lambda u: u.in_flight == 1)
            await b.wait_for(lambda u: u.in_flight == 1)
            late_body = {**body, "messages": [{"role": "user", "content": "late"}]}
            late = await http.post("/v1/chat/completions", json=late_body)
            assert late.status_code == 503
            assert late.json()["error"]["code"] == "queue_timeout"
            gate.set()
            await asyncio.gather(*running)
            # Another request afterwards is served, and the timed-out one never ran anywhere.
            assert (await http.post("/v1/chat/completions", json=body)).status_code == 200
        seen = [m["content"] for body_ in a.bodies + b.bodies for m in body_["messages"]]
        assert "late" not in seen


async def test_client_disconnect_mid_stream_frees_the_slot(nats_server: EmbeddedNats) -> None:
    async with fake_upstream(tokens=1000, token_interval_s=0.01) as up:
        text = one_provider(up.url, 1)
        async with deployment_running(deployment(text), nats_server.url) as h:
            body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "x"}]}
            async with h.http() as http, http.stream("POST", "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                async for _ in r.aiter_bytes():
                    break  # read a little, then hang up
            await up.wait_for(lambda u: u.in_flight == 0 and u.disconnects == 1)
            up.tokens = 2
            async with h.http() as http:
                r2 = await http.post("/v1/chat/completions", json={**body, "stream": False})
            assert r2.status_code == 200
            assert up.total == 2


async def test_a_client_leaving_a_whole_answer_cancels_its_request_with_no_task_watching(
    nats_server: EmbeddedNats,
) -> None:
    gate = asyncio.Event()
    async with fake_upstream(gate=gate) as up:
        text = one_provider(up.url, 1)
        async with deployment_running(deployment(text), nats_server.url) as h, h.http() as http:
            body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
            gone = asyncio.create_task(http.post("/v1/chat/completions", json=body))
            await up.wait_for(lambda u: u.in_flight == 1)
            # The connection itself cancels the request when its client leaves: no task per request
            # waits in receive() for the disconnect.
            watching = [t for t in asyncio.all_tasks() if t.get_coro().__name__ == "watch_disconnect"]  # type: ignore[union-attr]
            assert watching == []
            gone.cancel()
            sched = h.edge.scheduler

            async def slot_free() -> bool:  # while the upstream still holds the call
                return sched.providers["p"].in_flight == 0 and h.edge.observer.records == 1

            await eventually(slot_free)
            gate.set()
            r = await http.post("/v1/chat/completions", json=body)
            assert r.status_code == 200


async def test_status_shows_the_catalog_once_with_live_counts(nats_server: EmbeddedNats) -> None:
    gate = asyncio.Event()
    async with fake_upstream(gate=gate) as a, fake_upstream(gate=gate) as b:
        dep = deployment(two_provider_yaml(a.url, b.url, 1, 2))
        async with deployment_running(dep, nats_server.url) as h, h.http() as http:
            body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
            running = [asyncio.create_task(http.post("/v1/chat/completions", json=body)) for _ in range(5)]
            await a.wait_for(lambda u: u.in_flight == 1)
            await b.wait_for(lambda u: u.in_flight == 2)

            reg = h.edge.registry

            def live() -> dict[str, int]:
                return {p: lv.in_flight for st in reg.nodes.values() for p, lv in st.live.items()}

            # Heartbeats carry the nodes' counts: wait for one that shows them all running.
            await until(lambda: live() == {"prov-a": 1, "prov-b": 2}, reg.changed)
            await until(lambda: h.edge.scheduler.waiting("m") == 2, h.edge.scheduler.changed)
            st = await h.status()
            assert sorted(st.providers()) == ["prov-a", "prov-b"]
            assert [n.id for n in st.nodes] == ["node-a", "node-b"]
            assert all(n.connected for n in st.nodes)
            (pool,) = st.pools
            assert pool.total_capacity == 3 and pool.connected_candidates == 2
            assert pool.in_flight == 3 and pool.waiting == 2
            gate.set()
            await asyncio.gather(*running)


async def test_unknown_model_is_404_and_no_connected_provider_is_503(nats_server: EmbeddedNats) -> None:
    async with fake_upstream() as a, fake_upstream() as b:
        dep = deployment(two_provider_yaml(a.url, b.url))
        async with running_edge(dep, nats_server.url) as h, h.http() as http:
            msgs = [{"role": "user", "content": "x"}]
            r = await http.post("/v1/chat/completions", json={"model": "nope", "messages": msgs})
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
            r = await http.post("/v1/chat/completions", json={"model": "m", "messages": msgs})
            assert r.status_code == 503 and r.json()["error"]["code"] == "no_provider"
            async with running_node(dep, "node-a", nats_server.url):
                await h.edge.registry.wait_connected(["node-a"], timeout_s=10)
                r = await http.post("/v1/chat/completions", json={"model": "m", "messages": msgs})
                assert r.status_code == 200


async def test_failover_before_the_first_byte_and_the_breaker(nats_server: EmbeddedNats) -> None:
    async with fake_upstream(fail_status=500) as bad, fake_upstream() as good:
        dep = deployment(two_provider_yaml(bad.url, good.url, cap_a=4, cap_b=1))
        async with deployment_running(dep, nats_server.url) as h, h.http() as http:
            body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
            # The bad provider has the most free slots, so it is tried first; each request must
            # still succeed, on the good provider.
            for _ in range(3):
                r = await http.post("/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                assert r.headers["x-iop-provider"] == "prov-b"
            assert bad.total == 3
            _, prov_a = (await h.status()).providers()["prov-a"]
            assert isinstance(prov_a, PoolProviderStatus)
            assert prov_a.breaker == "open" and prov_a.consecutive_failures == 3
            assert prov_a.breaker_open_for_s is not None and prov_a.breaker_open_for_s > 0
            # Out of rotation: further requests don't touch the bad provider at all.
            for _ in range(3):
                assert (await http.post("/v1/chat/completions", json=body)).status_code == 200
            assert bad.total == 3


async def test_a_pool_whose_every_breaker_is_open_answers_503_at_once_and_status_says_so(
    nats_server: EmbeddedNats,
) -> None:
    async with fake_upstream(fail_status=500) as bad:
        text = one_provider(bad.url, 3)
        async with deployment_running(deployment(text), nats_server.url) as h, h.http() as http:
            body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
            for _ in range(3):
                assert (await http.post("/v1/chat/completions", json=body)).status_code == 502
            loop = asyncio.get_running_loop()
            asked = loop.time()
            r = await http.post("/v1/chat/completions", json=body)
            took_ms = 1000 * (loop.time() - asked)
            print(f"\nsole provider's breaker open: 503 pool_unavailable in {took_ms:.1f} ms")
            # Before: it waited the whole queue timeout for a slot that could not come.
            assert r.status_code == 503 and r.json()["error"]["code"] == "pool_unavailable"
            assert r.headers["retry-after"] == "5" and bad.total == 3
            st = await h.status()
            pool = st.pools[0]
            assert (pool.usable_capacity, pool.total_capacity, pool.connected_capacity) == (0, 3, 3)
            assert pool.retry_after_s is not None and 0 < pool.retry_after_s <= 5
            pool_row = render_status(st).splitlines()[-1].split()
            assert pool_row[:4] == ["m", "1", "1", "0/3"] and "(unavailable," in pool_row


async def test_waiting_requests_bodies_are_bounded_per_edge(nats_server: EmbeddedNats) -> None:
    # Before: every waiting request kept its whole body (16 waiting x 30 MiB = +745 MiB), bounded
    # only by max_waiting x max_body_mb (~47 GiB per pool with the defaults).
    # (standby 0: the second request waits in the edge's queue, not in the broker, so its body counts.)
    gate = asyncio.Event()
    async with fake_upstream(gate=gate) as up:
        text = one_provider(up.url, 1, edge="queue: {max_waiting_mb: 0.5, standby: 0}")
        async with deployment_running(deployment(text), nats_server.url) as h, h.http() as http:

            def body(kib: int) -> dict[str, object]:
                return {"model": "m", "messages": [{"role": "user", "content": "x" * kib * 1024}]}

            async def ask(kib: int) -> int:
                return (await http.post("/v1/chat/completions", json=body(kib))).status_code

            running = asyncio.create_task(ask(400))  # takes the slot: held by the upstream, not waiting
            await up.wait_for(lambda u: u.in_flight == 1)
            sched = h.edge.scheduler
            waiting_big = asyncio.create_task(ask(300))
            await until(lambda: sched.waiting("m") == 1, sched.changed)
            # Refused while it arrives: bodies being received count against the same budget.
            r = await http.post("/v1/chat/completions", json=body(300))
            assert r.status_code == 503 and r.json()["error"]["code"] == "bodies_over_budget", r.text
            assert r.headers["retry-after"] == "1" and "max_waiting_mb" in r.json()["error"]["message"]
            waiting_small = asyncio.create_task(ask(100))
            await until(lambda: sched.waiting("m") == 2, sched.changed)
            held_mib = sched.waiting_bytes / (1024 * 1024)
            print(f"\nwaiting requests hold {held_mib:.2f} MiB of the 0.5 MiB allowed; the next 300 KiB got 503")
            assert held_mib <= 0.5
            gate.set()
            assert list(await asyncio.gather(running, waiting_big, waiting_small)) == [200, 200, 200]
            assert sched.waiting_bytes == 0


async def test_a_failing_sole_provider_gives_a_clear_502(nats_server: EmbeddedNats) -> None:
    async with fake_upstream(fail_status=503) as bad:
        text = one_provider(bad.url, 1)
        async with deployment_running(deployment(text), nats_server.url) as h, h.http() as http:
            r = await http.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user"}]})
            assert r.status_code == 502
            err = r.json()["error"]
            assert err["code"] == "upstream_error" and "503" in err["message"]
