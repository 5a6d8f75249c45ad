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

Beside the runs, in this process on the edge's event loop (uvloop, or IOP_LOOP's): the edge's CPU
per admission with 1 and 1,000 tenants (issue 30's figure), the parts a pool request goes through
before it holds a slot:

    key         the client key found among one per tenant, and its tenant's policy
    queued      a saturated pool (capacity 4) with two requests of every tenant waiting: one
                request queues, one release grants the next in the fair order, that waiter
                resumes; what the same loop costs with a bare future in the scheduler's place
                (the asyncio floor, measured in the same run) subtracted
    free        a slot free: taken at once and given back
    python_gc   `queued` with the collector as Python sets it; every other part runs with it set
                as the edge sets its own (iop/heap.py: what start-up made frozen)
    limits      a tenant with rpm and tpm: its use read and written back by compare-and-set in the
                KV bucket iop_limits of a nats-server of its own, one request at a time (a write
                each) and 32 at once (the edge's group commit); this process's CPU only
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import resource
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import load
from bench.abtest import start_upstream
from bench.capacity import utilisation
from bench.experiments.scheduler import per_admission_us
from bench.procs import Owned, busy_cores, free_port, http_json, log, machine_ticks
from bench.stack import openai_pool_node, start_stack
from iop import config, heap
from iop.cli.common import run_async
from iop.edge.keys import EdgeKeys, parse_keys
from iop.edge.limits import Limiter
from iop.edge.scheduler import Scheduler
from iop.edge.tenants import Tenant, Tenants
from iop.nats import connection
from iop.nats.server import EmbeddedNats
from iop.tenancy import TenantPolicy

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
    admission_tenants: list[int] = field(default_factory=lambda: [1, 1000])
    admission_rounds: int = 3
    admissions: int = 10_000
    storage: str = "file"
    archive: Path | None = None
    standby: int | None = None
    """edge.queue.standby (None: the edge's default)."""
    anticipate_ms: float | None = None
    """edge.queue.anticipate_ms (None: the edge's default)."""
    arms: tuple[str, ...] = ("alone", "fair", "fifo")


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
            if name not in opts.arms:
                continue
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
                    "queue": {"timeout_s": 600, "max_waiting": 100_000, "fair_queueing": fair}
                    | ({"standby": opts.standby} if opts.standby is not None else {})
                    | ({"anticipate_ms": opts.anticipate_ms} if opts.anticipate_ms is not None else {}),
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
        "anticipate_ms": opts.anticipate_ms,
        "admission": admission_cpu(opts, workdir) if opts.admission_rounds else None,
    }


def admission_cpu(opts: FairnessOptions, workdir: Path) -> dict[str, Any]:
    """CPU per admission in this process (µs), by the number of tenants: medians of the rounds."""
    out: dict[str, Any] = {}
    limited = run_async(_limits_us(opts.admission_tenants, workdir / "admission-nats"))
    for n in opts.admission_tenants:
        rows: list[dict[str, float]] = []
        ticks0 = machine_ticks()
        t0 = time.monotonic()
        cpu0 = _own_cpu_s()
        for _ in range(opts.admission_rounds):
            python_floor = run_async(_floor_us(n, opts.admissions))
            python_whole, _ = run_async(_queued_us(n, opts.admissions))
            with as_the_edge_collects():
                floor = run_async(_floor_us(n, opts.admissions))
                whole, grant = run_async(_queued_us(n, opts.admissions))
                rows.append(
                    {
                        "key_us": _key_us(n, opts.admissions),
                        "queued_us": whole - floor,
                        "python_gc_us": python_whole - python_floor,
                        "grant_us": grant,
                        "floor_us": floor,
                        "free_us": run_async(_free_us(n, opts.admissions)),
                    }
                )
        wall = max(1e-9, time.monotonic() - t0)
        other = max(0.0, busy_cores(ticks0, machine_ticks()) - (_own_cpu_s() - cpu0) / wall)
        fig = {k: round(statistics.median(r[k] for r in rows), 2) for k in rows[0]}
        fig["admission_us"] = round(fig["key_us"] + fig["queued_us"], 2)
        fig["limits_one_us"], fig["limits_burst_us"] = (round(x, 1) for x in limited[n])
        fig["other_cores"] = round(other, 3)
        out[str(n)] = fig
        log(f"admission, {n} tenants: {fig}")
    return out


@contextlib.contextmanager
def as_the_edge_collects() -> Any:
    """This process's collector set as the edge sets its own (iop/heap.py), and restored after."""
    heap.freeze_start_up()
    try:
        yield
    finally:
        gc.unfreeze()


async def _limits_us(counts: list[int], store: Path, n: int = 2000) -> dict[int, tuple[float, float]]:
    """Per limited admission: (one at a time, 32 at once), tenants in turn, each with rpm and tpm."""
    server = EmbeddedNats("127.0.0.1:0", store)
    await server.start()
    out: dict[int, tuple[float, float]] = {}
    try:
        nc = await connection.connect(server.url, "bench-limits")
        limits = Limiter()
        await limits.open(nc.jetstream(), 1, nc)
        body = b'{"model":"shared","messages":[{"role":"user","content":"hi"}],"max_tokens":16}'
        for tenants in counts:
            who = [Tenant(f"t{i}", TenantPolicy(rpm=10**9, tpm=10**12)) for i in range(tenants)]
            for t in who:  # each tenant's first read done: what is measured is the steady state
                await limits.admit(t, "shared", body)
            per: list[float] = []
            for burst in (1, 32):
                t0 = time.process_time()
                for k in range(0, n, burst):
                    await asyncio.gather(*(limits.admit(who[(k + j) % tenants], "shared", body) for j in range(burst)))
                per.append((time.process_time() - t0) / n * 1e6)
            out[tenants] = (per[0], per[1])
        await nc.close()
    finally:
        await server.stop()
    return out


def _key_us(tenants: int, n: int) -> float:
    """The client key of a request among `tenants` keys, its tenant and whether it may use the model."""
    raw = ",".join(f"t{i}:sk-bench-{i:05d}-{'k' * 24}" for i in range(tenants))
    keys = EdgeKeys(clients=parse_keys(raw, "client"), admins=[])
    catalog = Tenants(config.EdgeSettings())
    scopes = [
        {"headers": [(b"host", b"edge"), (b"authorization", f"Bearer sk-bench-{i:05d}-{'k' * 24}".encode())]}
        for i in range(min(tenants, 1000))
    ]
    t0 = time.process_time()
    for k in range(n):
        key = keys.client(scopes[k % len(scopes)])
        assert key is not None
        catalog.of_key(key.name).policy.allows("shared")
    return (time.process_time() - t0) / n * 1e6


def _saturated(tenants: int, fair: bool = True) -> Scheduler:
    sched = Scheduler(max_waiting=10 * tenants + 100, fair=fair)
    sched.add_provider("p", "node", 4)
    sched.set_connected("p", True)
    sched.add_pool("pool", ["p"])
    return sched


async def _queued_us(tenants: int, n: int) -> tuple[float, float]:
    """Per admission on a saturated pool: (the whole loop, the release that grants within it)."""
    return await per_admission_us(tenants, n, fair=True)


async def _floor_us(tenants: int, n: int) -> float:
    """`_queued_us`'s loop with a bare future handed over in place of the scheduler."""
    loop = asyncio.get_running_loop()
    waiting: deque[asyncio.Future[int]] = deque()
    held: deque[int] = deque([0] * 4)
    tasks: set[asyncio.Task[None]] = set()

    def ask(tenant: str) -> None:
        async def one() -> None:
            future: asyncio.Future[int] = loop.create_future()
            waiting.append(future)
            held.append(await future)

        task = asyncio.create_task(one())
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    for i in range(2 * tenants):
        ask(f"t{i % tenants}")
    await asyncio.sleep(0)
    t0 = time.process_time()
    for k in range(n):
        held.popleft()
        waiting.popleft().set_result(1)
        ask(f"t{k % tenants}")
        await asyncio.sleep(0)
        await asyncio.sleep(0)
    us = (time.process_time() - t0) / n * 1e6
    for t in list(tasks):
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return us


async def _free_us(tenants: int, n: int) -> float:
    """A slot free when the request comes: taken at once, given back (tenants in turn)."""
    sched = _saturated(tenants)
    deadline = asyncio.get_running_loop().time() + 600
    names = [f"t{i}" for i in range(tenants)]
    t0 = time.process_time()
    for k in range(n):
        g = await sched.acquire_grant("pool", deadline, tenant=names[k % tenants])
        sched.release(g.slot, g)
    return (time.process_time() - t0) / n * 1e6


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
        "handover_gap_ms": util.get("handover_gap_ms"),  # a freed slot idle until its next request
        "window_s": util["window_s"],
        "wall_s": round(wall, 2),
        "other_cores": round(other, 3),
    }
