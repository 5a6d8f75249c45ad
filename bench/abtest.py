"""Scenarios 1-3: added latency, throughput and streaming relay, each against a direct call to the same upstream.

Every cell runs DIRECT (client → upstream) and VIA IOP (client → edge → NATS → node → upstream)
back to back with the same load, and the order alternates every round, so slow drift on a shared
machine hits both arms alike. Figures are medians over the rounds with their range.

Every round also measures THE FLOOR (bench/floor.py: a bare client publishing the same chat body
to a work-queue stream on a nats-server of its own, same build and storage, and pull loops answering
on core NATS) at each concurrency of the plain cells, at the start of even rounds and the end of odd
ones. The machine's speed drifts (on the VMs we run on, the same commit's c=32 rate moved
1,400-3,100 req/s between runs minutes apart with no foreign load or steal in sight), so iop's
figures are judged against the floor of the same round: added latency above the floor's, the c=32
rate as a share of the floor's, CPU per request as a multiple of the floor's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import floor, load
from bench.measure import Measured, run_measured, spread
from bench.procs import Owned, Proc, cpu_s, free_port, http_json, log, upstream_argv, wait_until
from bench.stack import Stack, openai_pool_node, start_stack


@dataclass
class AbOptions:
    rounds: int = 5
    seconds: float = 3.0
    """Time bound of one arm's measured phase."""
    requests: int = 20_000
    """Count bound of one arm's measured phase."""
    apis: list[str] = field(default_factory=lambda: ["chat", "responses"])
    modes: list[str] = field(default_factory=lambda: ["nonstream", "stream"])
    concurrencies: list[int] = field(default_factory=lambda: [1, 32])
    relay_one_tokens: int = 20_000
    relay_many_tokens: int = 1_000
    relay_streams: int = 64
    procs: int = 1
    storage: str = "file"
    archive: Path | None = None
    floor: bool = True
    """Measure the floor every round (see the module's docstring)."""


@dataclass(frozen=True)
class Cell:
    name: str
    api: str
    stream: bool
    concurrency: int
    upstream: str  # "plain": whole answers; "relay": one write per event
    max_tokens: int = 0


def cells_for(opts: AbOptions, only: set[str]) -> list[Cell]:
    cells: list[Cell] = []
    for api in opts.apis:
        for mode in opts.modes:
            for c in opts.concurrencies:
                stream = mode == "stream"
                wanted = "latency" in only or ("throughput" in only and not stream and c == max(opts.concurrencies))
                if wanted:
                    cells.append(Cell(f"{api}/{mode}/c{c}", api, stream, c, "plain"))
    if "relay" in only:
        cells.append(Cell("relay/1 stream", "chat", True, 1, "relay", opts.relay_one_tokens))
        n = opts.relay_streams
        cells.append(Cell(f"relay/{n} streams", "chat", True, n, "relay", opts.relay_many_tokens))
    return cells


def start_upstream(owned: Owned, name: str, ports: list[int], *args: str) -> Proc:
    """A bench upstream process listening on `ports`, once its /stats answers."""
    argv = [x for port in ports for x in ("--port", str(port))]
    p = owned.start(name, upstream_argv(*argv, *args))
    url = f"http://127.0.0.1:{ports[0]}/stats"
    wait_until(f"{name} on port {ports[0]}", lambda: bool(http_json("GET", url, timeout=2)), 15, [p])
    return p


def run_ab(owned: Owned, workdir: Path, opts: AbOptions, only: set[str]) -> dict[str, Any]:
    cells = cells_for(opts, only)
    if not cells:
        return {}
    plain_port, relay_port = free_port(), free_port()
    plain = start_upstream(owned, "upstream-plain", [plain_port], "--tokens", "16")
    relay = start_upstream(owned, "upstream-relay", [relay_port], "--tokens", "16", "--write", "each")
    stack = start_stack(
        owned,
        workdir,
        "ab",
        models=[{"alias": "bench", "pool": ["fake"]}, {"alias": "relay", "pool": ["relay"]}],
        nodes=[
            openai_pool_node(
                "bench-node", [("fake", plain_port, 64), ("relay", relay_port, max(64, opts.relay_streams))]
            )
        ],
        storage=opts.storage,
        archive=opts.archive,
    )
    ports = {"plain": plain_port, "relay": relay_port}
    ups = {"plain": plain, "relay": relay}
    edge_port = int(stack.url.rsplit(":", 1)[1])
    concurrencies = sorted({c.concurrency for c in cells if c.upstream == "plain"})
    floor_proc, floor_url = floor.start_server(owned, workdir) if opts.floor and concurrencies else (None, "")
    floors: list[dict[str, dict[str, Any]]] = []

    def measure_floor(r: int) -> None:
        if floor_proc is not None:
            server_cpu = lambda: cpu_s(floor_proc.pid)  # noqa: E731
            body = load.body_of("chat", "fake-model", False)
            got = floor.run_rates(floor_url, body, concurrencies, opts.seconds, server_cpu=server_cpu)
            floors.append(got)
            rates = " ".join(f"c={c}: {f['rps']:.0f} req/s p50 {_p(f['latency_ms'])}" for c, f in got.items())
            log(f"r{r} floor {rates}")

    try:
        _warm_up(stack, edge_port, opts)
        runs: dict[str, list[dict[str, Any]]] = {c.name: [] for c in cells}
        for r in range(opts.rounds):
            if r % 2 == 0:
                measure_floor(r)
            for cell in cells:
                order = ["direct", "iop"] if r % 2 == 0 else ["iop", "direct"]
                got: dict[str, Measured] = {}
                for arm in order:
                    port = ports[cell.upstream] if arm == "direct" else edge_port
                    got[arm] = _one(cell, arm, port, stack, ups[cell.upstream], opts)
                    if not stack.edge.alive():
                        raise RuntimeError("the edge died:\n" + stack.edge.tail())
                d, v = got["direct"], got["iop"]
                log(
                    f"r{r} {cell.name:<22} p50 direct={_p(d.load.latency_ms)} iop={_p(v.load.latency_ms)}"
                    f" rps {d.load.rps:.0f}/{v.load.rps:.0f} ev/s {d.load.events_per_s:.0f}/{v.load.events_per_s:.0f}"
                    f" err {sum(d.load.errors.values())}/{sum(v.load.errors.values())} other cores {v.other_cores:.2f}"
                )
                runs[cell.name].append({"round": r, "order": order, "direct": d.brief(), "iop": v.brief()})
            if r % 2 == 1:
                measure_floor(r)
        for cell in cells:
            if floors and cell.upstream == "plain":
                for run, f in zip(runs[cell.name], floors, strict=True):
                    run["floor"] = f[str(cell.concurrency)]
        return {"cells": [aggregate(c, runs[c.name]) for c in cells], "stack_ready_s": stack.started_s}
    finally:
        stack.stop()
        owned.stop(relay)
        owned.stop(plain)
        if floor_proc is not None:
            owned.stop(floor_proc)


def _p(summary: dict[str, float] | None, key: str = "p50") -> str:
    return f"{summary[key]:.3f}" if summary else "n/a"


def _warm_up(stack: Stack, edge_port: int, opts: AbOptions) -> None:
    """Unmeasured traffic through iop first: imports, connection pools and caches settle."""
    for api in opts.apis:
        for stream in (False, True):
            spec = load.LoadSpec(
                load.Target("127.0.0.1", edge_port, "/v1" + load.endpoint(api)),
                load.body_of(api, "bench", stream),
                concurrency=8,
                requests=200,
                max_seconds=10,
            )
            res = load.run(spec)
            if res.errors:
                raise RuntimeError(f"warm-up {api} stream={stream} through iop failed: {res.errors}")


def _one(cell: Cell, arm: str, port: int, stack: Stack, upstream: Proc, opts: AbOptions) -> Measured:
    model = "fake-model" if arm == "direct" else ("bench" if cell.upstream == "plain" else "relay")
    relay = cell.upstream == "relay"
    spec = load.LoadSpec(
        load.Target("127.0.0.1", port, "/v1" + load.endpoint(cell.api)),
        load.body_of(cell.api, model, cell.stream, cell.max_tokens),
        concurrency=cell.concurrency,
        requests=opts.requests if not relay else max(cell.concurrency * 4, 50),
        max_seconds=opts.seconds,
        warmup=cell.concurrency if relay else max(20, 2 * cell.concurrency),
        timeout_s=60,
    )
    counters = {"upstream": lambda: cpu_s(upstream.pid)}
    if arm == "iop":
        counters.update(
            {
                "edge": stack.edge.cpu_s,
                "node": lambda: sum(n.cpu_s() for n in stack.nodes),
                "nats": lambda: cpu_s(stack.nats_pid) if stack.nats_pid else 0.0,
            }
        )
    return run_measured(spec, counters, opts.procs)


def aggregate(cell: Cell, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians [min..max] over rounds of each arm's figures and of their paired differences."""

    def arm(name: str, *path: str) -> list[float | None]:
        out: list[float | None] = []
        for r in runs:
            v: Any = r[name]
            for k in path:
                v = v.get(k) if isinstance(v, dict) else None
            out.append(v)
        return out

    def added(*path: str) -> list[float | None]:
        return [
            None if a is None or b is None else b - a
            for a, b in zip(arm("direct", *path), arm("iop", *path), strict=True)
        ]

    def per_1k(*names: str) -> list[float | None]:
        out: list[float | None] = []
        for r in runs:
            n = r["iop"]["count"]
            out.append(1000.0 * sum(r["iop"]["cpu_s"].get(x, 0.0) for x in names) / n if n else None)
        return out

    agg: dict[str, Any] = {
        "cell": cell.name,
        "api": cell.api,
        "stream": cell.stream,
        "concurrency": cell.concurrency,
        "kind": "relay" if cell.upstream == "relay" else "latency",
        "rounds": len(runs),
        "direct_p50_ms": spread(arm("direct", "latency_ms", "p50")),
        "iop_p50_ms": spread(arm("iop", "latency_ms", "p50")),
        "direct_p99_ms": spread(arm("direct", "latency_ms", "p99")),
        "iop_p99_ms": spread(arm("iop", "latency_ms", "p99")),
        "added_p50_ms": spread(added("latency_ms", "p50")),
        "added_p99_ms": spread(added("latency_ms", "p99")),
        "direct_rps": spread(arm("direct", "rps"), 1),
        "iop_rps": spread(arm("iop", "rps"), 1),
        "cpu_s_per_1k": {
            "edge": spread(per_1k("edge")),
            "node": spread(per_1k("node")),
            "nats": spread(per_1k("nats")),
            "edge+node": spread(per_1k("edge", "node")),
            "edge+node+nats": spread(per_1k("edge", "node", "nats")),
            "upstream": spread(per_1k("upstream")),
            "client": spread(per_1k("client")),
        },
        "errors": {
            "direct": sum(sum(r["direct"]["errors"].values()) for r in runs),
            "iop": sum(sum(r["iop"]["errors"].values()) for r in runs),
        },
        "count": {"direct": sum(r["direct"]["count"] for r in runs), "iop": sum(r["iop"]["count"] for r in runs)},
        "busy_cores_iop_arm": spread(arm("iop", "busy_cores"), 2),
        "other_cores_iop_arm": spread(arm("iop", "other_cores"), 2),
        "runs": runs,
    }
    if all("floor" in r for r in runs) and runs:
        agg["floor"] = _against_floor(runs, added("latency_ms", "p50"), added("latency_ms", "p99"), per_1k)
    if cell.stream:
        agg.update(
            {
                "direct_ttfb_p50_ms": spread(arm("direct", "ttfb_ms", "p50")),
                "iop_ttfb_p50_ms": spread(arm("iop", "ttfb_ms", "p50")),
                "added_ttfb_p50_ms": spread(added("ttfb_ms", "p50")),
                "added_ttfb_p99_ms": spread(added("ttfb_ms", "p99")),
                "direct_events_per_s": spread(arm("direct", "events_per_s"), 0),
                "iop_events_per_s": spread(arm("iop", "events_per_s"), 0),
                "events_per_answer": spread(arm("iop", "events_per_answer"), 1),
                "direct_reads_per_answer": spread(arm("direct", "reads_per_answer"), 1),
                "iop_reads_per_answer": spread(arm("iop", "reads_per_answer"), 1),
            }
        )
    return agg


def _against_floor(
    runs: list[dict[str, Any]],
    added_p50: list[float | None],
    added_p99: list[float | None],
    per_1k: Callable[..., list[float | None]],
) -> dict[str, Any]:
    """The floor's figures of each round, and iop's beside them (paired per round)."""
    fl = [r["floor"] for r in runs]
    f50 = [f["latency_ms"]["p50"] if f["latency_ms"] else None for f in fl]
    f99 = [f["latency_ms"]["p99"] if f["latency_ms"] else None for f in fl]
    f_cpu = [f["cpu_ms_per_request"].get("client+worker", 0.0) + f["cpu_ms_per_request"].get("nats", 0.0) for f in fl]
    iop_cpu = per_1k("edge", "node", "nats")  # CPU-s per 1,000 requests: CPU-ms per request

    Pairwise = Callable[[float, float], float | None]

    def pair(a: list[float | None], b: list[float | None], f: Pairwise) -> list[float | None]:
        return [None if x is None or y is None else f(x, y) for x, y in zip(a, b, strict=True)]

    return {
        "p50_ms": spread(f50),
        "p99_ms": spread(f99),
        "rps": spread([f["rps"] for f in fl], 1),
        "cpu_ms": spread(f_cpu),
        "above_p50_ms": spread(pair(added_p50, f50, lambda a, f: a - f)),
        "p99_margin_ms": spread(pair(added_p99, f99, lambda a, f: a - (2 * f + 1.0))),
        "rps_share": spread(pair([r["iop"]["rps"] for r in runs], [f["rps"] for f in fl], _ratio)),
        "cpu_ratio": spread(pair(iop_cpu, f_cpu, _ratio), 2),
    }


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None
