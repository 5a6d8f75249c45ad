"""Scenario `bodies`: agent-sized request bodies, A/B against direct, interleaved request by request.

Bodies of 1 KB, 100 KB, 800 KB and 3 MB shaped like an agent's turn (bench/fixtures.py), chat and
Responses (passed through to an upstream that speaks it, and translated for a chat-only one),
whole and streamed. One request at a time, each on a fresh connection (as agents' clients often
do), DIRECT and VIA IOP alternating request by request, so the shared machine's drift hits both
arms alike. Added = iop - direct of each pair, p50 over the pairs; "above the floor" subtracts
the floor's p50 at the same size (bench/floor.py, measured in the same run). Then the edge's
memory with many such requests waiting on a saturated pool, and what the budget refused.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import fixtures, floor, load
from bench.abtest import start_upstream
from bench.procs import (
    Owned,
    Proc,
    busy_cores,
    cpu_s,
    free_port,
    http_json,
    log,
    machine_ticks,
    rss_bytes,
    settled_rss,
    wait_until,
)
from bench.scale import raise_fd_limit
from bench.stack import Stack, start_stack

# api name in the table → (API the client speaks, model alias through iop)
APIS = {
    "chat": ("chat", "bench"),
    "responses": ("responses", "bench"),
    "responses→chat": ("responses", "bench-chat"),
    "responses stored": ("responses", "bench"),
}
STORED = frozenset({"responses stored"})
"""Arms whose request leaves `store` out, as the openai SDK does unless told (the others send
`false`, as Codex does): the edge keeps the turn, its input included, in the response store before
the answer's end leaves."""


@dataclass
class BodiesOptions:
    sizes: list[int] = field(default_factory=lambda: [1_000, 100_000, 800_000, 3_000_000])
    apis: list[str] = field(default_factory=lambda: list(APIS))
    modes: list[str] = field(default_factory=lambda: ["whole", "stream"])
    requests: int = 20
    """Pairs (direct + iop) measured per cell, after 2 unmeasured ones."""
    waiting: int = 200
    waiting_sizes: list[int] = field(default_factory=lambda: [800_000, 3_000_000])
    storage: str = "file"
    archive: Path | None = None
    latency: str = "0"
    """The upstream's delay before its first byte (bench/upstream.py's spec), as a model's prefill of
    a long input would take: what iop does meanwhile (a kept turn's input written ahead) is then
    off the client's path. Both arms pay it, so `added` still compares them."""


def _size_name(n: int) -> str:
    return f"{n // 1_000_000} MB" if n >= 1_000_000 else f"{n // 1000} KB"


def run_bodies(owned: Owned, workdir: Path, opts: BodiesOptions) -> dict[str, Any]:
    port = free_port()
    upstream = start_upstream(owned, "bodies-upstream", [port], "--tokens", "16", "--latency", opts.latency)
    node = {
        "id": "bodies-node",
        "adapters": [
            {"id": "both", "type": "openai", "base_url": f"http://127.0.0.1:{port}/v1", "api": "both"},
            {"id": "chat", "type": "openai", "base_url": f"http://127.0.0.1:{port}/v1", "api": "chat"},
            {"id": "slow", "type": "mock", "latency_ms": 600_000, "tokens": 4, "token_interval_ms": 0},
        ],
        "providers": [
            {"id": "fake", "adapter": "both", "model": "fake-model", "capacity": 4},
            {"id": "chatonly", "adapter": "chat", "model": "fake-model", "capacity": 4},
            {"id": "slow", "adapter": "slow", "capacity": 1},
        ],
    }
    stack = start_stack(
        owned,
        workdir,
        "bodies",
        models=[
            {"alias": "bench", "pool": ["fake"]},
            {"alias": "bench-chat", "pool": ["chatonly"]},
            {"alias": "slow", "pool": ["slow"]},
        ],
        nodes=[node],
        storage=opts.storage,
        archive=opts.archive,
        edge_extra={"http": {"max_connections": opts.waiting + 1024}},
    )
    edge_port = int(stack.url.rsplit(":", 1)[1])
    try:
        cells = _cells(stack, upstream, port, edge_port, opts)
        floors = _floor(owned, workdir, opts)
        for c in cells:
            f = floors.get(str(c["bytes_asked"]), {}).get("latency_ms")
            c["floor_p50_ms"] = f["p50"] if f else None
            c["above_floor_p50_ms"] = round(c["added_p50_ms"] - f["p50"], 3) if f else None
        waiting = [_waiting(stack, edge_port, size, opts.waiting) for size in opts.waiting_sizes]
    finally:
        stack.stop()
        owned.stop(upstream)
    return {"cells": cells, "floor": floors, "waiting": waiting}


def _cells(stack: Stack, upstream: Proc, port: int, edge_port: int, opts: BodiesOptions) -> list[dict[str, Any]]:
    ours: dict[str, Callable[[], float]] = {
        "edge": stack.edge.cpu_s,
        "node": lambda: sum(n.cpu_s() for n in stack.nodes),
        "nats": lambda: cpu_s(stack.nats_pid) if stack.nats_pid else 0.0,
        "upstream": upstream.cpu_s,
        "client": lambda: cpu_s(os.getpid()),
    }
    out = []
    for size in opts.sizes:
        for name in opts.apis:
            api, alias = APIS[name]
            for mode in opts.modes:
                stream = mode == "stream"
                path = "/v1" + load.endpoint(api)
                stored = name in STORED
                direct = load.request_of(
                    load.Target("127.0.0.1", port, path), fixtures.body(api, "fake-model", size, stream, stored)
                )
                body = fixtures.body(api, alias, size, stream, stored)
                via = load.request_of(load.Target("127.0.0.1", edge_port, path), body)
                before = {k: f() for k, f in ours.items()}
                ticks, t0 = machine_ticks(), time.monotonic()
                pairs = _pairs(port, direct, edge_port, via, opts.requests)
                wall = max(1e-9, time.monotonic() - t0)
                cpu = {k: f() - before[k] for k, f in ours.items()}
                other = max(0.0, busy_cores(ticks, machine_ticks()) - sum(cpu.values()) / wall)
                d = [p[0] for p in pairs]
                v = [p[1] for p in pairs]
                added = [b - a for a, b in pairs]
                cell: dict[str, Any] = {
                    "cell": f"{_size_name(size)} {name} {mode}",
                    "bytes_asked": size,
                    "bytes": len(body),
                    "api": name,
                    "stream": stream,
                    "pairs": len(pairs),
                    "direct_p50_ms": round(statistics.median(d), 3),
                    "iop_p50_ms": round(statistics.median(v), 3),
                    "added_p50_ms": round(statistics.median(added), 3),
                    "added_p90_ms": round(load.pct(sorted(added), 90), 3),
                    "cpu_ms_per_request": {
                        k: round(1000 * cpu[k] / len(pairs), 3) for k in ("edge", "node", "nats", "upstream")
                    },
                    "other_cores": round(other, 3),
                }
                log(
                    f"bodies {cell['cell']:<28} direct {cell['direct_p50_ms']:.2f} iop {cell['iop_p50_ms']:.2f}"
                    f" added {cell['added_p50_ms']:.2f} ms  cpu edge {cell['cpu_ms_per_request']['edge']:.2f}"
                    f" node {cell['cpu_ms_per_request']['node']:.2f} nats {cell['cpu_ms_per_request']['nats']:.2f}"
                    f"  other cores {other:.2f}"
                )
                out.append(cell)
    return out


def _pairs(dport: int, direct: bytes, vport: int, via: bytes, n: int) -> list[tuple[float, float]]:
    async def go() -> list[tuple[float, float]]:
        got: list[tuple[float, float]] = []
        for i in range(n + 2):
            if i % 2 == 0:
                a = await _one(dport, direct)
                b = await _one(vport, via)
            else:
                b = await _one(vport, via)
                a = await _one(dport, direct)
            if i >= 2:
                got.append((a, b))
        return got

    with asyncio.Runner(loop_factory=load.loop_factory()) as runner:
        return runner.run(go())


async def _one(port: int, request: bytes) -> float:
    """Milliseconds from connecting to the answer's last byte; raises unless the answer is complete."""
    loop = asyncio.get_running_loop()
    t0 = time.perf_counter()
    transport, conn = await loop.create_connection(load.Conn, "127.0.0.1", port)
    try:
        a = await asyncio.wait_for(conn.send(request), 30)
    finally:
        transport.close()
    ms = 1000 * (time.perf_counter() - t0)
    if not a.ok:
        raise RuntimeError(f"bodies: an incomplete answer (status {a.status}) from port {port}")
    return ms


def _floor(owned: Owned, workdir: Path, opts: BodiesOptions) -> dict[str, Any]:
    """The floor on a nats-server of its own, configured and stored as the edge's."""
    proc, url = floor.start_server(owned, workdir)
    try:
        bodies = {str(s): fixtures.body("chat", "fake-model", s, False) for s in opts.sizes}
        got = floor.run(url, bodies, opts.requests, memory=opts.storage == "memory", server_cpu=proc.cpu_s)
    finally:
        owned.stop(proc)
    for name, f in got.items():
        cpu = f["cpu_ms_per_request"]
        log(
            f"floor {_size_name(int(name)):<8} p50 {f['latency_ms']['p50']:.2f} ms p99 {f['latency_ms']['p99']:.2f} ms"
            f"  CPU-ms client+worker {cpu['client+worker']:.2f} nats {cpu.get('nats', 0):.2f}"
        )
    return got


def _waiting(stack: Stack, edge_port: int, size: int, n: int) -> dict[str, Any]:
    """Edge RSS with `n` requests of `size` bytes sent to a pool whose one slot is taken for minutes."""
    raise_fd_limit(n + 512)
    budget_mib = json.loads(stack.config_path.read_text())["edge"].get("queue", {}).get("max_waiting_mb", 256)
    pid = stack.edge.pid
    idle = rss_bytes(pid)
    body = fixtures.body("chat", "slow", size, False)

    async def hold() -> dict[str, Any]:
        held = load.Held()
        try:
            await held.open(load.Target("127.0.0.1", edge_port, "/v1/chat/completions"), body, n, batch=32)
            loop = asyncio.get_running_loop()

            def settled() -> bool:
                pool = next(p for p in http_json("GET", stack.url + "/status")["pools"] if p["alias"] == "slow")
                return int(pool["waiting"]) + int(pool["dispatched_in_flight"]) + held.answered() >= len(held.conns)

            await loop.run_in_executor(None, lambda: wait_until("held requests settled", settled, 120))
            pool = next(p for p in http_json("GET", stack.url + "/status")["pools"] if p["alias"] == "slow")
            refused = sum(1 for f in held.futures if f.done() and not f.exception() and f.result().status == 503)
            return {"waiting": int(pool["waiting"]), "refused_503": refused, "rss": rss_bytes(pid)}
        finally:
            held.close()

    with asyncio.Runner(loop_factory=load.loop_factory()) as runner:
        got = runner.run(hold())

    after = settled_rss(stack.url, pid)  # once the edge had time to give the burst's memory back
    res = {
        "size": size,
        "sent": n,
        "waiting": got["waiting"],
        "refused_503": got["refused_503"],
        "budget_mib": budget_mib,
        "edge_rss_idle_mb": round(idle / 2**20, 1),
        "edge_rss_full_mb": round(got["rss"] / 2**20, 1),
        "edge_rss_after_mb": round(after / 2**20, 1),
        "nats_rss_mb": round(rss_bytes(stack.nats_pid) / 2**20, 1) if stack.nats_pid else None,
    }
    log(
        f"bodies waiting {_size_name(size)} x {n}: {res['waiting']} waiting, {res['refused_503']} refused;"
        f" edge RSS {res['edge_rss_idle_mb']} → {res['edge_rss_full_mb']} → {res['edge_rss_after_mb']} MB"
    )
    return res
