"""Scenario: fair queueing on a saturated pool: a flooder and a quiet tenant (issue 26).

One provider of capacity 4 whose upstream answers every request in 200 ms (its service time;
the pool serves 20 requests/s). Two client keys, two tenants:

    flood   sends at 10x the pool's rate (200 requests/s), open loop, a bounded count
    quiet   sends one request at a time (streamed), the next as soon as the last one ended

Three runs, each on a fresh edge so no queue or service count carries over:

    alone   the quiet tenant by itself: the pool idle; its queue wait is iop's own overhead
    fair    both, `edge.queue.fair_queueing: true` (the default)
    fifo    both, `fair_queueing: false`: arrival order, the quiet tenant behind the backlog

The quiet tenant keeps sending until the flooder's last answer arrived (or `max_seconds`).
Per run: the quiet tenant's queue wait (the edge's `x-iop-queue-ms`: arrival at the edge to the
node starting it) and time to first token at the client, p50/p99; the flooder's throughput;
slot utilisation over the time work waited (the upstream's timeline, as bench/capacity.py); and
the CPU of everything else on the machine beside it.
"""

from __future__ import annotations

import asyncio
import os
import resource
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import load
from bench.abtest import start_upstream
from bench.capacity import utilisation
from bench.procs import Owned, busy_cores, free_port, http_json, log, machine_ticks
from bench.stack import openai_pool_node, start_stack

KEYS = {"flood": "sk-bench-flood", "quiet": "sk-bench-quiet"}
KEYS_ENV = "IOP_BENCH_FAIRNESS_KEYS"


@dataclass
class FairnessOptions:
    capacity: int = 4
    service_ms: float = 200.0
    flood_factor: float = 10.0
    """The flooder's arrival rate over the pool's service rate."""
    flood_requests: int = 600
    """At 10x a 20/s pool: 3 s of arrivals, a backlog of about 540 that takes ~30 s to drain."""
    alone_requests: int = 30
    max_seconds: float = 90.0
    storage: str = "file"
    archive: Path | None = None


def run_fairness(owned: Owned, workdir: Path, opts: FairnessOptions) -> dict[str, Any]:
    port = free_port()
    up = start_upstream(
        owned,
        "upstream-fairness",
        [port],
        "--cap",
        str(opts.capacity),
        "--latency",
        f"fixed:{opts.service_ms:g}",
        "--timeline",
    )
    base = f"http://127.0.0.1:{port}"
    os.environ[KEYS_ENV] = ",".join(f"{name}:{key}" for name, key in KEYS.items())
    runs: dict[str, Any] = {}
    try:
        for name, fair in (("alone", True), ("fair", True), ("fifo", False)):
            stack = start_stack(
                owned,
                workdir,
                f"fairness-{name}",
                models=[{"alias": "shared", "pool": ["gpu"]}],
                nodes=[openai_pool_node("fair-node", [("gpu", port, opts.capacity)])],
                storage=opts.storage,
                archive=opts.archive,
                edge_extra={
                    "api_keys_env": KEYS_ENV,
                    "queue": {"timeout_s": 600, "max_waiting": 100_000, "fair_queueing": fair},
                },
                ready_headers={"authorization": f"Bearer {KEYS['quiet']}"},
            )
            try:
                http_json("POST", base + "/stats/reset")
                edge_port = int(stack.url.rsplit(":", 1)[1])
                cpu0, ticks0, t0 = stack.cpu(), machine_ticks(), time.monotonic()
                client0 = _own_cpu_s()
                got = asyncio.run(_run(edge_port, name != "alone", opts))
                wall = max(1e-9, time.monotonic() - t0)
                cpu1, ticks1 = stack.cpu(), machine_ticks()
                ours = sum(cpu1[k] - cpu0[k] for k in cpu1) + _own_cpu_s() - client0
                other = max(0.0, busy_cores(ticks0, ticks1) - ours / wall)
                timeline = http_json("GET", base + "/timeline", timeout=30)["events"]
            finally:
                stack.stop()
            util = utilisation({int(k): v for k, v in timeline.items()}, {port: opts.capacity})
            runs[name] = _summary(name, fair, got, util, wall, other)
            r = runs[name]
            log(
                f"fairness {name}: quiet queue wait {r['quiet_queue_wait_ms']}, flooder {r['flood_rps']} req/s, "
                f"utilisation {r['utilisation']}, other cores {r['other_cores']}"
            )
    finally:
        owned.stop(up)
        os.environ.pop(KEYS_ENV, None)
    return {
        "capacity": opts.capacity,
        "service_ms": opts.service_ms,
        "flood_rate_per_s": round(_flood_rate(opts), 1),
        "flood_requests": opts.flood_requests,
        "runs": runs,
    }


def _flood_rate(opts: FairnessOptions) -> float:
    return opts.flood_factor * opts.capacity * 1000.0 / opts.service_ms


def _own_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _request(target: load.Target, tenant: str, stream: bool) -> bytes:
    body = load.body_of("chat", "shared", stream)
    return (
        f"POST {target.path} HTTP/1.1\r\nhost: {target.host}:{target.port}\r\n"
        f"authorization: Bearer {KEYS[tenant]}\r\n"
        f"content-type: application/json\r\naccept: */*\r\ncontent-length: {len(body)}\r\n\r\n"
    ).encode() + body


@dataclass
class _Got:
    quiet: list[load.Answer]
    quiet_sent: list[float]
    flood: list[load.Answer]
    flood_wall_s: float
    errors: int


async def _run(edge_port: int, flood: bool, opts: FairnessOptions) -> _Got:
    loop = asyncio.get_running_loop()
    target = load.Target("127.0.0.1", edge_port, "/v1/chat/completions")
    quiet_req, flood_req = _request(target, "quiet", True), _request(target, "flood", False)
    got = _Got([], [], [], 0.0, 0)
    deadline = time.monotonic() + opts.max_seconds

    async def connect() -> load.Conn:
        _, conn = await loop.create_connection(lambda: load.Conn(b"x-iop-queue-ms"), target.host, target.port)
        return conn

    async def one(conn: load.Conn, request: bytes) -> load.Answer | None:
        try:
            async with asyncio.timeout(max(1.0, deadline - time.monotonic())):
                a = await conn.send(request)
        except (TimeoutError, ConnectionError):
            got.errors += 1
            return None
        if not a.ok:
            got.errors += 1
            return None
        return a

    flood_done = asyncio.Event()

    async def flooder() -> None:
        interval = 1.0 / _flood_rate(opts)
        conns = [await connect() for _ in range(opts.flood_requests)]  # open loop: one per request in flight
        t0 = time.monotonic()

        async def send(i: int) -> None:
            await asyncio.sleep(max(0.0, t0 + i * interval - time.monotonic()))
            a = await one(conns[i], flood_req)
            if a is not None:
                got.flood.append(a)

        await asyncio.gather(*(send(i) for i in range(opts.flood_requests)))
        got.flood_wall_s = time.monotonic() - t0
        for c in conns:
            c.abort()
        flood_done.set()

    async def quiet(n: int | None) -> None:
        conn = await connect()
        while time.monotonic() < deadline and (len(got.quiet) < n if n is not None else not flood_done.is_set()):
            sent = load.clock()
            a = await one(conn, quiet_req)
            if a is None:
                break
            got.quiet.append(a)
            got.quiet_sent.append(sent)
        conn.abort()

    if flood:
        task = asyncio.create_task(flooder())
        # The backlog builds for half a second before the quiet tenant's first request.
        await asyncio.sleep(0.5)
        await quiet(None)
        await task
    else:
        await quiet(opts.alone_requests)
    return got


def _summary(name: str, fair: bool, got: _Got, util: dict[str, Any], wall: float, other: float) -> dict[str, Any]:
    waits = [float(a.header) for a in got.quiet if a.header is not None]
    ttft = [(a.t_first - s) * 1000 for a, s in zip(got.quiet, got.quiet_sent, strict=True)]
    return {
        "fair_queueing": fair,
        "quiet_requests": len(got.quiet),
        "quiet_queue_wait_ms": load.percentiles(waits),
        "quiet_ttft_ms": load.percentiles(ttft),
        "flood_requests": len(got.flood),
        "flood_rps": round(len(got.flood) / got.flood_wall_s, 2) if got.flood_wall_s else None,
        "errors": got.errors,
        "utilisation": util["utilisation"],
        "window_s": util["window_s"],
        "wall_s": round(wall, 2),
        "other_cores": round(other, 3),
    }
