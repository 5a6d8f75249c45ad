"""Model servers a node runs itself (an adapter's `server:` block): cold start, swap, idle stop, crash.

The servers are tests/model_server.py processes that take a known time to load; one nats-server
serves the whole module, each test its own deployment (own provider ids) on it.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import openai
import pytest
import pytest_asyncio
from click.testing import CliRunner

from iop import config
from iop.cli import main
from iop.contracts.status import PoolProviderStatus
from iop.edge.keys import EdgeKeys, Key
from iop.edge.ledger import RequestRecord
from iop.edge.usage_query import follow
from iop.errors import ConfigError
from iop.nats.server import EmbeddedNats
from iop.node.policy import NodePolicy
from iop.node.runtime import NodeRuntime
from iop.node.servers import ManagedServer
from iop.statusview import render_status
from tests.harness import (
    REPO,
    EdgeHandle,
    deployment,
    eventually,
    free_port,
    pid_gone,
    running_edge,
    running_node,
    until,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")

LOAD_S = 0.6
"""How long each fake server takes to load its model."""
SCRIPT = str(REPO / "tests" / "model_server.py")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def nats_url(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[str]:
    server = EmbeddedNats("127.0.0.1:0", tmp_path_factory.mktemp("nats"))
    await server.start()
    try:
        yield server.url
    finally:
        await server.stop()


def adapter_yaml(name: str, port: int, events: Path, **server: object) -> str:
    extra = "".join(f"\n          {k}: {v}" for k, v in server.items())
    command = [sys.executable, SCRIPT, "--port", str(port), "--name", name, "--load-s", str(LOAD_S)]
    command += ["--events", str(events)]
    return f"""
      - id: {name}
        type: openai
        base_url: http://127.0.0.1:{port}/v1
        server:
          command: [{", ".join(f'"{c}"' for c in command)}]
          ready_url: http://127.0.0.1:{port}/health
          stop_grace_s: 2
          restart_backoff_s: 0.2{extra}"""


def lifecycle_yaml(prefix: str, events: Path, names: list[str], capacity: int = 2, **server: object) -> str:
    ports = {n: free_port() for n in names}
    models = "".join(f"\n  - {{alias: {prefix}-{n}, pool: [{prefix}-{n}]}}" for n in names)
    adapters = "".join(adapter_yaml(n, ports[n], events, **server) for n in names)
    providers = "".join(f"\n      - {{id: {prefix}-{n}, adapter: {n}, capacity: {capacity}}}" for n in names)
    return f"""
edge:
  queue: {{timeout_s: 20}}
models:{models}
nodes:
  - id: {prefix}-node
    adapters:{adapters}
    providers:{providers}
"""


def server_of(node: NodeRuntime, provider: str) -> ManagedServer:
    s = node.resources[provider].server
    assert s is not None
    return s


def state_of(server: ManagedServer) -> str:
    return server.state  # read afresh: it changes while the test awaits


async def ask(h: EdgeHandle, model: str, prompt: str = "hi") -> str:
    chat = await (h.clients[0] if h.clients else h.client()).chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}]
    )
    return chat.choices[0].message.content or ""


def runs(events: Path) -> list[tuple[str, float, float]]:
    """(server, start, exit) of every process the events file saw; exit inf while it runs."""
    started: dict[str, tuple[str, float]] = {}
    out: list[tuple[str, float, float]] = []
    for line in events.read_text().splitlines():
        what, name, pid, at = line.split()
        if what == "start":
            started[pid] = (name, float(at))
        elif pid in started:
            name, t0 = started.pop(pid)
            out.append((name, t0, float(at)))
    return out + [(name, t0, float("inf")) for name, t0 in started.values()]


async def test_a_request_to_a_stopped_server_waits_for_its_cold_start_and_is_served(
    nats_url: str, tmp_path: Path
) -> None:
    events = tmp_path / "events"
    dep = deployment(lifecycle_yaml("cold", events, ["a"], idle_stop_s=30))
    async with running_edge(dep, nats_url) as h:
        records: list[RequestRecord] = []
        written = asyncio.Event()

        def sink(batch: list[RequestRecord]) -> None:
            records.extend(batch)
            written.set()

        sub = await follow(h.edge.js, "cold-a", sink)
        async with running_node(dep, "cold-node", nats_url) as node:
            await h.edge.registry.wait_connected(["cold-node"], timeout_s=10)
            server = server_of(node, "cold-a")
            assert state_of(server) == "stopped"  # idle_stop_s: started on demand, not with the node
            await h.client().models.list()  # the client's own first-call costs, outside the measure
            t0 = time.monotonic()
            assert await ask(h, "cold-a") == "hello from a"
            took = time.monotonic() - t0
            assert state_of(server) == "ready" and server.cold_starts == 1
            # The cold start: the process's own start (an interpreter here) and its load.
            cold_s = server.last_cold_start_ms / 1000
            assert cold_s >= LOAD_S
            assert LOAD_S <= took <= cold_s + 1.0
            t1 = time.monotonic()
            assert await ask(h, "cold-a") == "hello from a"
            assert time.monotonic() - t1 < LOAD_S  # warm now
            assert server.cold_starts == 1
            assert server.proc is not None
            pid = server.proc.pid

            # The ledger tells the request that waited for the cold start, and for how long.
            await until(lambda: len(records) >= 2, written, timeout_s=5)
            first, second = sorted(records, key=lambda r: r.start)
            assert first.cold_start_ms is not None and first.queue_ms is not None
            assert LOAD_S * 1000 <= first.cold_start_ms <= first.queue_ms
            assert second.cold_start_ms is None
            # /status, `iop status` and /metrics show the state, from the node's heartbeats.
            async with h.http() as http:

                async def shown() -> bool:
                    st = await h.status()
                    p = next(p for p in st.nodes[0].providers if p.id == "cold-a")
                    metrics = (await http.get("/metrics")).text
                    return (
                        isinstance(p, PoolProviderStatus)
                        and p.server is not None
                        and p.server.state == "ready"
                        and p.server.cold_starts == 1
                        and 'iop_provider_server_state{node="cold-node",provider="cold-a",state="ready"} 1.0' in metrics
                        and 'iop_cold_starts_total{node="cold-node",provider="cold-a"} 1.0' in metrics
                        and 'iop_server_swaps_total{node="cold-node",provider="cold-a"} 0.0' in metrics
                    )

                await eventually(shown, timeout_s=5)
            table = render_status(await h.status())
            assert re.search(r"cold-a\s+ready\s+\d+s ago\s+-\s+1\s+0\s+0\s+\d+\.\ds", table), table
        await sub.unsubscribe()
        # The node's stop ended its server's process group.
        assert pid_gone(pid)


async def test_a_swap_in_a_group_of_one_loses_no_request_and_never_runs_two_servers(
    nats_url: str, tmp_path: Path
) -> None:
    events = tmp_path / "events"
    dep = deployment(lifecycle_yaml("swap", events, ["a", "b"], idle_stop_s=30, group="gpu", group_size=1))
    async with running_edge(dep, nats_url) as h, running_node(dep, "swap-node", nats_url) as node:
        await h.edge.registry.wait_connected(["swap-node"], timeout_s=10)
        assert await ask(h, "swap-a") == "hello from a"
        # Requests for both at once: each model's turn comes, none is refused or lost.
        answers = await asyncio.gather(*(ask(h, f"swap-{n}") for n in ["b", "a", "b", "a"]))
        assert answers == [f"hello from {n}" for n in ["b", "a", "b", "a"]]
        a, b = server_of(node, "swap-a"), server_of(node, "swap-b")
        assert a.swaps + b.swaps >= 1
        intervals = sorted(runs(events), key=lambda r: r[1])
        assert len(intervals) >= 2
        for (_, _, end), (_, start, _) in itertools.pairwise(intervals):
            assert end <= start, f"two servers of a group of one ran at once: {intervals}"


async def test_an_idle_server_is_stopped_after_idle_stop_s(nats_url: str, tmp_path: Path) -> None:
    events = tmp_path / "events"
    dep = deployment(lifecycle_yaml("idle", events, ["a"], idle_stop_s=0.5))
    async with running_edge(dep, nats_url) as h, running_node(dep, "idle-node", nats_url) as node:
        await h.edge.registry.wait_connected(["idle-node"], timeout_s=10)
        assert await ask(h, "idle-a") == "hello from a"
        server = server_of(node, "idle-a")
        assert server.proc is not None
        pid, served = server.proc.pid, time.monotonic()
        await until(lambda: server.state == "stopped", node.changed, timeout_s=5)
        # Stopped once its last request had been over for idle_stop_s, and not much later.
        assert time.monotonic() - server.last_used >= 0.5
        assert time.monotonic() - served <= 0.5 + 1.0
        assert pid_gone(pid)
        assert [r[0] for r in runs(events)] == ["a"] and runs(events)[0][2] < float("inf")


async def test_a_server_that_dies_mid_request_fails_it_and_is_restarted_with_back_off(
    nats_url: str, tmp_path: Path
) -> None:
    events = tmp_path / "events"
    dep = deployment(lifecycle_yaml("crash", events, ["a"]))  # no idle_stop_s: always on
    async with running_edge(dep, nats_url) as h, running_node(dep, "crash-node", nats_url) as node:
        await h.edge.registry.wait_connected(["crash-node"], timeout_s=10)
        server = server_of(node, "crash-a")
        await until(lambda: server.state == "ready", node.changed, timeout_s=5)  # started with the node
        with pytest.raises(openai.APIStatusError) as failed:
            await ask(h, "crash-a", "die")
        assert failed.value.status_code == 502
        await until(lambda: server.state in ("failed", "starting"), node.changed, timeout_s=5)
        assert server.crashes == 1
        await until(lambda: server.state == "ready", node.changed, timeout_s=5)
        assert await ask(h, "crash-a") == "hello from a"
        assert len(runs(events)) == 2


async def test_a_server_block_is_checked_with_errors_named_by_path() -> None:
    text = lifecycle_yaml("bad", Path("/nonexistent"), ["a"], group="gpu", group_size=0)
    text = text.replace("ready_url:", "ready_log: '(('\n          ready_url:")
    with pytest.raises(ConfigError) as bad:
        config.parse(text)
    assert bad.value.problems == [
        "nodes[0].adapters[0].server.ready_log: '((' is not a regular expression: missing ), unterminated "
        "subpattern at position 1",
        "nodes[0].adapters[0].server.ready_log: use ready_url or ready_log, not both",
        "nodes[0].adapters[0].server.group_size: must be at least 1, got 0",
    ]


async def test_a_server_command_outside_the_nodes_policy_is_refused() -> None:
    dep = deployment(lifecycle_yaml("pol", Path("/nonexistent"), ["a"]))
    adapter = dep.nodes[0].adapters[0]
    assert NodePolicy(upstream_hosts=["127.0.0.1"]).refusal(adapter) == "server command not allowed"
    assert NodePolicy.of_node(dep.nodes[0]).refusal(adapter) is None


async def test_iop_provider_restart_restarts_a_managed_server_for_an_admin_only(nats_url: str, tmp_path: Path) -> None:
    events = tmp_path / "events"
    text = lifecycle_yaml("rst", events, ["a"])
    text = text.replace("    adapters:", "    adapters:\n      - {id: sim, type: mock}", 1)
    text += "      - {id: rst-sim, adapter: sim, capacity: 1}\n"
    text = text.replace("models:", "models:\n  - {alias: rst-sim, pool: [rst-sim]}", 1)
    dep = deployment(text)
    keys = EdgeKeys(clients=[Key("c", b"client-key")], admins=[Key("ops", b"admin-key")])
    async with running_edge(dep, nats_url, keys) as h, running_node(dep, "rst-node", nats_url) as node:
        await h.edge.registry.wait_connected(["rst-node"], timeout_s=10)
        server = server_of(node, "rst-a")
        await until(lambda: server.state == "ready", node.changed, timeout_s=5)
        assert server.proc is not None
        first = server.proc.pid
        async with h.http() as http:
            # A client key is no admin key: refused, and nothing restarts.
            r = await http.post("/admin/providers/rst-a/restart", headers={"authorization": "Bearer client-key"})
            assert r.status_code == 403, r.text
            admin = {"authorization": "Bearer admin-key"}
            r = await http.post("/admin/providers/nope/restart", headers=admin)
            assert r.status_code == 404 and r.json()["error"]["code"] == "provider_not_found"
            r = await http.post("/admin/providers/rst-sim/restart", headers=admin)
            assert r.status_code == 400 and r.json()["error"]["code"] == "no_server", r.text
        assert server.proc is not None and server.proc.pid == first
        args = ["provider", "restart", "rst-a", "--edge", h.url, "--admin-key", "admin-key"]
        done = await asyncio.to_thread(CliRunner().invoke, main, args)
        assert done.exit_code == 0, done.output
        assert done.output.strip() == "restarting the model server of rst-a (was ready)"
        await until(lambda: server.proc is not None and server.proc.pid != first, node.changed, timeout_s=5)
        await until(lambda: server.state == "ready", node.changed, timeout_s=5)
        assert pid_gone(first)
        client = h.client(api_key="client-key")
        chat = await client.chat.completions.create(model="rst-a", messages=[{"role": "user", "content": "hi"}])
        assert chat.choices[0].message.content == "hello from a"
        bad = await asyncio.to_thread(CliRunner().invoke, main, [*args[:2], "nope", *args[3:]])
        assert bad.exit_code == 1
        assert bad.output.count("\n") == 1 and "no provider 'nope'" in bad.output, bad.output
