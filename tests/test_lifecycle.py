"""Model servers a node runs itself (an adapter's `server:` block): cold start, swap, idle stop, crash.

The servers are tests/model_server.py processes that take a known time to load. One nats-server,
edge and node serve the whole module; each test has its own servers (providers and aliases of the
same name) on that node.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import re
import signal
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
import pytest_asyncio
from click.testing import CliRunner

from iop import config, configview
from iop.cli import main
from iop.client import EdgeClient
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
    broker_counts,
    deployment,
    eventually,
    free_port,
    node_process,
    pid_gone,
    running_edge,
    running_node,
    until,
    wait_gone,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")

LOAD_S = 0.3
"""How long each fake server takes to load its model."""
SCRIPT = str(REPO / "tests" / "model_server.py")
CLIENT_KEY, ADMIN_KEY = "client-key", "admin-key"
SERVERS: dict[str, dict[str, object]] = {
    "cold": {"idle_stop_s": 30},
    "swapa": {"idle_stop_s": 30, "group": "gpu", "group_size": 1},
    "swapb": {"idle_stop_s": 30, "group": "gpu", "group_size": 1},
    "idle": {"idle_stop_s": 0.5, "ready_log": "'^model loaded$'"},
    "crash": {},  # no idle_stop_s: always on, started with the node
    "rst": {},
    "slow": {"idle_stop_s": 30, "load_s": 30},
    "burst": {"idle_stop_s": 30, "load_s": 1.0},
    "never": {"idle_stop_s": 30, "load_s": 30, "start_timeout_s": 0.5},
    "duoa": {"idle_stop_s": 30, "group": "duo", "group_size": 2},
    "duob": {"idle_stop_s": 30, "group": "duo", "group_size": 2},
    "duoc": {"idle_stop_s": 30, "group": "duo", "group_size": 2},
}
"""The servers of node `life`, one or two per test."""


def adapter_yaml(name: str, port: int, events: Path, **server: object) -> str:
    load_s = server.pop("load_s", LOAD_S)
    ready = "" if "ready_log" in server else f"\n          ready_url: http://127.0.0.1:{port}/health"
    extra = "".join(f"\n          {k}: {v}" for k, v in server.items())
    command = [sys.executable, SCRIPT, "--port", str(port), "--name", name, "--load-s", str(load_s)]
    command += ["--events", str(events)]
    return f"""
      - id: {name}
        type: openai
        base_url: http://127.0.0.1:{port}/v1
        server:
          command: [{", ".join(f'"{c}"' for c in command)}]{ready}
          stop_grace_s: 2
          restart_backoff_s: 0.2{extra}"""


def node_yaml(node: str, events: Path, servers: dict[str, dict[str, object]], mock: str = "") -> str:
    adapters = "".join(adapter_yaml(n, free_port(), events / n, **dict(opts)) for n, opts in servers.items())
    providers = "".join(f"\n      - {{id: {n}, adapter: {n}, capacity: 2}}" for n in servers)
    if mock:
        adapters += "\n      - {id: sim, type: mock}"
        providers += f"\n      - {{id: {mock}, adapter: sim, capacity: 1}}"
    return f"""
  - id: {node}
    adapters:{adapters}
    providers:{providers}"""


def lifecycle_yaml(events: Path) -> str:
    models = "".join(f"\n  - {{alias: {n}, pool: [{n}]}}" for n in [*SERVERS, "sim", "last"])
    nodes = node_yaml("life", events, SERVERS, mock="sim") + node_yaml("short", events, {"last": {}})
    return f"""
edge:
  queue: {{timeout_s: 20}}
models:{models}
nodes:{nodes}
"""


@dataclass
class Life:
    h: EdgeHandle
    node: NodeRuntime
    dep: config.Deployment
    nats_url: str
    events: Path
    """One file per server: the `start` and `exit` lines of each of its processes."""
    text: str
    """The deployment file."""


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def life(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Life]:
    """One nats-server, an edge with client and admin keys, and node `life` running SERVERS."""
    nats = EmbeddedNats("127.0.0.1:0", tmp_path_factory.mktemp("nats"))
    await nats.start()
    events = tmp_path_factory.mktemp("events")
    text = lifecycle_yaml(events)
    dep = deployment(text)
    keys = EdgeKeys(clients=[Key("c", CLIENT_KEY.encode())], admins=[Key("ops", ADMIN_KEY.encode())])
    try:
        async with running_edge(dep, nats.url, keys) as h, running_node(dep, "life", nats.url) as node:
            await h.edge.registry.wait_connected(["life"], timeout_s=10)
            h.client(api_key=CLIENT_KEY)
            yield Life(h, node, dep, nats.url, events, text)
    finally:
        await nats.stop()


def server_of(node: NodeRuntime, provider: str) -> ManagedServer:
    s = node.resources[provider].server
    assert s is not None
    return s


def state_of(server: ManagedServer) -> str:
    return server.state  # read afresh: it changes while the test awaits


async def ask(h: EdgeHandle, model: str, prompt: str = "hi") -> str:
    chat = await h.clients[0].chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}])
    return chat.choices[0].message.content or ""


def runs(*files: Path) -> list[tuple[str, float, float]]:
    """(server, start, exit) of every process the events files saw; exit inf while it runs."""
    started: dict[str, tuple[str, float]] = {}
    out: list[tuple[str, float, float]] = []
    for f in files:
        for line in f.read_text().splitlines():
            what, name, pid, at = line.split()
            if what == "start":
                started[pid] = (name, float(at))
            elif pid in started:
                name, t0 = started.pop(pid)
                out.append((name, t0, float(at)))
    return out + [(name, t0, float("inf")) for name, t0 in started.values()]


async def test_a_request_to_a_stopped_server_waits_for_its_cold_start_and_is_served(life: Life) -> None:
    h, node = life.h, life.node
    records: list[RequestRecord] = []
    written = asyncio.Event()

    def sink(batch: list[RequestRecord]) -> None:
        records.extend(batch)
        written.set()

    sub = await follow(h.edge.js, "cold", sink)
    server = server_of(node, "cold")
    assert state_of(server) == "stopped"  # idle_stop_s: started on demand, not with the node
    t0 = time.monotonic()
    assert await ask(h, "cold") == "hello from cold"
    took = time.monotonic() - t0
    assert state_of(server) == "ready" and server.cold_starts == 1
    # The cold start: the process's own start (an interpreter here) and its load.
    cold_s = server.last_cold_start_ms / 1000
    assert cold_s >= LOAD_S
    assert LOAD_S <= took <= cold_s + 1.0
    assert await ask(h, "cold") == "hello from cold"
    assert server.cold_starts == 1  # warm now: served without another start

    # The ledger tells the request that waited for the cold start, and for how long.
    await until(lambda: len(records) >= 2, written, timeout_s=5)
    await sub.unsubscribe()
    first, second = sorted(records, key=lambda r: r.start)
    assert first.cold_start_ms is not None and first.queue_ms is not None
    assert LOAD_S * 1000 <= first.cold_start_ms <= first.queue_ms
    assert second.cold_start_ms is None
    # /status, `iop status` and /metrics show the state, from the node's heartbeats.
    auth = {"authorization": f"Bearer {CLIENT_KEY}"}
    async with h.http() as http:

        async def shown() -> bool:
            st = (await http.get("/status", headers=auth)).json()
            p = next(p for p in st["nodes"][0]["providers"] if p["id"] == "cold")
            metrics = (await http.get("/metrics", headers=auth)).text
            return (
                (p.get("server") or {}).get("state") == "ready"
                and p["server"]["cold_starts"] == 1
                and 'iop_provider_server_state{node="life",provider="cold",state="ready"} 1.0' in metrics
                and 'iop_cold_starts_total{node="life",provider="cold"} 1.0' in metrics
                and 'iop_server_swaps_total{node="life",provider="cold"} 0.0' in metrics
            )

        await eventually(shown, timeout_s=5)
    async with EdgeClient(h.url, api_key=CLIENT_KEY) as edge:
        status = await edge.status()  # as `iop status` reads it
    table = render_status(status)
    assert re.search(r"cold\s+ready\s+\d+s ago\s+-\s+1\s+0\s+0\s+\d+\.\ds", table), table
    p = next(p for p in status.nodes[0].providers if p.id == "cold")
    assert isinstance(p, PoolProviderStatus) and p.server is not None and p.server.state == "ready"


async def test_a_swap_in_a_group_of_one_loses_no_request_and_never_runs_two_servers(life: Life) -> None:
    h, node = life.h, life.node
    assert await ask(h, "swapa") == "hello from swapa"
    # Requests for both at once: each model's turn comes, none is refused or lost.
    order = ["swapb", "swapa", "swapb", "swapa"]
    answers = await asyncio.gather(*(ask(h, n) for n in order))
    assert answers == [f"hello from {n}" for n in order]
    a, b = server_of(node, "swapa"), server_of(node, "swapb")
    assert a.swaps + b.swaps >= 1
    intervals = sorted(runs(life.events / "swapa", life.events / "swapb"), key=lambda r: r[1])
    assert len(intervals) >= 2
    for (_, _, end), (_, start, _) in itertools.pairwise(intervals):
        assert end <= start, f"two servers of a group of one ran at once: {intervals}"


async def test_an_idle_server_is_stopped_after_idle_stop_s(life: Life, caplog: pytest.LogCaptureFixture) -> None:
    h, node = life.h, life.node
    caplog.set_level(logging.INFO, logger="iop.node.server")
    assert await ask(h, "idle") == "hello from idle"  # ready on its log line (ready_log)
    # The server's own output is the node's log, under its provider's name.
    assert "[idle] fake model server idle loading for 0.3s" in caplog.messages
    assert "[idle] model loaded" in caplog.messages
    server = server_of(node, "idle")
    assert server.proc is not None
    pid, served = server.proc.pid, time.monotonic()
    await until(lambda: server.state == "stopped", node.changed, timeout_s=5)
    # Stopped once its last request had been over for idle_stop_s, and not much later.
    assert time.monotonic() - server.last_used >= 0.5
    assert time.monotonic() - served <= 0.5 + 1.5
    assert pid_gone(pid)
    assert [(name, end < float("inf")) for name, _, end in runs(life.events / "idle")] == [("idle", True)]


async def test_a_server_that_dies_mid_request_fails_it_and_is_restarted_with_back_off(life: Life) -> None:
    h, node = life.h, life.node
    server = server_of(node, "crash")
    await until(lambda: server.state == "ready", node.changed, timeout_s=5)  # started with the node
    with pytest.raises(openai.APIStatusError) as failed:
        await ask(h, "crash", "die")
    assert failed.value.status_code == 502
    await until(lambda: server.state in ("failed", "starting"), node.changed, timeout_s=5)
    assert server.crashes == 1
    await until(lambda: server.state == "ready", node.changed, timeout_s=5)
    assert await ask(h, "crash") == "hello from crash"
    (_, _, died), (_, again, _) = sorted(runs(life.events / "crash"), key=lambda r: r[1])
    assert again - died >= 0.2  # restart_backoff_s: not at once


async def test_requests_waiting_for_a_cold_start_hold_no_more_than_the_capacity(life: Life) -> None:
    h, node = life.h, life.node
    server = server_of(node, "burst")  # capacity 2, loads for 1 s
    asked = [asyncio.create_task(ask(h, "burst")) for _ in range(4)]

    async def held() -> bool:
        # Two taken by the node and waiting for the server; two waiting: one standing by in the
        # broker (edge.queue.standby: 1), which delivers it to no one, one in the edge's queue.
        return (
            server.state == "starting"
            and server.waiting == 2
            and await broker_counts(h.edge.js, "burst") == (2, 1)
            and h.edge.scheduler.waiting("burst") == 2
        )

    await eventually(held, timeout_s=5)
    assert await asyncio.gather(*asked) == ["hello from burst"] * 4
    assert node.resources["burst"].peak_in_flight == 2 and server.cold_starts == 1


async def test_a_client_that_leaves_during_a_cold_start_leaves_nothing_held_on_the_node(life: Life) -> None:
    h, node = life.h, life.node
    server = server_of(node, "slow")  # loads for 30 s
    client = h.clients[0].with_options(timeout=1.0)
    with pytest.raises(openai.APITimeoutError):
        await client.chat.completions.create(model="slow", messages=[{"role": "user", "content": "hi"}])
    assert state_of(server) == "starting"

    async def let_go() -> bool:
        # The node gave up its wait and its work message: nothing waits for the server, nothing is
        # held or queued at the broker for the provider.
        return server.waiting == 0 and await broker_counts(h.edge.js, "slow") == (0, 0)

    await eventually(let_go, timeout_s=5)
    assert node.requests() == []


async def test_iop_provider_restart_restarts_a_managed_server_for_an_admin_only(life: Life) -> None:
    h, node = life.h, life.node
    server = server_of(node, "rst")
    await until(lambda: server.state == "ready", node.changed, timeout_s=5)
    assert server.proc is not None
    first = server.proc.pid
    async with h.http() as http:
        # A client key is no admin key: refused, and nothing restarts.
        r = await http.post("/admin/providers/rst/restart", headers={"authorization": f"Bearer {CLIENT_KEY}"})
        assert r.status_code == 403, r.text
        admin = {"authorization": f"Bearer {ADMIN_KEY}"}
        r = await http.post("/admin/providers/nope/restart", headers=admin)
        assert r.status_code == 404 and r.json()["error"]["code"] == "provider_not_found"
        r = await http.post("/admin/providers/sim/restart", headers=admin)
        assert r.status_code == 400 and r.json()["error"]["code"] == "no_server", r.text
    assert server.proc is not None and server.proc.pid == first
    args = ["provider", "restart", "rst", "--edge", h.url, "--admin-key", ADMIN_KEY]
    done = await asyncio.to_thread(CliRunner().invoke, main, args)
    assert done.exit_code == 0, done.output
    assert done.output.strip() == "restarting the model server of rst (was ready)"
    await until(lambda: server.proc is not None and server.proc.pid != first, node.changed, timeout_s=5)
    await until(lambda: server.state == "ready", node.changed, timeout_s=5)
    assert pid_gone(first)
    assert await ask(h, "rst") == "hello from rst"
    bad = await asyncio.to_thread(CliRunner().invoke, main, [*args[:2], "nope", *args[3:]])
    assert bad.exit_code == 1
    assert bad.output.count("\n") == 1 and "no provider 'nope'" in bad.output, bad.output


async def test_a_stopping_node_ends_its_servers(life: Life) -> None:
    async with running_node(life.dep, "short", life.nats_url) as short:
        server = server_of(short, "last")
        await until(lambda: server.state == "ready", short.changed, timeout_s=5)
        assert server.proc is not None
        pid = server.proc.pid
    # What the node does on SIGTERM (iop/node/main.py): its stop ends the server's process group.
    assert pid_gone(pid)


async def test_a_server_not_ready_within_start_timeout_fails_its_request_with_503_and_holds_nothing(
    life: Life,
) -> None:
    h, node = life.h, life.node
    server = server_of(node, "never")  # loads for 30 s; start_timeout_s 0.5
    with pytest.raises(openai.APIStatusError) as failed:
        await ask(h, "never")
    assert failed.value.status_code == 503
    error = failed.value.response.json()["error"]
    assert error["code"] == "server_not_ready" and error["type"] == "server_error"
    assert error["message"] == "the model server of never was not ready within its start_timeout_s (0.5 s)"
    # Nothing held: the edge's slot, the broker's message, the node's wait, the server process.
    assert h.edge.scheduler.providers["never"].in_flight == 0 and h.edge.scheduler.waiting("never") == 0

    async def let_go() -> bool:
        return server.waiting == 0 and await broker_counts(h.edge.js, "never") == (0, 0)

    await eventually(let_go, timeout_s=5)
    ((_, _, ended),) = runs(life.events / "never")
    assert ended < float("inf")
    # Nobody waits for it any more: after its back-off it stays stopped until a request comes.
    await until(lambda: server.state == "stopped", node.changed, timeout_s=5)
    assert server.proc is None and node.requests() == []


async def test_a_group_of_two_runs_two_servers_at_most_and_a_third_swaps_out_the_least_recently_used(
    life: Life,
) -> None:
    h, node = life.h, life.node
    a, b, c = (server_of(node, n) for n in ("duoa", "duob", "duoc"))
    assert await ask(h, "duoa") == "hello from duoa"
    assert await ask(h, "duob") == "hello from duob"
    assert (a.state, b.state, c.state) == ("ready", "ready", "stopped")  # room for two: no swap yet
    assert await ask(h, "duoa") == "hello from duoa"  # duob is now the least recently used
    assert await ask(h, "duoc") == "hello from duoc"
    assert (a.state, c.state) == ("ready", "ready") and b.state in ("draining", "stopped")
    assert c.swaps == 1 and a.swaps == 0 and b.swaps == 0
    # Requests for all three at once: each is served, and never more than two ran at a time.
    order = ["duob", "duoa", "duoc", "duob", "duoa", "duoc"]
    assert await asyncio.gather(*(ask(h, n) for n in order)) == [f"hello from {n}" for n in order]
    events = [life.events / n for n in ("duoa", "duob", "duoc")]
    edges = sorted((t, d) for _, start, end in runs(*events) for t, d in ((start, 1), (end, -1)))
    running = peak = 0
    for _, d in edges:
        running += d
        peak = max(peak, running)
    assert peak == 2, runs(*events)


def started_pids(events: Path) -> list[int]:
    if not events.exists():
        return []
    return [int(line.split()[2]) for line in events.read_text().splitlines() if line.startswith("start ")]


async def test_a_node_killed_by_sigkill_takes_its_servers_with_it(life: Life, tmp_path: Path) -> None:
    cfg = tmp_path / "iop.yaml"
    cfg.write_text(life.text)
    before = started_pids(life.events / "last")
    async with node_process(cfg, "short", life.nats_url) as short:

        async def server_started() -> bool:
            return len(started_pids(life.events / "last")) > len(before)

        await eventually(server_started, timeout_s=10)
        (pid,) = started_pids(life.events / "last")[len(before) :]
        assert not pid_gone(pid)
        short.kill()  # no stop of its own runs: the kernel ends the server (PR_SET_PDEATHSIG)
        try:
            await wait_gone(pid, timeout_s=5)
        finally:
            if not pid_gone(pid):
                os.kill(pid, signal.SIGKILL)  # the test's own leftover: not left to outlive the run
    assert pid_gone(pid)


async def test_a_server_block_is_checked_with_errors_named_by_path() -> None:
    text = lifecycle_yaml(Path("/nonexistent")).replace("stop_grace_s: 2", "stop_grace_s: 0", 1)
    text = text.replace("ready_url:", "ready_log: '(('\n          ready_url:", 1)
    text = text.replace("group_size: 1", "group_size: 2", 1)
    with pytest.raises(ConfigError) as bad:
        config.parse(text)
    assert bad.value.problems == [
        "nodes[0].adapters[0].server.ready_log: '((' is not a regular expression: missing ), unterminated "
        "subpattern at position 1",
        "nodes[0].adapters[0].server.ready_log: use ready_url or ready_log, not both",
        "nodes[0].adapters[0].server.stop_grace_s: must be greater than 0, got 0",
        "nodes[0].adapters[2].server.group_size: group 'gpu' has group_size 2 at "
        "nodes[0].adapters[1].server.group_size; one group, one size",
    ]


async def test_iop_config_check_says_which_servers_the_node_runs() -> None:
    summary = configview.summary(config.parse(lifecycle_yaml(Path("/nonexistent"))))
    line = next(x for x in summary.splitlines() if x.strip().startswith("swapa "))
    assert f"server run by the node: {sys.executable} {SCRIPT} --port" in line
    assert line.endswith("stopped after 30s idle, group gpu (1 at once)")
    assert next(x for x in summary.splitlines() if x.strip().startswith("crash ")).endswith("always on")


async def test_a_server_command_outside_the_nodes_policy_is_refused() -> None:
    dep = deployment(lifecycle_yaml(Path("/nonexistent")))
    adapter = dep.nodes[0].adapters[0]
    assert NodePolicy(upstream_hosts=["127.0.0.1"]).refusal(adapter) == "server command not allowed"
    assert NodePolicy.of_node(dep.nodes[0]).refusal(adapter) is None
