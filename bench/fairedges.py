"""Scenario: fair shares across two edges: a flooder on one edge, a quiet tenant on the other (issue 26).

One provider of capacity 4 whose upstream answers in `service_ms` (200 ms: the pool serves 20
requests/s), two `iop edge` processes on one nats-server (the bench's own), two tenants:

    flood   on edge A: `flood_requests` at 10x the pool's rate, open loop (a backlog on A alone)
    quiet   on edge B: one request at a time, the next as soon as the last one ended

Two runs on the same stack: `alone` (the quiet tenant by itself, the pool idle: iop's own wait)
and `split` (both). Edge A sees every slot it frees first; without fair shares across edges it
would hand each to its own backlog and the quiet tenant would wait for the whole of it. Per run:
the quiet tenant's queue wait (`x-iop-queue-ms`) p50/p99, the flooder's throughput, slot
utilisation over the time work waited (the upstream's timeline), and the load average.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import load
from bench.abtest import start_upstream
from bench.capacity import utilisation
from bench.procs import Owned, Proc, free_port, http_json, iop_argv, loadavg, log, status_ready, wait_until
from bench.stack import openai_pool_node, start_stack

KEYS = {"flood": "sk-bench-flood", "quiet": "sk-bench-quiet"}
KEYS_ENV = "IOP_BENCH_FAIREDGES_KEYS"


@dataclass
class FairEdgesOptions:
    capacity: int = 4
    service_ms: float = 200.0
    flood_requests: int = 300
    """At 10x a 20/s pool: 1.5 s of arrivals, a backlog of ~270 that takes ~14 s to drain."""
    alone_requests: int = 20
    max_seconds: float = 60.0
    archive: Path | None = None
    anticipate_ms: float | None = None
    """edge.queue.anticipate_ms (None: the edge's default)."""


@dataclass
class _Got:
    quiet: list[load.Answer] = field(default_factory=list)
    flood: int = 0
    flood_wall_s: float = 0.0
    errors: int = 0


def run_fairedges(owned: Owned, workdir: Path, opts: FairEdgesOptions) -> dict[str, Any]:
    port = free_port()
    up = start_upstream(
        owned,
        "upstream-fairedges",
        [port],
        "--cap",
        str(opts.capacity),
        "--latency",
        f"fixed:{opts.service_ms:g}",
        "--timeline",
    )
    base = f"http://127.0.0.1:{port}"
    os.environ[KEYS_ENV] = ",".join(f"{name}:{key}" for name, key in KEYS.items())
    headers = {"authorization": f"Bearer {KEYS['quiet']}"}
    stack = start_stack(
        owned,
        workdir,
        "fairedges",
        models=[{"alias": "shared", "pool": ["gpu"]}],
        nodes=[openai_pool_node("fair-node", [("gpu", port, opts.capacity)])],
        storage="memory",  # a nats-server of the bench's own, which a second edge can reach too
        archive=opts.archive,
        edge_extra={
            "api_keys_env": KEYS_ENV,
            "queue": {"timeout_s": 600, "max_waiting": 100_000}
            | ({"anticipate_ms": opts.anticipate_ms} if opts.anticipate_ms is not None else {}),
        },
        ready_headers=headers,
    )
    second: Proc | None = None
    runs: dict[str, Any] = {}
    try:
        listen = json.loads(stack.config_path.read_text())["edge"]["nats"]["listen"]
        port_b = free_port()
        argv = iop_argv(opts.archive, "edge", "--config", str(stack.config_path), "--listen", f"127.0.0.1:{port_b}")
        second = owned.start("fairedges-edge-b", [*argv, "--nats", f"nats://{listen}"])
        wait_until("fairedges: edge B ready", status_ready(f"http://127.0.0.1:{port_b}", headers=headers), 90, [second])
        port_a = int(stack.url.rsplit(":", 1)[1])
        for name in ("alone", "split"):
            http_json("POST", base + "/stats/reset")
            before = loadavg()
            got = asyncio.run(_run(port_a, port_b, name == "split", opts))
            timeline = http_json("GET", base + "/timeline", timeout=30)["events"]
            util = utilisation({int(k): v for k, v in timeline.items()}, {port: opts.capacity})
            waits = [float(a.header) for a in got.quiet if a.header is not None]
            runs[name] = {
                "quiet_requests": len(got.quiet),
                "quiet_queue_wait_ms": load.percentiles(waits),
                "flood_requests": got.flood,
                "flood_rps": round(got.flood / got.flood_wall_s, 2) if got.flood_wall_s else None,
                "utilisation": util["utilisation"] if name == "split" else None,
                "errors": got.errors,
                "loadavg": [before, loadavg()],
            }
            r = runs[name]
            log(
                f"fairedges {name}: quiet ({r['quiet_requests']}) queue wait {r['quiet_queue_wait_ms']}, "
                f"flooder {r['flood_rps']} req/s, utilisation {r['utilisation']}, load {before}"
            )
    finally:
        if second is not None:
            owned.stop(second)
        stack.stop()
        owned.stop(up)
        os.environ.pop(KEYS_ENV, None)
    return {"capacity": opts.capacity, "service_ms": opts.service_ms, "edges": 2, "runs": runs}


def _request(port: int, tenant: str) -> bytes:
    body = load.body_of("chat", "shared", False)
    return (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n"
        f"authorization: Bearer {KEYS[tenant]}\r\n"
        f"content-type: application/json\r\naccept: */*\r\ncontent-length: {len(body)}\r\n\r\n"
    ).encode() + body


async def _run(port_a: int, port_b: int, flood: bool, opts: FairEdgesOptions) -> _Got:
    loop = asyncio.get_running_loop()
    got = _Got()
    deadline = time.monotonic() + opts.max_seconds
    flood_done = asyncio.Event()

    async def connect(port: int) -> load.Conn:
        _, conn = await loop.create_connection(lambda: load.Conn(b"x-iop-queue-ms"), "127.0.0.1", port)
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

    async def flooder() -> None:
        interval = opts.service_ms / 1000.0 / opts.capacity / 10.0
        request = _request(port_a, "flood")
        conns = [await connect(port_a) for _ in range(opts.flood_requests)]  # open loop: one per request
        t0 = time.monotonic()

        async def send(i: int) -> None:
            await asyncio.sleep(max(0.0, t0 + i * interval - time.monotonic()))  # the arrival schedule
            if await one(conns[i], request) is not None:
                got.flood += 1

        await asyncio.gather(*(send(i) for i in range(opts.flood_requests)))
        got.flood_wall_s = time.monotonic() - t0
        for c in conns:
            c.abort()
        flood_done.set()

    async def quiet(n: int | None) -> None:
        conn = await connect(port_b)
        request = _request(port_b, "quiet")
        while time.monotonic() < deadline and (len(got.quiet) < n if n is not None else not flood_done.is_set()):
            a = await one(conn, request)
            if a is None:
                break
            got.quiet.append(a)
        conn.abort()

    if flood:
        task = asyncio.create_task(flooder())
        await asyncio.sleep(0.5)  # the backlog builds on edge A before the quiet tenant's first request
        await quiet(None)
        await task
    else:
        await quiet(opts.alone_requests)
    return got
