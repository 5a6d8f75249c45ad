"""The `iop node` process: where it finds NATS, and a NodeRuntime served until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Mapping
from urllib.parse import urlsplit

from iop import config
from iop.nats import connection
from iop.nats.access import Credentials, NatsAccess
from iop.node.policy import NodePolicy
from iop.node.presence import NodeReplaced
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


def node_access(
    settings: config.NatsSettings,
    node_id: str,
    *,
    from_file: bool,
    nats_url: str = "",
    environ: Mapping[str, str] | None = None,
) -> NatsAccess:
    """This node's NATS credential.

    For the edge's embedded server (a node started with the deployment file) it is the node's own
    user: from the variables `user_env`/`password_env` name (default IOP_NATS_USER, IOP_NATS_PASSWORD)
    when this machine sets them (a remote
    node, given the output of `iop nats-creds`), else derived from the secret in `store_dir` (a
    node on the edge's machine). Otherwise the settings' variables, as for any NATS.
    """
    env = os.environ if environ is None else environ
    if any("@" in urlsplit(u).netloc for u in connection.servers_of(nats_url)):
        return NatsAccess(where="the credentials in the NATS URL")  # given explicitly: they win
    if not from_file or settings.url != "embedded":
        return NatsAccess.from_settings(settings, env)
    user_var, password_var = settings.user_env or "IOP_NATS_USER", settings.password_env or "IOP_NATS_PASSWORD"
    if env.get(user_var) and env.get(password_var):
        return NatsAccess.from_settings(config.NatsSettings(user_env=user_var, password_env=password_var), env)
    return Credentials.load(settings.store_dir).node(node_id)


async def run_node(
    dep: config.Deployment | None,
    node_id: str,
    *,
    nats_url: str,
    nats_settings: config.NatsSettings,
    follow_edge: bool,
    node_policy: NodePolicy | None = None,
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
    access = node_access(nats_settings, node_id, from_file=dep is not None, nats_url=nats_url)
    runtime = NodeRuntime(dep, node_id, nats_url, access=access, follow_edge=follow_edge, node_policy=node_policy)
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
        replaced = asyncio.create_task(runtime.lease.replaced.wait())
        try:
            await asyncio.wait({stopped, replaced}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            replaced.cancel()
        if runtime.lease.replaced.is_set():
            # One live instance per node id: this one stops its work at once and leaves the id
            # to the other. Exit non-zero so that a supervisor sees it, and says why in one line.
            await runtime.stop(grace_s=0)
            raise NodeReplaced(f"node {node_id}: another instance took this node id ({runtime.lease.reason})")
        # Running requests get their grace; a second signal cuts them short (each client hears why).
        stop.clear()
        stopping = asyncio.create_task(runtime.stop())
        again = asyncio.create_task(stop.wait())
        try:
            await asyncio.wait({stopping, again}, return_when=asyncio.FIRST_COMPLETED)
            if not stopping.done():
                log.warning("node %s: stopping now, cutting %d running requests short", node_id, runtime.cut_short())
            await stopping
        finally:
            again.cancel()
    finally:
        stopped.cancel()
