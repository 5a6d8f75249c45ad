"""Requests per second through 1, 2 and 3 edges on one 3-server NATS cluster (R3), and CPU per request.

`python -m bench.cluster [--seconds 5] [--concurrency 32] [--edges 1,2,3]`

A 3-server JetStream cluster (the bundled nats-server, routes on loopback), one node process with a
mock provider of capacity 256 and no think time, and 1..3 `iop edge` processes pointed at the whole
cluster. A closed loop of `concurrency` keep-alive connections spread over the edges sends small
non-streamed chat requests for `seconds`. Printed per edge count: req/s, its ratio to one edge, and
CPU milliseconds per request of the edges, the node, the NATS servers and all of them together.

On a 2-core machine this measures overhead and correctness, not growth: every process shares the
same two cores, so more edges add processes competing for them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench.procs import cpu_s, free_port
from iop import config
from iop.nats import connection
from iop.nats.access import SECRET_FILE, Credentials
from iop.nats.server import EmbeddedNats

BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()


async def _iop(*args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "iop",
        *args,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


async def _line(proc: asyncio.subprocess.Process, pattern: str, timeout_s: float = 60) -> re.Match[str]:
    assert proc.stdout is not None
    rx = re.compile(pattern)
    async with asyncio.timeout(timeout_s):
        while line := await proc.stdout.readline():
            if m := rx.search(line.decode(errors="replace")):
                return m
    raise RuntimeError(f"process ended without printing {pattern!r}")


async def _drain(proc: asyncio.subprocess.Process) -> None:
    assert proc.stdout is not None
    while await proc.stdout.readline():
        pass


async def _client(host: str, port: int, stop_at: float, counts: list[int]) -> None:
    """One keep-alive connection sending requests back to back until `stop_at`."""
    reader, writer = await asyncio.open_connection(host, port)
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(BODY)}\r\n\r\n"
    ).encode()
    try:
        while time.monotonic() < stop_at:
            writer.write(head + BODY)
            status = await reader.readline()
            if not status:
                raise RuntimeError("the edge closed the connection")
            length, chunked = 0, False
            while (line := await reader.readline()) not in (b"\r\n", b""):
                low = line.lower()
                if low.startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
                elif low.startswith(b"transfer-encoding:") and b"chunked" in low:
                    chunked = True
            if chunked:
                body = b""
                while size := int((await reader.readline()).split(b";")[0], 16):
                    body += await reader.readexactly(size + 2)
                await reader.readline()
            else:
                body = await reader.readexactly(length)
            ok = status.split()[1] == b"200"
            if not ok and counts[1] == 0:
                print(f"first failure: {status.decode().strip()} {body[:300]!r}", flush=True)
            counts[0 if ok else 1] += 1
    finally:
        writer.close()
        await writer.wait_closed()


async def _measure(
    edges: list[tuple[asyncio.subprocess.Process, str]],
    others: dict[str, list[int]],
    seconds: float,
    concurrency: int,
) -> dict[str, float]:
    targets = [(u.split("//")[1].rsplit(":", 1)[0], int(u.rsplit(":", 1)[1])) for _, u in edges]
    pids = {"edges": [p.pid for p, _ in edges], **others}

    async def burst(duration: float) -> list[int]:
        counts = [0, 0]
        stop_at = time.monotonic() + duration
        await asyncio.gather(*(_client(*targets[i % len(targets)], stop_at, counts) for i in range(concurrency)))
        return counts

    await burst(1.0)  # warm-up: connections, consumers, JIT-free but caches and pools
    before = {k: sum(cpu_s(p) for p in v) for k, v in pids.items()}
    t0 = time.monotonic()
    ok, failed = await burst(seconds)
    took = time.monotonic() - t0
    used = {k: sum(cpu_s(p) for p in v) - before[k] for k, v in pids.items()}
    out = {"req_s": ok / took, "failed": float(failed)}
    for k, v in used.items():
        out[f"cpu_ms_{k}"] = 1000 * v / max(ok, 1)
    out["cpu_ms_all"] = sum(out[f"cpu_ms_{k}"] for k in used)
    return out


async def stop_all(procs: list[asyncio.subprocess.Process]) -> None:
    """End the processes a run started (SIGTERM, then SIGKILL after 10 s), each by its own PID."""
    for p in procs:
        if p.returncode is None:
            p.terminate()
    for p in procs:
        try:
            async with asyncio.timeout(10):
                await p.wait()
        except TimeoutError:
            p.kill()
            await p.wait()


async def start_cluster(base: Path, name: str) -> list[EmbeddedNats]:
    """Three bundled nats-servers routed into one JetStream cluster under `base`, once it has a leader.

    The caller stops them; when this raises, it has stopped those it started."""
    routes = [f"127.0.0.1:{free_port()}" for _ in range(3)]
    servers: list[EmbeddedNats] = []
    for i, listen in enumerate(routes):
        store = base / f"s{i}"
        store.mkdir()
        if i == 0:
            Credentials.load(store)
        else:
            shutil.copy(base / "s0" / SECRET_FILE, store / SECRET_FILE)
        cluster = config.ClusterSettings(name=name, listen=listen, routes=routes, server_name=f"s{i}")
        servers.append(EmbeddedNats("127.0.0.1:0", store, cluster=cluster))
    try:
        await asyncio.gather(*(s.start() for s in servers))
        nc = await connection.connect(",".join(s.url for s in servers), "bench", wait_s=10)
        try:
            print(f"cluster: JetStream usable after {await connection.wait_jetstream(nc, 30):.1f}s", flush=True)
        finally:
            await nc.close()
    except BaseException:
        for s in servers:
            await s.stop()
        raise
    return servers


async def run(seconds: float, concurrency: int, levels: list[int]) -> list[dict[str, float]]:
    base = Path(tempfile.mkdtemp(prefix="iop-bench-cluster-"))
    servers: list[EmbeddedNats] = []
    procs: list[asyncio.subprocess.Process] = []
    try:
        servers = await start_cluster(base, "bench")
        url = ",".join(s.url for s in servers)
        cfg = base / "iop.yaml"
        cfg.write_text(
            f"""
edge:
  queue: {{timeout_s: 30, max_waiting: 10000}}
  nats: {{url: "{",".join(s.address for s in servers)}", replicas: 3}}
models: [{{alias: m, pool: [p]}}]
nodes:
  - id: n
    adapters: [{{id: mock, type: mock, latency_ms: 0, tokens: 4, token_interval_ms: 0}}]
    providers: [{{id: p, adapter: mock, capacity: 256}}]
"""
        )
        node = await _iop("node", "--config", str(cfg), "--node", "n", "--nats", url)
        procs.append(node)
        await _line(node, r"iop node n serving")
        drains = [asyncio.create_task(_drain(node))]
        edges: list[tuple[asyncio.subprocess.Process, str]] = []
        results = []
        for n in range(1, max(levels) + 1):
            edge = await _iop("edge", "--config", str(cfg), "--nats", url, "--listen", "127.0.0.1:0")
            procs.append(edge)
            m = await _line(edge, r"iop edge listening on (http://\S+)")
            drains.append(asyncio.create_task(_drain(edge)))
            edges.append((edge, m.group(1)))
            if n not in levels:
                continue
            others = {"node": [node.pid], "nats": [s.pid for s in servers if s.pid]}
            r = await _measure(edges, others, seconds, concurrency)
            r["edges"] = n
            results.append(r)
            ratio = r["req_s"] / results[0]["req_s"]
            print(
                f"{n} edge(s): {r['req_s']:7.0f} req/s (x{ratio:.2f} of one edge), failed {r['failed']:.0f}; "
                f"CPU ms/request: edges {r['cpu_ms_edges']:.2f}, node {r['cpu_ms_node']:.2f}, "
                f"nats {r['cpu_ms_nats']:.2f}, all {r['cpu_ms_all']:.2f}",
                flush=True,
            )
        return results
    finally:
        await stop_all(procs)
        for s in servers:
            await s.stop()
        shutil.rmtree(base, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--edges", default="1,2,3", help="edge counts to measure, e.g. 1,2,3")
    args = ap.parse_args()
    levels = sorted({int(x) for x in args.edges.split(",")})
    asyncio.run(run(args.seconds, args.concurrency, levels))


if __name__ == "__main__":
    main()
