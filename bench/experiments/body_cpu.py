"""CPU and page faults per agent-sized request, for each process on iop's path.

    python -m bench.experiments.body_cpu [--api responses] [--size 3000000] [--store | --translated] [--stream]
        [-n 100] [--latency fixed:100]

Starts the bench upstream, an edge and a node (as `python -m bench.spy` does), warms up with 30
requests, then sends `-n` more of one agent-sized body (bench/fixtures.py; `--store`: a Responses
body the edge keeps; `--translated`: one the node translates for a chat-only upstream; `--stream`:
asked as a stream), one at a time, and prints for the edge, the node and nats-server their user
and system CPU-ms and minor page faults per request, with the machine's other busy cores beside
them. Over 100 requests the CPU clock's 10 ms tick is 0.1 ms a request: finer than the bodies
scenario's per-cell CPU (20 requests), for telling two commits apart by what one request costs.

`--latency` gives the upstream a think time before its first byte (the bench upstream's spec), as
a model's prefill of a long input would: what the edge does meanwhile (a kept turn's input written
ahead, iop/responses/expand.py) then costs the client nothing; with none, every step is in line.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from bench import fixtures, load
from bench.abtest import start_upstream
from bench.procs import Owned, busy_cores, cpu_split, free_port, install_signal_handlers, machine_ticks
from bench.stack import openai_pool_node, start_stack


def _faults(pid: int) -> int:
    raw = Path(f"/proc/{pid}/stat").read_text()
    return int(raw[raw.rindex(")") + 2 :].split()[7])  # minflt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--api", choices=["chat", "responses"], default="responses")
    ap.add_argument("--size", type=int, default=3_000_000)
    ap.add_argument("--store", action="store_true", help="a Responses body that the edge keeps")
    ap.add_argument(
        "--translated", action="store_true", help="a Responses body translated for a chat-only upstream by the node"
    )
    ap.add_argument("--stream", action="store_true", help="the request asks for a stream")
    ap.add_argument("-n", type=int, default=100, help="requests measured (at most 120 s of them)")
    ap.add_argument("--latency", default="0", help="the upstream's delay before its first byte: 0, fixed:MS, ...")
    a = ap.parse_args(argv)
    if (a.store or a.translated) and a.api != "responses":
        sys.exit("body_cpu: --store and --translated are for --api responses")
    install_signal_handlers()
    out = Path(tempfile.mkdtemp(prefix="iop-body-cpu-"))
    owned = Owned(out)
    try:
        port = free_port()
        upstream = start_upstream(owned, "upstream", [port], "--latency", a.latency)
        node = openai_pool_node("n", [("fake", port, 64)])
        if a.translated:
            node["adapters"][0]["api"] = "chat"  # the node translates every Responses request
        stack = start_stack(owned, out, "cpu", [{"alias": "bench", "pool": ["fake"]}], [node])
        target = load.Target("127.0.0.1", int(stack.url.rsplit(":", 1)[1]), "/v1" + load.endpoint(a.api))
        body = fixtures.body(a.api, "bench", a.size, a.stream, a.store)
        load.run(load.LoadSpec(target, body, concurrency=1, requests=30, max_seconds=30))
        pids = {"edge": stack.edge.pid, "node": stack.nodes[0].pid}
        if stack.nats_pid:
            pids["nats-server"] = stack.nats_pid
        cpu0 = {k: cpu_split(p) for k, p in pids.items()}
        upstream0 = sum(cpu_split(upstream.pid))
        faults0 = {k: _faults(p) for k, p in pids.items()}
        ticks0 = machine_ticks()
        result = load.run(load.LoadSpec(target, body, concurrency=1, requests=a.n, max_seconds=120))
        ticks1 = machine_ticks()
        upstream_s = sum(cpu_split(upstream.pid)) - upstream0
        ok = result.count - sum(result.errors.values())
        n = max(ok, 1)
        own = 0.0
        lines = []
        for name, pid in pids.items():
            (u0, s0), (u1, s1) = cpu0[name], cpu_split(pid)
            own += (u1 - u0) + (s1 - s0)
            lines.append(
                f"  {name:<12} user {1000 * (u1 - u0) / n:6.2f}  system {1000 * (s1 - s0) / n:6.2f} CPU-ms"
                f"  {(_faults(pid) - faults0[name]) / n:7.1f} faults  per request"
            )
        # Foreign: the machine's busy cores less those of everything this run started.
        wall = result.wall_s if result.wall_s > 0 else 1.0
        foreign = max(0.0, busy_cores(ticks0, ticks1) - (own + upstream_s + result.client_cpu_s) / wall)
        how = "".join(w for w, on in ((" kept", a.store), (" translated", a.translated), (" stream", a.stream)) if on)
        kind = f"{a.api}{how}, {a.size:,} bytes"
        p50 = (result.latency_ms or {}).get("p50", 0.0)
        print(f"{kind}: {ok} requests, {result.errors or 'no errors'}, p50 {p50:.2f} ms")
        print("\n".join(lines))
        print(f"  foreign cores (busy with anything this run did not start): {foreign:.2f}")
        return 0 if ok else 1
    finally:
        owned.stop_all()


if __name__ == "__main__":
    sys.exit(main())
