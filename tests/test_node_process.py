"""`iop node` as a process: it stops at once on SIGTERM in every state, and hears when the edge refuses it.

Figures are printed (`pytest -s`) and recorded in docs/reliability.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from pathlib import Path

import httpx
import nats
import pytest
from nats.aio.msg import Msg

from iop import wire
from iop.nats.server import EmbeddedNats
from iop.node.catalog import differences
from tests.fakes import fake_upstream
from tests.harness import (
    IopProcess,
    deployment,
    eventually,
    free_port,
    iop_process,
    node_process,
    running_edge,
    running_node,
    sse_events,
    until,
)

MOCK_NODE = """
models:
  - {alias: sim, pool: [p1]}
nodes:
  - id: n1
    adapters:
      - {id: m, type: mock, latency_ms: 0, tokens: 3}
    providers:
      - {id: p1, adapter: m, capacity: 1}
"""

STOP_BOUND_S = 3.0
"""What the tests accept for "stops within a second" on a machine others load too (the figure is printed)."""


async def sigterm_exit_s(p: IopProcess) -> float:
    """SIGTERM the process and return how long it took to exit by itself (fails past STOP_BOUND_S)."""
    t0 = time.monotonic()
    os.kill(p.pid, signal.SIGTERM)
    rc = await p.exit_code(timeout_s=STOP_BOUND_S)
    took = time.monotonic() - t0
    assert rc == 0, p.lines
    assert not any("Traceback" in line for line in p.lines), p.lines
    return took


async def test_node_waiting_for_nats_stops_on_sigterm(tmp_path: Path) -> None:
    cfg = tmp_path / "iop.yaml"
    cfg.write_text(MOCK_NODE)
    nowhere = f"nats://127.0.0.1:{free_port()}"
    async with iop_process("node", "--config", str(cfg), "--node", "n1", "--nats", nowhere) as p:
        await p.wait_line("waiting for NATS")
        took = await sigterm_exit_s(p)
    print(f"\nwaiting for NATS: exited {took:.2f}s after SIGTERM")


async def test_node_waiting_for_its_catalog_stops_on_sigterm(nats_server: EmbeddedNats) -> None:
    # No --config and no edge: the node waits for the edge to publish its catalog.
    async with iop_process("node", "--node", "n1", "--nats", nats_server.url) as p:
        await p.wait_line("waiting for the edge to publish its catalog")
        took = await sigterm_exit_s(p)
    print(f"\nwaiting for its catalog: exited {took:.2f}s after SIGTERM")


async def test_node_refused_at_hello_stops_on_sigterm(nats_server: EmbeddedNats, tmp_path: Path) -> None:
    # The edge does not know n1: the node retries its hello (for a predecessor to be declared lost).
    cfg = tmp_path / "iop.yaml"
    cfg.write_text(MOCK_NODE)
    other = deployment(MOCK_NODE.replace("id: n1", "id: n2"))
    async with running_edge(other, nats_server.url) as h:
        args = ("node", "--config", str(cfg), "--node", "n1", "--nats", nats_server.url, "-v")
        async with iop_process(*args) as p:
            await p.wait_line("refused")
            took = await sigterm_exit_s(p)
        assert not h.edge.registry.connected("n2")
    print(f"\nrefused at hello: exited {took:.2f}s after SIGTERM")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
async def test_node_serving_stops_on_a_signal(nats_server: EmbeddedNats, tmp_path: Path, sig: int) -> None:
    cfg = tmp_path / "iop.yaml"
    cfg.write_text(MOCK_NODE)
    async with running_edge(deployment(MOCK_NODE), nats_server.url) as h, node_process(cfg, "n1", nats_server.url) as p:
        await h.edge.registry.wait_connected(["n1"], timeout_s=10)
        t0 = time.monotonic()
        os.kill(p.pid, sig)
        assert await p.exit_code(timeout_s=STOP_BOUND_S) == 0, p.lines
        took = time.monotonic() - t0
    print(f"\nserving, idle: exited {took:.2f}s after {signal.Signals(sig).name}")


async def test_node_with_a_running_request_stops_on_a_second_sigterm(nats_server: EmbeddedNats, tmp_path: Path) -> None:
    async with fake_upstream(tokens=100_000, token_interval_s=0.02) as up:
        text = REPLACED_YAML.format(url=up.url)
        cfg = tmp_path / "iop.yaml"
        cfg.write_text(text)
        async with (
            running_edge(deployment(text), nats_server.url) as h,
            h.http() as http,
            node_process(cfg, "n1", nats_server.url) as p,
        ):
            await h.edge.registry.wait_connected(["n1"], timeout_s=10)
            body = {"model": "m", "stream": True, **CHAT}
            async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                it = r.aiter_text()
                first = await anext(it)
                os.kill(p.pid, signal.SIGTERM)
                await p.wait_line("waiting up to 30s for 1 running requests")  # the grace, by design
                t0 = time.monotonic()
                os.kill(p.pid, signal.SIGTERM)
                assert await p.exit_code(timeout_s=STOP_BOUND_S) == 0, p.lines
                took = time.monotonic() - t0
                rest = "".join([t async for t in it])
            assert sse_events(first + rest)[-1]["error"]["message"] == "node is stopping"
            await up.wait_for(lambda u: u.in_flight == 0 and u.disconnects == 1)
    assert any("cutting 1 running requests short" in line for line in p.lines), p.lines
    print(f"\nserving a request: a second SIGTERM stopped it in {took:.2f}s")


async def test_node_says_how_the_edges_catalog_differs_from_its_file(
    nats_server: EmbeddedNats, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="iop.node")
    local = deployment(MOCK_NODE)
    at_edge = deployment(MOCK_NODE.replace("capacity: 1", "capacity: 2").replace("tokens: 3", "tokens: 5"))
    async with running_edge(at_edge, nats_server.url) as h, running_node(local, "n1", nats_server.url) as node:
        await h.edge.registry.wait_connected(["n1"], timeout_s=10)
        assert node.node == at_edge.node("n1")  # it follows the edge
    said = [r.getMessage() for r in caplog.records if "differs from the local file" in r.getMessage()]
    assert len(said) == 1, said
    assert "capacity n1/p1: 1 → 2" in said[0], said
    assert "adapter_changed n1/m" in said[0] and '"tokens":3' in said[0] and '"tokens":5' in said[0], said
    print("\n" + said[0])
    # Legacy concurrency, which never changes admission, is named too.
    legacy = deployment(MOCK_NODE.replace("id: n1", "id: n1\n    concurrency: 4")).node("n1")
    assert differences(local.node("n1"), legacy).endswith("→ 4")


# --- one live instance per node id ------------------------------------------------------------------

REPLACED_YAML = """
edge:
  queue: {{timeout_s: 20, max_waiting: 100}}
models:
  - {{alias: m, pool: [p1]}}
  - {{alias: echo, route: n1/c1}}
nodes:
  - id: n1
    adapters:
      - {{id: up, type: openai, base_url: "{url}", api: both}}
      - {{id: cat, type: cli, command: [cat], timeout_s: 30}}
    providers:
      - {{id: p1, adapter: up, capacity: 1}}
      - {{id: c1, adapter: cat}}
"""

CHAT = {"messages": [{"role": "user", "content": "x"}]}


async def test_a_frozen_node_replaced_by_a_new_instance_stops_when_it_wakes(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    async with fake_upstream(tokens=100_000, token_interval_s=0.02) as up:
        text = REPLACED_YAML.format(url=up.url)
        cfg = tmp_path / "iop.yaml"
        cfg.write_text(text)
        async with running_edge(deployment(text), nats_server.url) as h, h.http() as http:
            reg = h.edge.registry
            async with node_process(cfg, "n1", nats_server.url) as old:
                await reg.wait_connected(["n1"], timeout_s=10)
                old_instance = reg.nodes["n1"].instance
                body = {"model": "m", "stream": True, **CHAT}
                try:
                    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                        it = r.aiter_text()
                        first = await anext(it)
                        os.kill(old.pid, signal.SIGSTOP)
                        rest = "".join([t async for t in it])
                    assert sse_events(first + rest)[-1]["error"]["code"] == "node_lost"
                    async with node_process(cfg, "n1", nats_server.url):
                        st = reg.nodes["n1"]
                        await until(lambda: st.connected and st.instance not in (None, old_instance), reg.changed)
                        new_instance = st.instance
                        # The frozen process still holds its upstream call open: nothing can close it
                        # while it sleeps. It must close it the moment it wakes.
                        assert up.in_flight == 1
                        woke = time.monotonic()
                        os.kill(old.pid, signal.SIGCONT)
                        await up.wait_for(lambda u: u.in_flight == 0)
                        closed_s = time.monotonic() - woke
                        assert await old.exit_code(timeout_s=10) == 1, old.lines
                        exited_s = time.monotonic() - woke
                        assert any("another instance took this node id" in line for line in old.stderr), old.stderr

                        # Everything now runs on the new instance, one at a time on the capacity-1 upstream.
                        up.tokens, up.token_interval_s, up.peak = 3, 0.0, up.in_flight
                        pool = [http.post("/v1/chat/completions", json={"model": "m", **CHAT}) for _ in range(10)]
                        direct = [http.post("/v1/chat/completions", json={"model": "echo", **CHAT}) for _ in range(10)]
                        answers = await asyncio.gather(*pool, *direct)
                        assert [a.status_code for a in answers] == [200] * 20, [a.text for a in answers]
                        assert up.peak == 1
                        assert st.connected and st.instance == new_instance
                finally:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(old.pid, signal.SIGCONT)
    print(
        f"\nreplaced while frozen: upstream call closed {closed_s:.2f}s, process exited {exited_s:.2f}s after SIGCONT"
    )


async def test_work_sent_to_a_frozen_node_that_its_edge_failed_never_runs_when_it_wakes(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    async with fake_upstream() as up:
        text = REPLACED_YAML.format(url=up.url)
        cfg = tmp_path / "iop.yaml"
        cfg.write_text(text)
        async with running_edge(deployment(text), nats_server.url) as h, h.http() as http:
            reg = h.edge.registry
            async with node_process(cfg, "n1", nats_server.url) as node:
                await reg.wait_connected(["n1"], timeout_s=10)
                try:
                    os.kill(node.pid, signal.SIGSTOP)
                    # Sent while the node is frozen (the edge does not know yet): it waits in the
                    # node's queue until the edge declares the node lost and fails it.
                    gone = {"model": "m", "messages": [{"role": "user", "content": "failed-while-frozen"}]}
                    r = await http.post("/v1/chat/completions", json=gone)
                    assert r.status_code == 502 and r.json()["error"]["code"] == "node_lost", r.text
                    os.kill(node.pid, signal.SIGCONT)
                    woke = time.monotonic()
                    await reg.wait_connected(["n1"], timeout_s=10)
                    # The client retries, as a client does after a 502: it runs once, the retry.
                    retry = await http.post("/v1/chat/completions", json=gone)
                    assert retry.status_code == 200, retry.text
                    after = {"model": "m", "messages": [{"role": "user", "content": "after"}]}
                    assert (await http.post("/v1/chat/completions", json=after)).status_code == 200
                    served_s = time.monotonic() - woke
                finally:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(node.pid, signal.SIGCONT)
    contents = [b["messages"][0]["content"] for b in up.bodies]
    # Before: the frozen node woke and ran the failed request too (the retry made it two runs).
    assert contents.count("failed-while-frozen") == 1, contents
    assert any("no longer waits" in line for line in node.lines), node.lines[-20:]
    print(
        f"\nfrozen node woke: the request its edge had failed was not run; served again {served_s:.2f}s after SIGCONT"
    )


async def test_a_node_removed_by_refresh_says_so_once_and_serves_again_when_added_back(
    nats_server: EmbeddedNats, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="iop.edge")
    cfg = tmp_path / "iop.yaml"
    cfg.write_text(MOCK_NODE)
    with_n1, without_n1 = deployment(MOCK_NODE), deployment(MOCK_NODE.replace("id: n1", "id: n2"))
    async with running_edge(with_n1, nats_server.url) as h, node_process(cfg, "n1", nats_server.url) as p:
        reg = h.edge.registry
        await reg.wait_connected(["n1"], timeout_s=10)
        await h.edge.refresher.apply(without_n1)
        removed = time.monotonic()
        await p.wait_line("removed from the deployment")
        told_s = time.monotonic() - removed
        # Quiet while removed: it asks the edge each second whether its id is back, and neither it
        # nor the edge says more than once that it is not.
        asked = asyncio.Event()
        hellos = 0

        async def count(msg: Msg) -> None:
            nonlocal hellos
            hellos += 1
            if hellos >= 3:
                asked.set()

        nc = await nats.connect(nats_server.url)
        try:
            await nc.subscribe(wire.hello_subject("n1"), cb=count)
            async with asyncio.timeout(10):
                await asked.wait()
        finally:
            await nc.close()
        await h.edge.refresher.apply(with_n1)
        await p.wait_line("back in the deployment; serving")
        await reg.wait_connected(["n1"], timeout_s=10)
        answer = await h.client().chat.completions.create(model="sim", messages=[{"role": "user", "content": "hi"}])
        assert answer.choices[0].message.content
        assert p.proc.returncode is None
    assert sum("removed from the deployment" in line for line in p.lines) == 1, p.lines
    refusals = [r.getMessage() for r in caplog.records if "refused node n1" in r.getMessage()]
    assert len(refusals) == 1 and "not in this deployment" in refusals[0], refusals
    print(f"\nremoved by refresh: the node said so {told_s:.2f}s after the refresh")


TWO_NODES = """
edge:
  listen: 127.0.0.1:0
  nats: {{url: embedded, listen: "127.0.0.1:{nats_port}", store_dir: "{store}"}}
models:
  - {{alias: sim, pool: [p1]}}
  - {{alias: sim2, pool: [p2]}}
nodes:
  - id: n1
    adapters:
      - {{id: m, type: mock, latency_ms: 0, tokens: 3}}
    providers:
      - {{id: p1, adapter: m, capacity: 1}}
  - id: n2
    adapters:
      - {{id: m, type: mock, latency_ms: 0, tokens: 3}}
    providers:
      - {{id: p2, adapter: m, capacity: 1}}
"""


async def test_a_node_removed_by_iop_refresh_from_an_edge_process_is_told_and_comes_back(tmp_path: Path) -> None:
    # The edge's embedded NATS gives each node its own user: a refresh that removes a node removes
    # its user too, so the node must hear it before the server closes its connection.
    text = TWO_NODES.format(nats_port=free_port(), store=tmp_path / "nats")
    both, only_n2 = tmp_path / "both.yaml", tmp_path / "n2.yaml"
    both.write_text(text)
    only_n2.write_text(
        text.replace("  - {alias: sim, pool: [p1]}\n", "").split("  - id: n1\n")[0]
        + "  - id: n2\n"
        + text.split("  - id: n2\n")[1]
    )
    async with iop_process("edge", "--config", str(both), stop_grace_s=10) as edge:
        m = await edge.wait_line(r"iop edge listening on (http://\S+)")
        url = m.group(1)
        async with iop_process("node", "--config", str(both), "--node", "n1", stop_grace_s=5) as node:
            await node.wait_line("serving")
            async with iop_process("refresh", "--config", str(only_n2), "--edge", url) as refresh:
                assert await refresh.exit_code() == 0, refresh.lines
            await node.wait_line("removed from the deployment")
            seen = len(node.lines)
            async with iop_process("refresh", "--config", str(both), "--edge", url) as refresh:
                assert await refresh.exit_code() == 0, refresh.lines
            added = time.monotonic()
            await node.wait_line("back in the deployment; serving", timeout_s=20)
            back_s = time.monotonic() - added
            quiet = node.lines[seen:]
            async with httpx.AsyncClient(base_url=url) as http:
                body = {"model": "sim", "messages": [{"role": "user", "content": "hi"}]}

                async def answered() -> bool:
                    return (await http.post("/v1/chat/completions", json=body)).status_code == 200

                await eventually(answered, timeout_s=10, every_s=0.2)
    assert sum("removed from the deployment" in line for line in node.lines) == 1, node.lines
    # While removed: one line each for the lost connection, the refused user, the regained connection.
    assert len(quiet) <= 3, quiet
    auth_errors = [line for line in edge.lines if "authentication error" in line]
    assert len(auth_errors) <= 1, auth_errors
    print(
        f"\nremoved by iop refresh (edge process): told before its NATS user went; back {back_s:.2f}s after re-adding"
    )
