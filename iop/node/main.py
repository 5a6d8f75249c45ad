"""The `iop node` process: where it finds NATS, and a NodeRuntime served until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

from iop import bus, config
from iop.node.runtime import NodeRuntime

log = logging.getLogger("iop.node")

STOP_WHILE_STARTING_S = 1.0
"""Grace for a node stopped before it served anything: nothing runs yet that deserves more."""


def default_nats_url(dep: config.Deployment) -> str:
    """Where a node finds NATS when not told: the edge's embedded server, or the external URL."""
    nats = dep.edge.nats
    if nats.url != "embedded":
        return nats.url
    host, _, port = nats.listen.rpartition(":")
    if host in ("0.0.0.0", "", "::", "[::]"):
        host = "127.0.0.1"
    return f"nats://{host}:{port}"


async def run_node(
    dep: config.Deployment | None,
    node_id: str,
    *,
    nats_url: str,
    nats_settings: config.NatsSettings,
    follow_edge: bool,
) -> None:
    """Serve one node until SIGINT/SIGTERM, then stop it gracefully.

    `dep` None: the node takes its catalog from the edge. Raises IopError when it cannot start.
    A signal during start-up (waiting for NATS, for the catalog, for the edge's welcome) stops it
    at once: start-up is a task raced against the signal, never a wait the signal cannot reach.
    """
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    access = bus.NatsAccess.from_settings(nats_settings)
    runtime = NodeRuntime(dep, node_id, nats_url, access=access, follow_edge=follow_edge)
    starting = asyncio.create_task(runtime.start())
    stopped = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({starting, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            log.info("node %s: stopped while starting", node_id)
            starting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await starting
            await runtime.stop(grace_s=STOP_WHILE_STARTING_S)
            return
        starting.result()  # a failed start raises here (IopError: one line)
        print(f"iop node {node_id} serving (nats={nats_url})", flush=True)
        await stopped
        await runtime.stop()
    finally:
        stopped.cancel()
