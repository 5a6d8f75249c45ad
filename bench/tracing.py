"""What traces cost: CPU per request of the edge and the node with tracing off, and sampling 0 %, 10 %, 100 %.

Four stacks alike but for the deployment's `tracing:` section (none; sample_ratio 0, 0.1, 1), on
one bench upstream, exporting to one OTLP/HTTP sink (a child process that accepts and counts the
batches). Each round loads every arm in turn (the order rotates), chat whole answers at c=8; the
figure is the edge's and the node's own CPU seconds per request (their /proc counters, so the
machine's other load does not blur it), reported beside the cores others used meanwhile.
Target: 10 % sampling adds at most 30 µs of CPU per request over tracing off.

    python -m bench --only tracing [--quick]      (or python -m bench.tracing [--rounds N])
    python -m bench.tracing --sink PORT           the sink alone (what the scenario starts)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from bench import load
from bench.abtest import start_upstream
from bench.procs import Owned, busy_cores, cpu_s, free_port, http_json, log, machine_ticks, wait_until
from bench.stack import Stack, openai_pool_node, start_stack

ARMS = {"off": None, "0%": 0.0, "10%": 0.1, "100%": 1.0}
TARGET_ADDED_US_AT_10 = 30.0


@dataclass
class TracingOptions:
    rounds: int = 3
    seconds: float = 3.0
    concurrency: int = 8
    archive: Path | None = None
    cost_requests: int = 5000
    """Requests of the in-process span cost (`run_cost`), per arm."""


def run_tracing(owned: Owned, workdir: Path, opts: TracingOptions) -> dict[str, Any]:
    sink_port, up_port = free_port(), free_port()
    sink = owned.start("otlp-sink", [sys.executable, "-m", "bench.tracing", "--sink", str(sink_port)])
    sink_url = f"http://127.0.0.1:{sink_port}"
    wait_until("otlp sink", lambda: http_json("GET", sink_url + "/count") is not None, 30, [sink])
    cost = run_cost(opts.cost_requests, sink_url)
    upstream = start_upstream(owned, "upstream", [up_port], "--tokens", "16")
    stacks: dict[str, Stack] = {}
    try:
        for arm, ratio in ARMS.items():
            tracing = (
                {"endpoint": sink_url + "/v1/traces", "sample_ratio": ratio, "export_interval_ms": 200}
                if ratio is not None
                else None
            )
            stacks[arm] = start_stack(
                owned,
                workdir,
                f"tracing-{arm.rstrip('%')}",
                models=[{"alias": "bench", "pool": ["fake"]}],
                nodes=[openai_pool_node(f"node-{arm.rstrip('%')}", [("fake", up_port, 64)])],
                archive=opts.archive,
                top_extra={"tracing": tracing} if tracing else None,
            )
        for stack in stacks.values():
            _load(stack, opts.concurrency, 1.0, 300)  # unmeasured warm-up
        runs: list[dict[str, Any]] = []
        arms = list(ARMS)
        for r in range(opts.rounds):
            order = arms[r % len(arms) :] + arms[: r % len(arms)]
            row: dict[str, Any] = {"round": r, "order": order}
            for arm in order:
                row[arm] = _measured(stacks[arm], opts)
            log(
                f"r{r} CPU us/request edge+node: "
                + "  ".join(f"{a}={row[a]['cpu_us_per_request']:.0f}" for a in arms)
                + f"  (foreign cores {statistics.median(row[a]['foreign_cores'] for a in arms):.2f})"
            )
            runs.append(row)
        exported = http_json("GET", sink_url + "/count")
    finally:
        for stack in stacks.values():
            stack.stop()
        owned.stop(upstream)
        owned.stop(sink)

    def med(arm: str, key: str) -> float:
        return round(float(statistics.median(r[arm][key] for r in runs)), 1)

    out: dict[str, Any] = {"rounds": runs, "concurrency": opts.concurrency, "sink": exported, "cost": cost, "arms": {}}
    for arm in arms:
        added = [r[arm]["cpu_us_per_request"] - r["off"]["cpu_us_per_request"] for r in runs]
        out["arms"][arm] = {
            "cpu_us_per_request": med(arm, "cpu_us_per_request"),
            "edge_us": med(arm, "edge_us"),
            "node_us": med(arm, "node_us"),
            "added_us": round(statistics.median(added), 1),
            "added_us_range": [round(min(added), 1), round(max(added), 1)],
            "rps": med(arm, "rps"),
            "p50_ms": round(float(statistics.median(r[arm]["p50_ms"] for r in runs)), 3),
            "foreign_cores": round(float(statistics.median(r[arm]["foreign_cores"] for r in runs)), 2),
        }
    out["target_added_us_at_10"] = TARGET_ADDED_US_AT_10
    return out


def _load(stack: Stack, concurrency: int, seconds: float, requests: int) -> load.LoadResult:
    port = int(stack.url.rsplit(":", 1)[1])
    spec = load.LoadSpec(
        load.Target("127.0.0.1", port, "/v1/chat/completions"),
        load.body_of("chat", "bench", False),
        concurrency=concurrency,
        requests=requests,
        max_seconds=seconds,
        warmup=2 * concurrency,
        timeout_s=60,
    )
    return load.run(spec)


def _measured(stack: Stack, opts: TracingOptions) -> dict[str, Any]:
    before, ticks, t0 = stack.cpu(), machine_ticks(), time.monotonic()
    me0 = cpu_s(os.getpid())
    result = _load(stack, opts.concurrency, opts.seconds, 50_000)
    wall = time.monotonic() - t0
    after, busy = stack.cpu(), busy_cores(ticks, machine_ticks())
    ours = sum(after.values()) - sum(before.values()) + cpu_s(os.getpid()) - me0
    n = max(1, result.count)
    edge_us = (after["edge"] - before["edge"]) / n * 1e6
    node_us = (after["node"] - before["node"]) / n * 1e6
    assert result.latency_ms is not None
    return {
        "requests": result.count,
        "errors": result.errors,
        "rps": result.rps,
        "p50_ms": result.latency_ms["p50"],
        "edge_us": round(edge_us, 1),
        "node_us": round(node_us, 1),
        "cpu_us_per_request": round(edge_us + node_us, 1),
        # Cores busy meanwhile with anything but this run's processes (the machine is shared).
        "foreign_cores": round(max(0.0, busy - ours / wall), 2),
    }


# --- in process: the spans' own cost, apart from the machine's load ----------------------------------


def run_cost(requests: int, sink_url: str) -> dict[str, Any]:
    """CPU per request of every span iop makes for one pool request (edge and node), by sampling ratio.

    In this process: the span calls each request's flow makes, in order, and the batch export of
    them (the SDK's thread, counted in this process's CPU) to the sink, flushed at the end. "off"
    is the flow with tracing off: the one `tracing.on` test each request pays.
    """
    from iop import config, wire
    from iop import tracing as tr
    from iop.edge import spans
    from iop.edge.observe import Trace
    from iop.edge.slots import PoolQueue, ProviderSlots
    from iop.node import spans as node_spans
    from iop.node.adapters.base import Outcome
    from iop.node.resource import Resource
    from iop.tracingconf import TracingSettings

    slot = ProviderSlots("p", "n", 4)
    pool = PoolQueue("m", [slot])
    resource = Resource(cfg=config.Provider(id="p", adapter="up", capacity=4), adapter=None, kind="pool")  # type: ignore[arg-type]
    item = wire.WorkItem(
        request_id="req_x",
        id="c1",
        api="chat",
        stream=False,
        alias="m",
        body=b"{}",
        reply_to="r",
        deadline=time.time() + 3600,
    )
    scope: dict[str, Any] = {
        "method": "POST",
        "path": "/v1/chat/completions",
        "headers": [],
        "server": ("127.0.0.1", 8080),
    }
    usage = wire.Usage(input_tokens=10, output_tokens=16)
    out: dict[str, Any] = {}
    # A first, unmeasured pass pays the SDK's lazy imports (its first span, its first export).
    for arm, ratio in [("warm-up", 1.0), *ARMS.items()]:
        settings = TracingSettings(
            endpoint=sink_url + "/v1/traces" if ratio is not None else None,
            sample_ratio=ratio or 0.0,
            max_queue_spans=100_000,
            export_interval_ms=200,
        )
        edge, node = tr.Tracing(settings, "iop-edge", env={}), tr.Tracing(settings, "iop-node", env={})
        t0 = time.process_time()
        for _ in range(requests if arm != "warm-up" else 50):
            trace = Trace("req_x", "chat")
            if edge.on:
                spans.request(edge, trace, scope)
            if trace.span is None:
                continue
            spans.admitted(trace, "m", b"{}")
            q = spans.queue(trace, pool, "m", 0)
            spans.queue_ended(q, "granted")
            routed = spans.route(pool, slot, None, frozenset(), False, "")
            trace.attempts = 1
            attempt = spans.attempt(trace, "p", "n", "pool", routed)
            headers = tr.headers_of(attempt)
            work = node_spans.work(node, headers, resource, item, "n", 1, 0.5)
            assert work is not None
            call = node_spans.call(node, work, resource, None, item)
            tr.traceparent(call)
            node_spans.ended(work, call, Outcome(upstream_status=200), usage, "", 12.0)
            spans.answer(attempt, False)
            spans.answer_ended(attempt, trace, "")
            spans.attempt_ended(attempt, None, False)
            spans.finish(trace, trace.record("e"))
        edge.shutdown(30.0)
        node.shutdown(30.0)
        cpu = time.process_time() - t0
        if arm == "warm-up":
            continue
        out[arm] = {
            "cpu_us_per_request": round(cpu / requests * 1e6, 2),
            "exported": edge.exported + node.exported,
            "dropped": edge.dropped + node.dropped,
        }
    base = out["off"]["cpu_us_per_request"]
    for v in out.values():
        v["added_us"] = round(v["cpu_us_per_request"] - base, 2)
    log("in-process span cost, CPU us/request: " + "  ".join(f"{a}={v['cpu_us_per_request']}" for a, v in out.items()))
    return out


# --- the sink: OTLP/HTTP's /v1/traces, answered and counted ------------------------------------------


class _Sink(BaseHTTPRequestHandler):
    posts = 0
    bytes = 0
    lock = threading.Lock()

    def do_POST(self) -> None:
        size = int(self.headers.get("content-length") or 0)
        self.rfile.read(size)
        with _Sink.lock:
            _Sink.posts += 1
            _Sink.bytes += size
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")  # an empty ExportTraceServiceResponse
        self.end_headers()

    def do_GET(self) -> None:
        body = json.dumps({"posts": _Sink.posts, "bytes": _Sink.bytes}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def serve_sink(port: int) -> None:
    ThreadingHTTPServer(("127.0.0.1", port), _Sink).serve_forever()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sink", type=int, default=None, metavar="PORT", help="only run the OTLP sink on PORT")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--seconds", type=float, default=None)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.sink is not None:
        serve_sink(args.sink)
        return 0
    opts = TracingOptions(rounds=args.rounds or (1 if args.quick else 3), seconds=args.seconds or 3.0)
    if args.quick:
        opts.seconds = args.seconds or 1.5
    with tempfile.TemporaryDirectory(prefix="iop-bench-tracing-") as tmp:
        owned = Owned(Path(tmp))
        try:
            result = run_tracing(owned, Path(tmp), opts)
        finally:
            owned.stop_all()
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
