"""Scenario 4: capacity fidelity and utilisation of one pool of three providers (capacities 2, 4, 4).

One upstream process listens on one port per provider, with a seeded random latency, and counts
each port's concurrency where it happens: an over-cap event is a request that found its provider's
port already at capacity. The upstream also records every in-flight change on the monotonic clock,
from which this module computes, over the time work was waiting in iop (from the moment all slots
first filled until the last request reached the upstream):

- slot utilisation: busy slot-seconds / (total capacity * that time): the work-conservation figure
- the fraction of that time during which every slot was busy at once
- the mean idle gap of a slot between one answer's last byte and the next request's arrival, and
  the distribution of those handover gaps
The client closes its loop with more connections than slots, so requests always wait meanwhile;
their queue wait is the edge's own `x-iop-queue-ms` (arrival at the edge → the node started it).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import load
from bench.abtest import start_upstream
from bench.measure import run_measured
from bench.procs import Owned, cpu_s, free_port, http_json, log
from bench.stack import openai_pool_node, queue_extra, start_stack

CAPACITIES = (2, 4, 4)


@dataclass
class CapacityOptions:
    requests: int = 10_000
    concurrency: int = 64
    latency: str = "uniform:20:100"
    seed: int = 7
    stream_share: str = "half"  # every other request streams
    max_seconds: float = 600.0
    storage: str = "file"
    archive: Path | None = None
    standby: int | None = None
    """edge.queue.standby (None: the edge's default)."""


def run_capacity(owned: Owned, workdir: Path, opts: CapacityOptions) -> dict[str, Any]:
    caps = ",".join(str(c) for c in CAPACITIES)
    ports = [free_port() for _ in CAPACITIES]
    up = start_upstream(
        owned, "upstream-pool", ports, "--cap", caps, "--latency", opts.latency, "--seed", str(opts.seed), "--timeline"
    )
    first_port = ports[0]
    providers = [(f"p{i}-cap{c}", port, c) for i, (port, c) in enumerate(zip(ports, CAPACITIES, strict=True))]
    stack = start_stack(
        owned,
        workdir,
        "capacity",
        models=[{"alias": "pool3", "pool": [p[0] for p in providers]}],
        nodes=[openai_pool_node("pool-node", providers)],
        storage=opts.storage,
        archive=opts.archive,
        edge_extra=queue_extra(opts.standby),
    )
    edge_port = int(stack.url.rsplit(":", 1)[1])
    base = f"http://127.0.0.1:{first_port}"
    try:
        http_json("POST", base + "/stats/reset")
        spec = load.LoadSpec(
            load.Target("127.0.0.1", edge_port, "/v1/chat/completions"),
            load.body_of("chat", "pool3", False),
            alt_body=load.body_of("chat", "pool3", True) if opts.stream_share == "half" else None,
            concurrency=opts.concurrency,
            requests=opts.requests,
            max_seconds=opts.max_seconds,
            timeout_s=opts.max_seconds,
            capture="x-iop-queue-ms",
        )
        counters = {
            "edge": stack.edge.cpu_s,
            "node": lambda: sum(n.cpu_s() for n in stack.nodes),
            "nats": lambda: cpu_s(stack.nats_pid) if stack.nats_pid else 0.0,
        }
        m = run_measured(spec, counters)
        after = http_json("GET", base + "/stats")
        timeline = http_json("GET", base + "/timeline", timeout=30)["events"]
    finally:
        stack.stop()
        owned.stop(up)
    per_port = {str(p["port"]): p for p in after["ports"]}
    util = utilisation({int(k): v for k, v in timeline.items()}, dict(zip(ports, CAPACITIES, strict=True)))
    result = {
        "requests": opts.requests,
        "concurrency": opts.concurrency,
        "latency": opts.latency,
        "seed": opts.seed,
        "streams": "every other request" if opts.stream_share == "half" else "none",
        "capacities": list(CAPACITIES),
        "standby": opts.standby,
        "completed": m.load.count,
        "errors": m.load.errors,
        "rps": m.load.rps,
        "wall_s": m.load.wall_s,
        "over_cap_events": sum(p["over_cap"] for p in after["ports"]),
        "providers": [
            {
                "id": pid,
                "capacity": cap,
                "served": per_port[str(port)]["total"],
                "peak_in_flight": per_port[str(port)]["peak_in_flight"],
                "over_cap": per_port[str(port)]["over_cap"],
                "utilisation": util["per_port"].get(port),
            }
            for pid, port, cap in providers
        ],
        "utilisation": util["utilisation"],
        "all_busy_fraction": util["all_busy_fraction"],
        "idle_gap_ms": util["idle_gap_ms"],
        "handover_gap_ms": util["handover_gap_ms"],
        "window_s": util["window_s"],
        "queue_wait_ms": m.load.header_ms,
        "latency_ms": m.load.latency_ms,
        "cpu_s": m.brief()["cpu_s"],
        "other_cores": m.other_cores,
        "stack_ready_s": stack.started_s,
    }
    log(
        f"capacity: {m.load.count} done, over-cap {result['over_cap_events']}, utilisation {util['utilisation']},"
        f" all busy {util['all_busy_fraction']}, gap {util['idle_gap_ms']} ms, queue wait {m.load.header_ms}"
    )
    return result


def utilisation(events: dict[int, list[float]], caps: dict[int, int]) -> dict[str, Any]:
    """Busy slot-time over the window in which requests waited (see the module docstring)."""
    merged: list[tuple[float, int, int]] = []
    for port, flat in events.items():
        merged += [(flat[i], port, int(flat[i + 1])) for i in range(0, len(flat), 2)]
    merged.sort()
    total_cap = sum(caps.values())
    arrivals = [t for t, _, d in merged if d > 0]
    if not arrivals:
        return {
            "utilisation": None,
            "all_busy_fraction": None,
            "idle_gap_ms": None,
            "handover_gap_ms": None,
            "window_s": 0,
            "per_port": {},
        }
    busy = 0
    start: float | None = None
    for t, _, d in merged:
        busy += d
        if busy >= total_cap:
            start = t
            break
    end = arrivals[-1]
    if start is None or end <= start:
        return {
            "utilisation": None,
            "all_busy_fraction": None,
            "idle_gap_ms": None,
            "handover_gap_ms": None,
            "window_s": 0,
            "per_port": {},
        }
    level = dict.fromkeys(caps, 0)
    busy_time = dict.fromkeys(caps, 0.0)
    freed: dict[int, deque[float]] = {p: deque() for p in caps}
    gaps_ms: list[float] = []
    all_busy = 0.0
    handovers = 0
    last = merged[0][0]
    for t, port, d in merged:
        lo, hi = max(last, start), min(t, end)
        if hi > lo:
            for p in caps:
                busy_time[p] += level[p] * (hi - lo)
            if sum(level.values()) >= total_cap:
                all_busy += hi - lo
        if d > 0 and start < t <= end:
            handovers += 1
            if freed[port]:
                # The slot that has been free the longest is the one this request fills.
                gaps_ms.append(1000.0 * (t - freed[port].popleft()))
        elif d < 0 and start <= t < end:
            freed[port].append(t)
        level[port] += d
        last = t
    window = end - start
    slot_s = total_cap * window
    used = sum(busy_time.values())
    return {
        "utilisation": round(used / slot_s, 5),
        "all_busy_fraction": round(all_busy / window, 5),
        "idle_gap_ms": round(1000.0 * (slot_s - used) / handovers, 3) if handovers else None,
        "handover_gap_ms": load.percentiles(gaps_ms),
        "window_s": round(window, 3),
        "per_port": {p: round(busy_time[p] / (caps[p] * window), 5) for p in caps},
    }
