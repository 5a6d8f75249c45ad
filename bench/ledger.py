"""The ledger's cost and speed: python -m bench.ledger [--quick] [--rounds N] [--records N] [--out FILE]

    cost         CPU per finished request of what the ledger work adds at the edge (the record,
                 metrics, the access line, the buffer append), measured in-process.
    onoff        two stacks on one bench upstream, alike but for edge.ledger.enabled; each round
                 measures both (order alternating): added p50 at c=1 and req/s at c=32, chat whole
                 answers. Target: no p50 difference beyond noise, <= 5 % req/s.
    aggregate    N records (default 1,000,000) written into IOP_LEDGER as the edge writes them
                 (batches of up to 512), then read back with the ordered consumer and grouped by
                 model,provider,day as GET /usage does; also N/10 records one per message (a quiet
                 edge flushes single records), for the worst case's rate. Target: 1M well under 60 s.

Everything listens on 127.0.0.1; loads are bounded in count and time; only processes started here
are ended, by PID.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import load
from bench.abtest import start_upstream
from bench.procs import Owned, free_port, http_json, install_signal_handlers, log
from bench.stack import Stack, openai_pool_node, start_stack
from iop.contracts.usage import parse_query
from iop.edge.ledger import BATCH_RECORDS, RequestRecord, encode_batch, ensure_ledger_stream, ledger_subject
from iop.edge.usage_query import Aggregate, read_records
from iop.nats import connection
from iop.nats.server import EmbeddedNats


def _measure(stack: Stack, concurrency: int, seconds: float, requests: int) -> load.LoadResult:
    port = int(stack.url.rsplit(":", 1)[1])
    spec = load.LoadSpec(
        load.Target("127.0.0.1", port, "/v1/chat/completions"),
        load.body_of("chat", "bench", False),
        concurrency=concurrency,
        requests=requests,
        max_seconds=seconds,
        warmup=max(20, 2 * concurrency),
        timeout_s=60,
    )
    return load.run(spec)


def run_onoff(owned: Owned, workdir: Path, rounds: int, seconds: float) -> dict[str, Any]:
    up_port = free_port()
    upstream = start_upstream(owned, "upstream", [up_port], "--tokens", "16")
    stacks: dict[str, Stack] = {}
    try:
        for arm, enabled in (("on", True), ("off", False)):
            stacks[arm] = start_stack(
                owned,
                workdir,
                f"ledger-{arm}",
                models=[{"alias": "bench", "pool": ["fake"]}],
                nodes=[openai_pool_node(f"node-{arm}", [("fake", up_port, 64)])],
                edge_extra={"ledger": {"enabled": enabled}},
            )
        for stack in stacks.values():
            _measure(stack, 8, 2.0, 400)  # unmeasured warm-up
        runs: list[dict[str, Any]] = []
        for r in range(rounds):
            order = ["on", "off"] if r % 2 == 0 else ["off", "on"]
            row: dict[str, Any] = {"round": r, "order": order}
            for arm in order:
                c1 = _measure(stacks[arm], 1, seconds, 5_000)
                cpu0 = stacks[arm].edge.cpu_s()
                c32 = _measure(stacks[arm], 32, seconds, 20_000)
                # CPU seconds of the edge per request: what the ledger adds, unblurred by the machine's other load.
                edge_us = (stacks[arm].edge.cpu_s() - cpu0) / max(1, c32.count) * 1e6
                assert c1.latency_ms is not None
                row[arm] = {
                    "p50_ms_c1": c1.latency_ms["p50"],
                    "rps_c32": c32.rps,
                    "edge_cpu_us_per_request": round(edge_us, 1),
                    "errors": c1.errors | c32.errors,
                }
            log(
                f"r{r} p50 c=1 on={row['on']['p50_ms_c1']:.3f} off={row['off']['p50_ms_c1']:.3f} ms"
                f"  req/s c=32 on={row['on']['rps_c32']:.0f} off={row['off']['rps_c32']:.0f}"
                f"  edge CPU/request on={row['on']['edge_cpu_us_per_request']:.0f}"
                f" off={row['off']['edge_cpu_us_per_request']:.0f} us"
            )
            runs.append(row)
        ledger_stream = _stream_messages(stacks["on"])
    finally:
        for stack in stacks.values():
            stack.stop()
        owned.stop(upstream)

    def med(arm: str, key: str) -> float:
        return float(statistics.median(r[arm][key] for r in runs))

    added_p50 = [r["on"]["p50_ms_c1"] - r["off"]["p50_ms_c1"] for r in runs]
    rps_ratio = [r["on"]["rps_c32"] / r["off"]["rps_c32"] for r in runs if r["off"]["rps_c32"]]
    return {
        "rounds": runs,
        "p50_ms_c1": {"on": med("on", "p50_ms_c1"), "off": med("off", "p50_ms_c1")},
        "added_p50_ms_c1": {"median": statistics.median(added_p50), "min": min(added_p50), "max": max(added_p50)},
        "rps_c32": {"on": med("on", "rps_c32"), "off": med("off", "rps_c32")},
        "rps_on_over_off": {"median": statistics.median(rps_ratio), "min": min(rps_ratio), "max": max(rps_ratio)},
        "edge_cpu_us_per_request": {
            "on": med("on", "edge_cpu_us_per_request"),
            "off": med("off", "edge_cpu_us_per_request"),
        },
        "ledger_messages": ledger_stream,
    }


def _stream_messages(stack: Stack) -> dict[str, int] | None:
    """How the ledger of the 'on' stack was written: records per message under this load."""
    data = http_json("GET", stack.url + "/usage?since=1h&by=model")
    rows = data.get("rows") or []
    return {"records": sum(r["requests"] for r in rows)} if rows else None


def _records(n: int, start: float) -> list[RequestRecord]:
    rnd = random.Random(7)
    models = [f"model-{i}" for i in range(8)]
    providers = [f"prov-{i}" for i in range(16)]
    return [
        RequestRecord(
            id=f"req_{i:012x}",
            start=start + i * 0.001,
            alias=rnd.choice(models),
            route="pool",
            api="chat",
            stream=bool(i & 1),
            status=200 if i % 50 else 502,
            error="" if i % 50 else "upstream_error",
            edge="bench",
            node=f"node-{i % 4}",
            provider=rnd.choice(providers),
            model="upstream-model",
            attempts=1,
            queue_ms=rnd.random() * 20,
            ttfb_ms=rnd.random() * 100,
            duration_ms=rnd.random() * 2000,
            input_tokens=rnd.randrange(10, 4000),
            output_tokens=rnd.randrange(1, 1000),
            cached_tokens=0,
            bytes_in=1200,
            bytes_out=2400,
            key="alice",
            upstream_status=200,
            run_ms=rnd.random() * 2000,
        )
        for i in range(n)
    ]


async def _fill(js: Any, token: str, records: list[RequestRecord], per_message: int) -> float:
    """Publish the records `per_message` at a time; returns seconds taken."""
    t0 = time.perf_counter()
    pending: list[Any] = []
    for i in range(0, len(records), per_message):
        batch = records[i : i + per_message]
        pending.append(js.publish(ledger_subject(batch[0].alias, token), encode_batch(batch), timeout=30))
        if len(pending) >= 256:  # bounded in flight: acks come back in order
            await asyncio.gather(*pending)
            pending.clear()
    await asyncio.gather(*pending)
    return time.perf_counter() - t0


async def _read(js: Any) -> tuple[float, int, int]:
    agg = Aggregate(parse_query("30d", None, "model,provider,day"))
    t0 = time.perf_counter()
    messages = await read_records(js, agg.query, agg.add)
    rows = agg.rows()
    return time.perf_counter() - t0, agg.records, messages + 0 * len(rows)


async def run_aggregate(workdir: Path, n: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    start = time.time() - 3600
    records = _records(n, start)
    for label, per_message, count in (("batched", BATCH_RECORDS, n), ("one_per_message", 1, max(1, n // 10))):
        server = EmbeddedNats("127.0.0.1:0", workdir / f"agg-{label}")
        await server.start()
        try:
            nc = await connection.connect(server.url, "bench-ledger", wait_s=10)
            js = nc.jetstream()
            token = await ensure_ledger_stream(js, 30 * 86400.0, 8 * 1024**3)
            fill_s = await _fill(js, token, records[:count], per_message)
            read_s, got, messages = await _read(js)
            await nc.close()
        finally:
            await server.stop()
        assert got == count, f"read {got} of {count} records"
        out[label] = {
            "records": count,
            "messages": messages,
            "write_s": round(fill_s, 2),
            "read_and_aggregate_s": round(read_s, 2),
            "records_per_s": round(count / read_s),
        }
        log(f"aggregate {label}: {count} records in {messages} messages, read+grouped in {read_s:.2f}s")
    return out


ACCESS_ARMS: tuple[tuple[str, str, int], ...] = (
    ("without access line", "text", 1),
    ("text, 1 line a turn", "text", 1),
    ("text, 8 lines a turn", "text", 8),
    ("json, 1 line a turn", "json", 1),
    ("json, 8 lines a turn", "json", 8),
)
"""Label, --log-format, requests finishing in one loop turn."""


def _installed_handler(fmt: str, stream: Any) -> logging.Handler:
    """The handler `iop.logs.setup` installs for `fmt` (whatever this checkout's is), writing to `stream`."""
    from iop import logs

    root = logging.getLogger()
    saved = list(root.handlers), root.level
    logs.setup("info", fmt)
    (installed,) = root.handlers
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in saved[0]:
        root.addHandler(h)
    root.setLevel(saved[1])
    assert isinstance(installed, logging.StreamHandler)
    installed.setStream(stream)
    return installed


def run_cost(n: int, rounds: int, workdir: Path) -> dict[str, Any]:
    """CPU of what the edge does per finished request (record, metrics, access line, buffer), in-process.

    On the edge's loop (uvloop), `per_turn` requests finishing in each loop turn, the access line
    written by the handler `iop.logs.setup` installs into a file (as the edge's output is under
    `bench.stack`); the arms' order rotates each round.
    """
    from types import SimpleNamespace

    from iop.edge.ledger import LedgerWriter
    from iop.edge.metrics import Metrics
    from iop.edge.observe import Observer, Trace
    from iop.wire import Done, Usage

    # Only the counting is measured: the gauges read at scrape time see empty tables.
    registry = SimpleNamespace(nodes={}, undecodable_hellos=None, undecodable_heartbeats=None)
    registry.share = SimpleNamespace(undecodable=None)
    metrics = Metrics(
        SimpleNamespace(providers={}, pools={}),  # type: ignore[arg-type]
        registry,  # type: ignore[arg-type]
        None,
        SimpleNamespace(is_connected=True),  # type: ignore[arg-type]
        time.time(),
    )
    writer = LedgerWriter(None, None, "bench", buffer_records=n + 1)  # type: ignore[arg-type]
    report = Done("x", 3, Usage(120, 40, 0, None), upstream_status=200, run_ms=12.0, ttfb_ms=3.0)
    access = logging.getLogger("iop.access")
    access.propagate = False

    async def finish_all(per_turn: int) -> float:
        observer = Observer("bench", metrics, writer)
        t0 = time.process_time()  # CPU, not wall time: the machine is shared
        for i in range(n):
            trace = Trace(f"req_{i}", "chat")
            trace.alias, trace.status, trace.first_byte = "bench", 200, trace.arrived
            trace.route, trace.node, trace.provider, trace.attempts = "pool", "node-1", f"p{i % 4}", 1
            trace.queue_ms, trace.report = 1.0, report
            observer.finish(trace)
            if i % per_turn == per_turn - 1:
                await asyncio.sleep(0)  # the loop's turn ends: the handler writes what it kept
        return (time.process_time() - t0) / n * 1e6

    runs: dict[str, list[float]] = {label: [] for label, _, _ in ACCESS_ARMS}
    for r in range(rounds):
        k = r % len(ACCESS_ARMS)
        for label, fmt, per_turn in ACCESS_ARMS[k:] + ACCESS_ARMS[:k]:
            with open(workdir / "access.log", "w") as logfile:
                sink = _installed_handler(fmt, logfile)
                access.addHandler(sink)
                access.setLevel(logging.WARNING if label.startswith("without") else logging.INFO)
                try:
                    with asyncio.Runner(loop_factory=load.loop_factory()) as runner:
                        runs[label].append(runner.run(finish_all(per_turn)))
                finally:
                    access.removeHandler(sink)
                    sink.close()
            writer.clear()
    out = {label: round(statistics.median(v), 2) for label, v in runs.items()}
    for label, us in out.items():
        log(f"cost per request, {label}: {us:.1f} us")
    return {"us_per_request": out, "requests": n, "rounds": rounds}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1 round, short runs, 100k records")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--seconds", type=float, default=None)
    ap.add_argument("--records", type=int, default=None)
    ap.add_argument("--only", default="cost,onoff,aggregate")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    rounds = args.rounds or (1 if args.quick else 5)
    seconds = args.seconds or (1.0 if args.quick else 3.0)
    n = args.records or (100_000 if args.quick else 1_000_000)
    only = set(args.only.split(","))
    install_signal_handlers()
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="iop-bench-ledger-") as tmp:
        workdir = Path(tmp)
        if "cost" in only:
            result["cost"] = run_cost(20_000 if args.quick else 200_000, rounds, workdir)
        if "aggregate" in only:
            result["aggregate"] = asyncio.run(run_aggregate(workdir, n))
        if "onoff" in only:
            owned = Owned(workdir)
            try:
                result["onoff"] = run_onoff(owned, workdir, rounds, seconds)
            finally:
                owned.stop_all()
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
