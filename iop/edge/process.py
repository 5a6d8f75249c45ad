"""The edge process: embedded NATS and its supervision, the HTTP server, signals, an orderly shutdown."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from pathlib import Path

import nats.errors
import uvicorn

from iop import config, validate
from iop.edge import http as edge_http
from iop.edge import ws_protocol
from iop.edge.app import build_app
from iop.edge.keys import EdgeKeys
from iop.edge.root import Edge
from iop.edge.store_recovery import recover_store
from iop.errors import BusError, ConfigError
from iop.nats import connection
from iop.nats.access import NatsAccess
from iop.nats.server import EmbeddedNats
from iop.openai.compaction import Sealer

log = logging.getLogger("iop.edge")


def http_config(edge: Edge, *, host: str = "127.0.0.1", port: int = 0, grace_s: float = 30.0) -> uvicorn.Config:
    """The edge's app on the production HTTP stack: iop's protocol and connection limits
    (iop/edge/http.py) under uvicorn, exactly as `run_edge` serves it (tests serve this too)."""
    return uvicorn.Config(
        build_app(edge),
        host=host,
        port=port,
        log_level="warning",
        # No logging config of uvicorn's own: its lines (tracebacks too) go through the root
        # logger iop.logs set up, so `--log-format json` holds for them as well.
        log_config=None,
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=int(grace_s),
        http=edge_http.protocol_class(edge.http_limits),
        # WebSocket mode of /v1/responses (iop/edge/websocket.py): wsproto, pure Python on h11,
        # which the archive already carries; an event may be as large as a request body.
        ws=ws_protocol.ws_protocol_class(edge.http_limits),
        ws_max_size=edge.max_body_bytes,
        # No permessage-deflate: an agent's events are small and its peers near, so compressing
        # them costs more CPU than the bytes it saves; and the edge frames messages itself.
        ws_per_message_deflate=False,
        timeout_keep_alive=edge.deployment.edge.http.keepalive_s,
    )


def http_server(edge: Edge, *, host: str = "127.0.0.1", port: int = 0, grace_s: float = 30.0) -> uvicorn.Server:
    """The edge's uvicorn server (`http_config`)."""
    return uvicorn.Server(http_config(edge, host=host, port=port, grace_s=grace_s))


async def run_edge(
    loaded: config.Loaded,
    *,
    listen: str | None = None,
    nats_url: str | None = None,
    ready: asyncio.Event | None = None,
    grace_s: float = 30.0,
) -> None:
    """Run an edge until SIGINT/SIGTERM: start NATS if embedded, serve HTTP, then shut down in order."""
    dep = loaded.deployment
    settings = dep.edge
    embedded: EmbeddedNats | None = None
    url = nats_url or settings.nats.url
    # Before anything starts: a missing secret is fatal. The embedded server has its own users.
    access = NatsAccess.from_settings(settings.nats) if url != "embedded" else NatsAccess()
    keys = EdgeKeys.from_settings(settings)  # so is a keys variable that holds no key
    bind = listen or settings.listen
    if not keys.clients and not validate.is_loopback(bind.rpartition(":")[0]):
        if not settings.allow_anonymous:
            raise ConfigError(
                [
                    f"edge.listen: {bind} is not a loopback address and api_keys_env is not set: set it, "
                    "or edge.allow_anonymous: true if anyone there may use every model"
                ]
            )
        log.warning("edge.allow_anonymous: anyone who reaches %s can use every model (no client keys)", bind)
    edge_http.raise_fd_limit()
    # Bind the HTTP socket before anything starts: a busy port is one line, with nothing to undo.
    sock = edge_http.bind(bind)
    try:
        if url == "embedded":
            # A relative store_dir is relative to the working directory, like any path on a command line.
            embedded = EmbeddedNats(
                settings.nats.listen, Path(settings.nats.store_dir), nodes=dep.nodes, cluster=settings.nats.cluster
            )
            await embedded.start()
            url = embedded.address
            access = embedded.access
        nc = await connection.connect(url, "iop-edge", access=access, wait_s=15.0)
        try:
            # A cluster (embedded member or external) needs its members and a JetStream leader
            # before any stream can be made: a bounded wait, then one line saying why not.
            cluster = settings.nats.cluster
            waited = await connection.wait_jetstream(
                nc, cluster.start_wait_s if cluster else connection.CLUSTER_WAIT_S, embedded
            )
        except BusError:
            await nc.close()
            raise
        if waited > 0.5:
            log.info("NATS JetStream ready after %.1fs", waited)
        edge = Edge(
            dep,
            nc,
            nats_url=connection.redact(url),  # shown in /status: never a user:password@ part
            keys=keys,
            deployment_file=loaded.path,
            # The embedded server's node users follow the deployment's nodes through refreshes.
            authorize_nodes=embedded.authorize if embedded is not None else None,
            sealer=_sealer(embedded, access),
        )
        await edge.start()
        server = http_server(edge, grace_s=grace_s)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        if loaded.path is not None:
            loop.add_signal_handler(signal.SIGHUP, edge.refresher.reload, loaded.path)
        supervisor = recovery = None
        if embedded is not None:
            supervisor = asyncio.create_task(_supervise_nats(embedded, edge, stop))
            recovery = asyncio.create_task(recover_store(embedded, edge.work_stream))
        serve = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            if serve.done():
                await serve
                return
            await asyncio.sleep(0.01)
        bound = _bound_address(server)
        shown = connection.redact(url)  # a URL given with user:password@ must not put it in the log
        log.info("iop edge %s serving http://%s (nats %s)", edge.edge_id, bound, shown)
        print(f"iop edge listening on http://{bound} nats={shown}", flush=True)
        if ready is not None:
            ready.set()
        await stop.wait()
        for task in (supervisor, recovery):
            if task is not None:
                task.cancel()
        log.info("iop edge stopping: finishing in-flight requests (up to %gs)", grace_s)
        edge.end_streams()
        server.should_exit = True
        await serve
        await edge.stop()
        try:
            await connection.flush(nc, 2)
        except (nats.errors.Error, TimeoutError, OSError) as exc:
            log.info("iop edge stopping: NATS did not flush (%s)", exc)
        await connection.close(nc)
        if edge.fatal:
            raise BusError(edge.fatal)
    finally:
        sock.close()
        if embedded is not None:
            await embedded.stop()


def _sealer(embedded: EmbeddedNats | None, access: NatsAccess) -> Sealer:
    """The compaction sealer from what every edge of the deployment holds and no node does.

    The embedded server's root secret, else the edges' own NATS password or token. With neither
    (an open NATS server), a key of this process: its compaction items end with it.
    """
    if embedded is not None and embedded.credentials is not None:
        return Sealer.derived(embedded.credentials.password("iop-compaction-seal").encode())
    secret = access.password or access.token
    if secret:
        return Sealer.derived(secret.encode())
    log.warning("NATS has no credentials: compaction items this edge makes are readable only until it stops")
    return Sealer.random()


NATS_RESTARTS = 3
"""Restarts of a dead embedded nats-server within `NATS_RESTART_WINDOW_S` before the edge gives up."""
NATS_RESTART_WINDOW_S = 60.0


async def _supervise_nats(embedded: EmbeddedNats, edge: Edge, stop: asyncio.Event) -> None:
    """Restart the embedded nats-server when it dies; past the budget, stop the edge with an error.

    Exiting non-zero is what lets a supervisor (systemd, a container runtime) act: an edge that
    keeps answering HTTP without its NATS only turns every request into a 503.
    """
    restarts: list[float] = []
    while True:
        status = await embedded.wait()
        if embedded.recycling is not None:
            await asyncio.wait({embedded.recycling})  # a restart the edge asked for, not a death
            continue
        now = time.monotonic()
        restarts = [t for t in restarts if now - t < NATS_RESTART_WINDOW_S]
        if len(restarts) >= NATS_RESTARTS:
            edge.fatal = (
                f"the embedded nats-server exited {NATS_RESTARTS + 1} times within {NATS_RESTART_WINDOW_S:g}s "
                f"(last status {status}); stopping the edge"
            )
            log.error("%s", edge.fatal)
            stop.set()
            return
        restarts.append(now)
        log.error("the embedded nats-server exited (status %s); restarting it on %s", status, embedded.address)
        edge.nats_down = f"embedded nats-server exited (status {status})"
        try:
            await embedded.restart()
        except BusError as exc:
            edge.fatal = f"the embedded nats-server exited and could not be restarted: {exc}"
            log.error("%s", edge.fatal)
            stop.set()
            return
        edge.nats_down = ""


def _bound_address(server: uvicorn.Server) -> str:
    for s in server.servers:
        for sock in s.sockets:
            host, port = sock.getsockname()[:2]
            return f"{host}:{port}"
    return "?"
