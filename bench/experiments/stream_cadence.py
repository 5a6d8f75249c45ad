"""When each event of a streamed answer arrives, straight from the upstream and through iop.

    python -m bench.experiments.stream_cadence [--loop default|asyncio|uvloop] [--requests 30]

One `iop edge` and one `iop node` (the event loop forced with IOP_LOOP unless `default`) in front
of `bench/upstream.py`, which answers after 40 ms and then writes one SSE event every 5 ms. A client
sends streamed requests one after another on one kept-alive connection, first to the upstream, then
through the edge, and prints, per event of the answer, the p50 of its arrival after the request.

Through iop each event should arrive a constant 1 to 3 ms after it does direct. A hop that keeps
Nagle's algorithm on shows up here and nowhere else: the first event rides with the response head,
but the next small write waits for the client's delayed ACK (~40 ms), and the events behind it
arrive in one lump (the edge under asyncio's loop until its listening socket said IPPROTO_TCP).
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

from bench.procs import Owned, free_port, log, upstream_argv, wait_until
from bench.stack import openai_pool_node, start_stack

BODY = json.dumps({"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]})


def arrivals(base_url: str, requests: int) -> list[list[float]]:
    """Per request, ms from sending it to each non-empty SSE line of its answer."""
    host, port = base_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    out = []
    try:
        for _ in range(requests):
            t0 = time.perf_counter()
            conn.request("POST", "/v1/chat/completions", BODY, {"content-type": "application/json"})
            r = conn.getresponse()
            seen = []
            while line := r.readline():
                if line.strip():
                    seen.append((time.perf_counter() - t0) * 1000)
            out.append(seen)
    finally:
        conn.close()
    return out


def p50_per_event(runs: list[list[float]]) -> list[float]:
    n = min(len(r) for r in runs)
    return [round(statistics.median(r[i] for r in runs), 1) for i in range(n)]


def max_gap(runs: list[list[float]]) -> float:
    """The longest wait between two consecutive events (the last, [DONE], excluded)."""
    return round(max(b - a for r in runs for a, b in itertools.pairwise(r[:-1])), 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loop", choices=["default", "asyncio", "uvloop"], default="default")
    ap.add_argument("--requests", type=int, default=30)
    a = ap.parse_args()
    if a.loop != "default":
        os.environ["IOP_LOOP"] = a.loop  # inherited by the edge and node processes
    work = Path(tempfile.mkdtemp(prefix="iop-cadence-"))
    owned = Owned(work)
    try:
        up = free_port()
        owned.start(
            "upstream",
            upstream_argv(
                "--port",
                str(up),
                "--latency",
                "fixed:40",
                "--tokens",
                "8",
                "--token-interval-ms",
                "5",
                "--write",
                "each",
            ),
        )

        def listening() -> bool:
            try:
                socket.create_connection(("127.0.0.1", up), timeout=1).close()
            except OSError:
                return False
            return True

        wait_until("upstream", listening, 10)
        stack = start_stack(
            owned, work, "cadence", [{"alias": "m", "pool": ["p"]}], [openai_pool_node("n", [("p", up, 1)])]
        )
        arrivals(stack.url, 3)  # connections opened and warm on every hop
        direct = arrivals(f"http://127.0.0.1:{up}", a.requests)
        via = arrivals(stack.url, a.requests)
        log(f"loop {a.loop}, {a.requests} sequential requests each; ms after the request, p50 per event")
        print(f"{'event':>6} {'direct':>8} {'iop':>8}")
        for i, (d, v) in enumerate(zip(p50_per_event(direct), p50_per_event(via), strict=False), 1):
            print(f"{i:>6} {d:>8} {v:>8}")
        print(f"longest wait between two events: direct {max_gap(direct)} ms, iop {max_gap(via)} ms")
    finally:
        owned.stop_all()


if __name__ == "__main__":
    main()
