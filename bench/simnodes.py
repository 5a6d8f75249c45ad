"""Many simulated nodes in one process: one iop NodeRuntime per node of a deployment, for the scale bench.

    python -m bench.simnodes --config FILE --nats nats://127.0.0.1:PORT [--nodes ID,ID,...]

Each node is a real `iop.node.runtime.NodeRuntime` with its own NATS connection, hello, heartbeats
and fetch loops, exactly as `iop node` runs it; only the process is shared, so a hundred nodes fit
on a two-core machine. Prints `simnodes ready N` once every node serves, stops them all on
SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import logging
import os
import signal
import time

from iop import config
from iop.node.main import node_access
from iop.node.runtime import NodeRuntime

START_AT_ONCE = 20
"""Nodes starting concurrently: a hundred hellos at once would only queue behind each other."""


async def serve(deployment: config.Deployment, node_ids: list[str], nats_url: str) -> None:
    # Each node with its own NATS user, as `iop node --config` finds it (store_dir of the file).
    access = {nid: node_access(deployment.edge.nats, nid, from_file=True, nats_url=nats_url) for nid in node_ids}
    runtimes = [NodeRuntime(deployment, nid, nats_url, access=access[nid]) for nid in node_ids]
    gate = asyncio.Semaphore(START_AT_ONCE)
    t0 = time.monotonic()

    async def start(rt: NodeRuntime) -> None:
        async with gate:
            await rt.start(connect_wait_s=30.0)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await asyncio.gather(*(start(rt) for rt in runtimes))
        print(f"simnodes ready {len(runtimes)} in {time.monotonic() - t0:.2f}s", flush=True)
        await stop.wait()
    finally:
        await asyncio.gather(*(rt.stop(grace_s=2.0) for rt in runtimes if rt.nc is not None), return_exceptions=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--nats", required=True, help="the edge's NATS URL")
    ap.add_argument("--nodes", default="", help="comma-separated node ids (default: every node of the file)")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    deployment = config.load(a.config).deployment
    ids = [x for x in a.nodes.split(",") if x] or [n.id for n in deployment.nodes]
    factory = None
    if os.environ.get("IOP_LOOP", "uvloop") == "uvloop":  # the event loop `iop node` runs on
        with contextlib.suppress(ImportError):
            factory = importlib.import_module("uvloop").new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(serve(deployment, ids, a.nats))


if __name__ == "__main__":
    main()
