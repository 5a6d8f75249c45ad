"""Slot utilisation of one pool through one edge and through two, on the same load, on a 3-server cluster.

`python -m bench.edgeshare [--seconds 8] [--clients 16] [--latency-ms 250] [--rounds 2]`

A 3-server JetStream cluster (R3, the bundled nats-server, routes on loopback), three node
processes with one provider each (capacities 2, 3, 3: 8 slots), one fake upstream process
(bench.upstream) with a port per provider that answers after a fixed service time and records
every in-flight change, and two `iop edge` processes. The same closed loop of `clients`
keep-alive connections (more than the 8 slots, so requests always wait) runs once with every
client on the first edge and once split evenly over both, `rounds` times alternating.

Per run: slot utilisation = busy slot-time / (8 slots x the window in which requests waited), the
window running from the moment all slots first filled until the last request reached the
upstream (bench.capacity.utilisation), the mean idle gap per handover, the over-cap events
the upstream counted (a request arriving at a port already at its provider's capacity), and the
requests the edges together sent past a provider's capacity to wait in the broker (the edges'
`iop_provider_oversubscribed_total`, summed: a race of two edges for one slot counts twice).

Two edges schedule one pool each from its own FIFO and learn the slots the other holds from it
(see docs/scale-out.md, "Capacity across edges"); this measures what that costs against one edge.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.capacity import utilisation
from bench.cluster import _client, _drain, _iop, _line, start_cluster, stop_all
from bench.procs import free_port, http, http_json, loadavg
from iop.nats.server import EmbeddedNats

CAPACITIES = (2, 3, 3)


@dataclass
class Options:
    seconds: float = 8.0
    """Length of each run's closed loop."""
    clients: int = 16
    latency_ms: float = 250.0
    """The upstream's service time: long against the handover (a few ms), so its jitter weighs little."""
    rounds: int = 2
    prefix: str = "u"
    """Provider and node ids start with it (a cluster shared with other tests keeps their consumers apart)."""


def deployment_yaml(addresses: str, ports: list[int], prefix: str) -> str:
    nodes = "".join(
        f"""
  - id: {prefix}n{i}
    adapters: [{{id: up, type: openai, base_url: "http://127.0.0.1:{port}/v1", api: both}}]
    providers: [{{id: {prefix}p{i}, adapter: up, capacity: {cap}}}]"""
        for i, (port, cap) in enumerate(zip(ports, CAPACITIES, strict=True))
    )
    pool = ", ".join(f"{prefix}p{i}" for i in range(len(ports)))
    return f"""
edge:
  queue: {{timeout_s: 60, max_waiting: 10000}}
  nats: {{url: "{addresses}", replicas: 3}}
models: [{{alias: m, pool: [{pool}]}}]
nodes:{nodes}
"""


async def _get(url: str, method: str = "GET") -> Any:
    return await asyncio.to_thread(http_json, method, url, None, 30)


async def _oversubscribed(targets: list[tuple[str, int]]) -> float:
    """Requests the edges together sent past a provider's capacity, summed over the edges' /metrics
    (a race between two edges for one last slot is counted by both)."""
    total = 0.0
    for host, port in targets:
        status, raw = await asyncio.to_thread(http, "GET", f"http://{host}:{port}/metrics", None, 30)
        if status != 200:
            raise RuntimeError(f"GET /metrics of {host}:{port}: HTTP {status}")
        for line in raw.decode().splitlines():
            if line.startswith("iop_provider_oversubscribed_total{"):
                total += float(line.rsplit(" ", 1)[1])
    return total


async def _closed_loop(targets: list[tuple[str, int]], clients: int, seconds: float) -> tuple[int, int]:
    counts = [0, 0]
    stop_at = time.monotonic() + seconds
    await asyncio.gather(*(_client(*targets[i % len(targets)], stop_at, counts) for i in range(clients)))
    return counts[0], counts[1]


async def _until_served(target: tuple[str, int], timeout_s: float = 30) -> None:
    """Until a request through `target` succeeds (the edge has seen every node's first heartbeat)."""
    deadline = time.monotonic() + timeout_s
    while True:
        ok, _ = await _closed_loop([target], 1, 0.001)  # one request (the loop checks the time first)
        if ok:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"edge {target} served nothing within {timeout_s:.0f}s")
        await asyncio.sleep(0.2)  # a bounded poll for the first heartbeats, not a synchronisation


async def measure(url: str, addresses: str, workdir: Path, opts: Options) -> dict[str, Any]:
    """One pool on the cluster at `url`: runs with one edge and with two; figures per run and their means."""
    ports = [free_port() for _ in CAPACITIES]
    cfg = workdir / f"{opts.prefix}-iop.yaml"
    cfg.write_text(deployment_yaml(addresses, ports, opts.prefix))
    procs: list[asyncio.subprocess.Process] = []
    drains: list[asyncio.Task[None]] = []
    try:
        argv = [x for p in ports for x in ("--port", str(p))]
        caps = ",".join(str(c) for c in CAPACITIES)
        up = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "bench.upstream",
            *argv,
            "--cap",
            caps,
            "--latency",
            f"fixed:{opts.latency_ms:g}",
            "--tokens",
            "4",
            "--timeline",
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        procs.append(up)
        await _line(up, r'"upstream": "ready"')
        drains.append(asyncio.create_task(_drain(up)))
        for i in range(len(CAPACITIES)):
            node = await _iop("node", "--config", str(cfg), "--node", f"{opts.prefix}n{i}", "--nats", url)
            procs.append(node)
            await _line(node, rf"iop node {opts.prefix}n{i} serving")
            drains.append(asyncio.create_task(_drain(node)))
        targets = []
        for _ in range(2):
            edge = await _iop("edge", "--config", str(cfg), "--nats", url, "--listen", "127.0.0.1:0")
            procs.append(edge)
            m = await _line(edge, r"iop edge listening on http://(\S+):(\d+)")
            drains.append(asyncio.create_task(_drain(edge)))
            targets.append((m.group(1), int(m.group(2))))
        for t in targets:
            await _until_served(t)
        await _closed_loop(targets, opts.clients, 1.0)  # warm-up: connections, consumers

        base = f"http://127.0.0.1:{ports[0]}"
        runs: list[dict[str, Any]] = []
        for _ in range(opts.rounds):
            for n in (1, 2):
                await _get(base + "/stats/reset", "POST")
                load = loadavg()
                over = await _oversubscribed(targets)
                ok, failed = await _closed_loop(targets[:n], opts.clients, opts.seconds)
                over = await _oversubscribed(targets) - over
                stats = await _get(base + "/stats")
                timeline = (await _get(base + "/timeline"))["events"]
                u = utilisation({int(k): v for k, v in timeline.items()}, dict(zip(ports, CAPACITIES, strict=True)))
                runs.append(
                    {
                        "edges": n,
                        "ok": ok,
                        "failed": failed,
                        "over_cap": stats["over_cap"],
                        "oversubscribed": over,
                        "utilisation": u["utilisation"],
                        "idle_gap_ms": u["idle_gap_ms"],
                        "handover_gap_ms": u["handover_gap_ms"],
                        "window_s": u["window_s"],
                        "load1": load[0],
                    }
                )
                print(_line_of(runs[-1]), flush=True)
        return summary(runs)
    finally:
        await stop_all(procs)
        for d in drains:
            d.cancel()


def _line_of(r: dict[str, Any]) -> str:
    gaps = r["handover_gap_ms"] or {}
    return (
        f"{r['edges']} edge(s): {r['ok']} answered, {r['failed']} failed, over-cap {r['over_cap']}, "
        f"oversubscribed {r['oversubscribed']:.0f}, "
        f"utilisation {r['utilisation']}, idle gap {r['idle_gap_ms']} ms/handover "
        f"(p50 {gaps.get('p50')}, p99 {gaps.get('p99')}, max {gaps.get('max')}), window {r['window_s']} s, "
        f"load {r['load1']:.2f}"
    )


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    def mean(n: int) -> float:
        xs: list[float] = [r["utilisation"] for r in runs if r["edges"] == n]
        return sum(xs) / len(xs)

    one, two = mean(1), mean(2)
    return {
        "runs": runs,
        "one_edge": round(one, 5),
        "two_edges": round(two, 5),
        "ratio": round(two / one, 5),
        "points_lost": round(100 * (one - two), 2),
        "over_cap": sum(r["over_cap"] for r in runs),
        "failed": sum(r["failed"] for r in runs),
    }


async def run(opts: Options) -> dict[str, Any]:
    base = Path(tempfile.mkdtemp(prefix="iop-bench-edgeshare-"))
    servers: list[EmbeddedNats] = []
    try:
        servers = await start_cluster(base, "bench-share")
        url = ",".join(s.url for s in servers)
        out = await measure(url, ",".join(s.address for s in servers), base, opts)
        print(
            f"utilisation: one edge {out['one_edge']:.4f}, two edges {out['two_edges']:.4f} "
            f"(x{out['ratio']:.4f}, {out['points_lost']:+.2f} points lost), over-cap {out['over_cap']}, "
            f"failed {out['failed']}",
            flush=True,
        )
        return out
    finally:
        for s in servers:
            await s.stop()
        shutil.rmtree(base, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=Options.seconds)
    ap.add_argument("--clients", type=int, default=Options.clients)
    ap.add_argument("--latency-ms", type=float, default=Options.latency_ms)
    ap.add_argument("--rounds", type=int, default=Options.rounds)
    ap.add_argument("--json", action="store_true", help="print the figures as JSON at the end")
    a = ap.parse_args()
    out = asyncio.run(run(Options(a.seconds, a.clients, a.latency_ms, a.rounds)))
    if a.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
