"""CPU per response of iop.node.http1: its parser alone, and whole calls to a loopback upstream; A/B optional.

    python -m bench.experiments.http1_cpu [--baseline OLD_HTTP1_PY] [--rounds N] [--loop uvloop|asyncio]

`--baseline` takes another version of the module as a file, e.g.
`git show REV:iop/node/http1.py > /tmp/http1_old.py`: both run in this process, batches interleaved
(ABAB...), so load from other processes falls on both alike; each row prints the median µs of CPU
per response over the batches. Parser rows feed bench/experiments/http_client.py's answers (a chat completion
with content-length; a 9-event SSE stream, one chunk per read as a token server flushes) straight to
`_Conn.data_received`. Call rows are whole `HttpPool.post` + read against that upstream (its own
process), with the node's event loop (uvloop) unless told otherwise; they include the kernel's share.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import statistics
import time
from collections.abc import Awaitable, Callable
from types import ModuleType

from bench.experiments.http_client import EVENTS, PLAIN, SSE_HEAD, lean_call, upstream_process
from iop.node import http1

REQUEST = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}"
STREAM = [SSE_HEAD + b"%x\r\n%s\r\n" % (len(EVENTS[0]), EVENTS[0])]
STREAM += [b"%x\r\n%s\r\n" % (len(event), event) for event in EVENTS[1:]]
STREAM += [b"0\r\n\r\n"]
PARSE_BATCH = 2000
CALL_BATCH = 300


class _Transport(asyncio.Transport):
    def write(self, data: bytes | bytearray | memoryview) -> None:
        pass


def parse_batch(module: ModuleType, reads: list[bytes]) -> float:
    """µs of CPU per response to parse PARSE_BATCH answers arriving as `reads` on one kept-alive connection."""
    loop = asyncio.new_event_loop()
    conn = module._Conn(loop, 600.0)
    conn.connection_made(_Transport())
    start = time.process_time()
    for _ in range(PARSE_BATCH):
        conn.send(REQUEST)
        for data in reads:
            conn.data_received(data)
        if conn.state != module._DONE or not conn.keep_alive:
            raise SystemExit(f"bench.experiments.http1_cpu: response not parsed whole: {conn.exc}")
        conn.pieces.clear()
        conn.state = module._IDLE
    elapsed = time.process_time() - start
    loop.close()
    return elapsed / PARSE_BATCH * 1e6


async def call_batch(call: Callable[[bool], Awaitable[int]], stream: bool, concurrency: int) -> float:
    """µs of CPU per call for CALL_BATCH calls made by `concurrency` workers."""
    done = 0

    async def worker() -> None:
        nonlocal done
        while done < CALL_BATCH:
            done += 1
            await call(stream)

    start = time.process_time()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return (time.process_time() - start) / done * 1e6


def load(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location("http1_baseline", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"bench.experiments.http1_cpu: cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def row(name: str, samples: dict[str, list[float]]) -> None:
    print(f"{name:<36}" + "".join(f"{statistics.median(v):>12.1f}" for v in samples.values()), flush=True)


async def calls(modules: dict[str, ModuleType], port: int, rounds: int) -> None:
    pools = {
        k: m.HttpPool(f"http://127.0.0.1:{port}/v1", headers={"content-type": "application/json"})
        for k, m in modules.items()
    }
    try:
        for stream in (False, True):
            for concurrency in (1, 32):
                samples: dict[str, list[float]] = {k: [] for k in modules}
                for pool in pools.values():  # warm: the connections are open
                    await asyncio.gather(*(lean_call(pool)(stream) for _ in range(concurrency)))
                for r in range(rounds):
                    for k in list(pools)[:: 1 if r % 2 else -1]:
                        samples[k].append(await call_batch(lean_call(pools[k]), stream, concurrency))
                row(f"call, {'SSE stream' if stream else 'chat completion'}, c={concurrency}", samples)
    finally:
        for pool in pools.values():
            await pool.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="another iop/node/http1.py to compare with, as a file")
    parser.add_argument("--rounds", type=int, default=12, help="batches per row and version (default 12)")
    parser.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop", help="event loop of the call rows")
    args = parser.parse_args()
    modules = {"this": http1} | ({"baseline": load(args.baseline)} if args.baseline else {})
    print(f"{'µs CPU per response (median)':<36}" + "".join(f"{k:>12}" for k in modules))
    for name, reads in (("parse, chat completion (1 read)", [PLAIN]), ("parse, SSE stream (10 reads)", STREAM)):
        samples: dict[str, list[float]] = {k: [] for k in modules}
        for r in range(args.rounds):
            for k in list(modules)[:: 1 if r % 2 else -1]:
                samples[k].append(parse_batch(modules[k], reads))
        row(name, samples)
    with upstream_process() as upstream:
        assert upstream.stdout is not None
        port = int(upstream.stdout.readline())
        if args.loop == "uvloop":
            import uvloop

            uvloop.run(calls(modules, port, args.rounds))
        else:
            asyncio.run(calls(modules, port, args.rounds))


if __name__ == "__main__":
    main()
