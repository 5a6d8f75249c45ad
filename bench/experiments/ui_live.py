"""What open status pages cost the edge: 20 pages polling /status once a second, or reading /status/events.

    python -m bench.experiments.ui_live       # 3 and 300 providers, 20 pages, 2 rounds of 20 s per arm
    python -m bench.experiments.ui_live --providers 300 --pages 20 --seconds 30 --rounds 3

A deployment of simulated nodes (bench/simnodes.py) with mock providers, idle: what is measured is the
page's own cost, not traffic. Each round runs three arms in turn on the same edge: `idle` (no page),
`poll` (every page GETs /status once a second, as a polling page would, on its own keep-alive
connection) and `sse` (every page holds one /status/events stream). The edge process's CPU time
(utime + stime from /proc) over each arm, less the idle arm's rate, divided by pages and minutes, is
the figure printed: edge CPU milliseconds per page per minute. Documents per page per second are
printed beside it, so the two ways are compared at the same freshness.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.procs import Owned, cpu_s, install_signal_handlers, log
from bench.stack import mock_node, start_stack

PERIOD_S = 1.0


async def _poll_page(url: str, until: float, offset_s: float, got: list[int]) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        await asyncio.sleep(offset_s)  # pages opened at different moments: spread over the second
        tick = time.monotonic()
        while tick < until:
            r = await http.get("/status")
            r.raise_for_status()
            got[0] += 1
            tick += PERIOD_S
            await asyncio.sleep(max(0.0, tick - time.monotonic()))  # a polling page's own timer


async def _sse_page(url: str, until: float, got: list[int]) -> None:
    async with (
        httpx.AsyncClient(base_url=url, timeout=10) as http,
        http.stream("GET", "/status/events") as stream,
    ):
        stream.raise_for_status()
        try:
            async with asyncio.timeout(until - time.monotonic()):
                async for line in stream.aiter_lines():
                    if line.startswith("data: "):
                        got[0] += 1
        except TimeoutError:
            pass


async def _arm(kind: str, url: str, pages: int, seconds: float) -> int:
    until = time.monotonic() + seconds
    counts = [[0] for _ in range(pages)]
    if kind == "poll":
        tasks = [_poll_page(url, until, PERIOD_S * i / pages, counts[i]) for i in range(pages)]
    elif kind == "sse":
        tasks = [_sse_page(url, until, counts[i]) for i in range(pages)]
    else:
        tasks = [asyncio.sleep(seconds)]
    await asyncio.gather(*tasks)
    return sum(c[0] for c in counts)


def measure(owned: Owned, workdir: Path, providers: int, pages: int, seconds: float, rounds: int) -> dict[str, Any]:
    per_node = 10 if providers >= 30 else 1
    n_nodes = max(1, providers // per_node)
    nodes = [
        mock_node(f"ui{i:03d}", [f"ui{i:03d}-{x}" for x in range(per_node)], capacity=2, latency_ms=0, tokens=4)
        for i in range(n_nodes)
    ]
    pools = [{"alias": f"pool-{i:03d}", "pool": [p["id"] for p in n["providers"]]} for i, n in enumerate(nodes)]
    # Its own nats-server without credentials, which the simulated nodes can join as they are.
    stack = start_stack(owned, workdir, f"ui{providers}", pools, nodes, node_procs="sim", storage="memory")
    try:
        size = len(json.dumps(stack.status()))
        cpu: dict[str, list[float]] = {"idle": [], "poll": [], "sse": []}
        docs: dict[str, list[float]] = {"poll": [], "sse": []}
        for r in range(rounds):
            for kind in ("idle", "poll", "sse"):
                c0 = cpu_s(stack.edge.pid)
                t0 = time.monotonic()
                got = asyncio.run(_arm(kind, stack.url, pages, seconds))
                took = time.monotonic() - t0
                cpu[kind].append((cpu_s(stack.edge.pid) - c0) / took)  # edge CPU seconds per second
                if kind != "idle":
                    docs[kind].append(got / pages / took)
                log(f"{providers} providers, round {r + 1}, {kind}: edge {cpu[kind][-1] * 1000:.1f} ms CPU/s")
        idle = statistics.median(cpu["idle"])
        out: dict[str, Any] = {
            "providers": providers,
            "status_bytes": size,
            "pages": pages,
            "idle_cpu_ms_per_s": idle * 1000,
        }
        for kind in ("poll", "sse"):
            net = [max(0.0, c - idle) for c in cpu[kind]]
            out[kind] = {
                "edge_cpu_ms_per_page_per_min": round(statistics.median(net) * 60 * 1000 / pages, 1),
                "docs_per_page_per_s": round(statistics.median(docs[kind]), 2),
            }
        return out
    finally:
        stack.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--providers", default="3,300", help="deployment sizes, comma-separated")
    parser.add_argument("--pages", type=int, default=20)
    parser.add_argument("--seconds", type=float, default=20.0, help="length of one arm")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    install_signal_handlers()
    with tempfile.TemporaryDirectory(prefix="iop-ui-bench-") as tmp:
        owned = Owned(Path(tmp))
        try:
            results = [
                measure(owned, Path(tmp), int(n), args.pages, args.seconds, args.rounds)
                for n in args.providers.split(",")
            ]
        finally:
            owned.stop_all()
    print(f"{'providers':>9} {'/status bytes':>13} {'mode':>5} {'edge CPU ms/page/min':>21} {'docs/page/s':>11}")
    for res in results:
        for kind in ("poll", "sse"):
            row = res[kind]
            print(
                f"{res['providers']:>9} {res['status_bytes']:>13} {kind:>5} "
                f"{row['edge_cpu_ms_per_page_per_min']:>21} {row['docs_per_page_per_s']:>11}"
            )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
