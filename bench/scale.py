"""Scenario 5: dispatch and /status cost at 3, 30 and 300 providers; edge memory per waiting request.

Scale: N/3 simulated nodes (bench/simnodes.py: real NodeRuntimes sharing one process) with three
mock providers of capacity 1 each. Dispatch latency is a c=1 request through the edge to a
zero-latency mock (edge → NATS → node → back), measured twice: on a pool of all N providers (every
dispatch chooses among all N, successive requests visit every node) and on a pool of the first
node's three (the same node answers; the other nodes only stay connected). The second isolates
what N costs the edge and NATS from what it costs the simulation, whose hundred nodes share one
process and one core's worth of event loop. /status is timed and weighed as served.

Memory: one pool of capacity 1 whose mock answers after ten minutes, filled with N concurrent
requests (each on its own connection): one runs, N-1 wait in the edge. The edge's resident memory
before and with them, divided by N, is what a waiting request costs.
"""

from __future__ import annotations

import asyncio
import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import load
from bench.measure import Measured, run_measured, spread
from bench.procs import Owned, cpu_s, http, http_json, log, rss_bytes, settled_rss, wait_until
from bench.stack import mock_node, start_stack


@dataclass
class ScaleOptions:
    levels: list[int] = field(default_factory=lambda: [3, 30, 300])
    seconds: float = 3.0
    rounds: int = 3
    status_gets: int = 40
    waiting: int = 10_000
    storage: str = "file"
    archive: Path | None = None


def run_scale(owned: Owned, workdir: Path, opts: ScaleOptions) -> dict[str, Any]:
    levels = [_level(owned, workdir, n, opts) for n in opts.levels]
    return {"levels": levels}


def _level(owned: Owned, workdir: Path, providers: int, opts: ScaleOptions) -> dict[str, Any]:
    n_nodes = max(1, providers // 3)
    nodes = [
        mock_node(f"sim{i:03d}", [f"sim{i:03d}-{x}" for x in "abc"], capacity=1, latency_ms=0, tokens=4)
        for i in range(n_nodes)
    ]
    members = [p["id"] for n in nodes for p in n["providers"]]
    stack = start_stack(
        owned,
        workdir,
        f"scale{providers}",
        # `all` spans every provider; `one` only the first node's, so the same node answers every
        # time while all the others stay connected: the cost of N on the edge and NATS alone.
        models=[{"alias": "all", "pool": members}, {"alias": "one", "pool": members[:3]}],
        nodes=nodes,
        storage=opts.storage,
        archive=opts.archive,
        node_procs="sim",
        ready_timeout_s=180,
    )
    edge_port = int(stack.url.rsplit(":", 1)[1])
    target = load.Target("127.0.0.1", edge_port, "/v1/chat/completions")
    counters = {
        "edge": stack.edge.cpu_s,
        "simnodes": lambda: sum(p.cpu_s() for p in stack.nodes),
        "nats": lambda: cpu_s(stack.nats_pid) if stack.nats_pid else 0.0,
    }
    try:
        idle = _idle_cores(counters, 2.0)
        warm = load.LoadSpec(
            target, load.body_of("chat", "all", False), concurrency=4, requests=max(300, 2 * providers)
        )
        load.run(warm)
        runs: dict[str, list[Measured]] = {"all": [], "one": []}
        status_ms: list[float] = []
        summary_ms: list[float] = []
        floor_ms: list[float] = []
        size = summary_size = 0
        for r in range(opts.rounds):
            for alias in ("all", "one") if r % 2 == 0 else ("one", "all"):
                spec = load.LoadSpec(
                    target, load.body_of("chat", alias, False), requests=50_000, max_seconds=opts.seconds, warmup=10
                )
                runs[alias].append(run_measured(spec, counters))
            # Each in its own run of GETs, so that the garbage of one (the full document at 300
            # providers is 115 KB) is not collected during the other's; the floor is an answer
            # whose size does not depend on the catalog at all.
            floor_ms += _timed_gets(stack.url + "/v1/models", opts.status_gets)[0]
            ms, summary_size = _timed_gets(stack.url + "/status?view=summary", opts.status_gets)
            summary_ms += ms
            ms, size = _timed_gets(stack.url + "/status", opts.status_gets)
            status_ms += ms
        st = stack.status()
        connected = sum(1 for n in st["nodes"] if n["connected"])
    finally:
        stack.stop()

    def p(ms: list[Measured], key: str) -> dict[str, float] | None:
        return spread([m.load.latency_ms[key] if m.load.latency_ms else None for m in ms])

    dispatch, one_node = p(runs["all"], "p50"), p(runs["one"], "p50")
    res: dict[str, Any] = {
        "providers": providers,
        "nodes": n_nodes,
        "nodes_connected": connected,
        "dispatch_p50_ms": dispatch,
        "dispatch_p99_ms": p(runs["all"], "p99"),
        "one_node_p50_ms": one_node,
        "one_node_p99_ms": p(runs["one"], "p99"),
        "rps_c1": spread([m.load.rps for m in runs["all"]], 1),
        "edge_cpu_ms_per_request": spread([m.per_1k("edge") for m in runs["all"]]),
        "simnodes_cpu_ms_per_request": spread([m.per_1k("simnodes") for m in runs["all"]]),
        "idle_cores": idle,
        "errors": sum(sum(m.load.errors.values()) for ms in runs.values() for m in ms),
        "status_ms_p50": round(statistics.median(status_ms), 3),
        "status_ms_p90": round(load.pct(sorted(status_ms), 90), 3),
        "status_bytes": size,
        "status_us_per_provider": round(1000 * statistics.median(status_ms) / providers, 2),
        "summary_ms_p50": round(statistics.median(summary_ms), 3),
        "summary_ms_p90": round(load.pct(sorted(summary_ms), 90), 3),
        "summary_bytes": summary_size,
        "models_ms_p50": round(statistics.median(floor_ms), 3),
        "other_cores": spread([m.other_cores for ms in runs.values() for m in ms], 2),
        "ready_s": stack.started_s,
    }
    log(
        f"scale {providers}: dispatch p50 {_m(dispatch)} ms (one node {_m(one_node)} ms),"
        f" /status {res['status_ms_p50']} ms {size} B, summary {res['summary_ms_p50']} ms {summary_size} B,"
        f" idle cores {idle}, nodes {connected}/{n_nodes}"
    )
    return res


def _timed_gets(url: str, n: int) -> tuple[list[float], int]:
    """Milliseconds of `n` GETs of `url` (a new connection each, as a monitor's poll), and the size."""
    ms = []
    size = 0
    for _ in range(n):
        t0 = time.perf_counter()
        status, raw = http("GET", url)
        ms.append((time.perf_counter() - t0) * 1000)
        if status != 200:
            raise RuntimeError(f"GET {url} answered {status}")
        size = len(raw)
    return ms, size


def _m(s: dict[str, float] | None) -> str:
    return "n/a" if s is None else f"{s['median']:.2f}"


def _idle_cores(counters: dict[str, Callable[[], float]], seconds: float) -> dict[str, float]:
    """What each process burns with no request at all: heartbeats, pull requests, timers."""
    before = {k: f() for k, f in counters.items()}
    time.sleep(seconds)
    return {k: round((f() - before[k]) / seconds, 3) for k, f in counters.items()}


def raise_fd_limit(need: int) -> int:
    """Raise this process's soft open-file limit toward `need` (up to the hard limit); the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, max(soft, need)) if hard != resource.RLIM_INFINITY else max(soft, need)
    if want > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def run_memory(owned: Owned, workdir: Path, opts: ScaleOptions) -> dict[str, Any]:
    limit = raise_fd_limit(opts.waiting + 512)
    n = min(opts.waiting, limit - 512)
    if n < opts.waiting:
        log(f"memory: open-file limit {limit} allows {n} waiting requests, not {opts.waiting}")
    node = mock_node("mem-node", ["slow"], capacity=1, latency_ms=600_000, tokens=4)
    node["adapters"].append({"id": "fast", "type": "mock", "latency_ms": 0, "tokens": 4, "token_interval_ms": 0})
    node["providers"].append({"id": "quick", "adapter": "fast", "capacity": 4})
    stack = start_stack(
        owned,
        workdir,
        "memory",
        models=[{"alias": "slow", "pool": ["slow"]}, {"alias": "fast", "pool": ["quick"]}],
        nodes=[node],
        storage=opts.storage,
        archive=opts.archive,
        max_waiting=max(n + 10, 1000),
        # Every held request is its own connection: past edge.http.max_connections (4,096 by
        # default) the edge answers 503 at once instead of letting it wait.
        edge_extra={"http": {"max_connections": n + 1024}},
    )
    edge_port = int(stack.url.rsplit(":", 1)[1])
    pid = stack.edge.pid
    try:
        fast = load.Target("127.0.0.1", edge_port, "/v1/chat/completions")
        load.run(load.LoadSpec(fast, load.body_of("chat", "fast", False), concurrency=8, requests=2000))
        for _ in range(3):
            http_json("GET", stack.url + "/status")
        time.sleep(0.5)  # let the allocator settle after the warm-up
        idle = rss_bytes(pid)
        got = asyncio.run(_hold(stack.url, edge_port, n, pid))
        after_close = settled_rss(stack.url, pid)
    finally:
        stack.stop()
    per = (got["rss_full"] - idle) / max(1, got["waiting"])
    res = {
        "asked": opts.waiting,
        "held": n,
        "waiting": got["waiting"],
        "connect_failures": got["connect_failures"],
        "fill_s": got["fill_s"],
        "edge_rss_idle_mb": round(idle / 2**20, 1),
        "edge_rss_full_mb": round(got["rss_full"] / 2**20, 1),
        "edge_rss_after_release_mb": round(after_close / 2**20, 1),
        "bytes_per_waiting": round(per),
        "status_ms_while_full": got["status_ms"],
    }
    log(f"memory: {got['waiting']} waiting, {res['bytes_per_waiting']} B each (idle {res['edge_rss_idle_mb']} MB)")
    return res


async def _hold(url: str, edge_port: int, n: int, pid: int) -> dict[str, Any]:
    held = load.Held()
    t0 = time.monotonic()
    try:
        await held.open(
            load.Target("127.0.0.1", edge_port, "/v1/chat/completions"), load.body_of("chat", "slow", False), n
        )
        loop = asyncio.get_running_loop()

        def full() -> bool:
            st = http_json("GET", url + "/status", timeout=30)
            pool = next(p for p in st["pools"] if p["alias"] == "slow")
            return int(pool["waiting"]) + int(pool["dispatched_in_flight"]) >= len(held.conns)

        await loop.run_in_executor(None, lambda: wait_until("all held requests at the edge", full, 120))
        fill_s = time.monotonic() - t0
        await asyncio.sleep(0.5)
        t1 = time.perf_counter()
        st = await loop.run_in_executor(None, lambda: http_json("GET", url + "/status", timeout=30))
        status_ms = round((time.perf_counter() - t1) * 1000, 1)
        pool = next(p for p in st["pools"] if p["alias"] == "slow")
        rss = rss_bytes(pid)
        return {
            "waiting": int(pool["waiting"]),
            "rss_full": rss,
            "fill_s": round(fill_s, 2),
            "status_ms": status_ms,
            "connect_failures": held.failed_connects,
        }
    finally:
        held.close()
