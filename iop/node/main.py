"""The `iop node` process: where it finds NATS, and a NodeRuntime served until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import signal

from iop import bus, config
from iop.node.runtime import NodeRuntime


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
    """
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    access = bus.NatsAccess.from_settings(nats_settings)
    runtime = NodeRuntime(dep, node_id, nats_url, access=access, follow_edge=follow_edge)
    await runtime.start()
    print(f"iop node {node_id} serving (nats={nats_url})", flush=True)
    await stop.wait()
    await runtime.stop()
