"""`iop edge --check-cluster`: each NATS server's health and each stream's replica state, one line each.

It asks NATS only (no HTTP to the edges): it works while every edge is down, which is when it is
wanted. Servers are the ones given in the URL plus those the cluster advertises to clients.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

import nats.errors
from nats.js import api as js_api

from iop import config
from iop.errors import BusError
from iop.nats import connection
from iop.nats.access import Credentials, NatsAccess


@dataclass
class ClusterHealth:
    lines: list[str]
    healthy: bool


def _endpoint(url: str) -> str:
    parts = urlsplit(url if "://" in url else f"nats://{url}")
    return f"{parts.hostname}:{parts.port or 4222}"


async def _server_line(address: str, access: NatsAccess) -> tuple[str, bool]:
    """Connect to this one server alone and ask JetStream through it: reachable, and how fast."""
    t0 = time.monotonic()
    try:
        nc = await connection.connect(f"nats://{address}", "iop-check-cluster", access=access, wait_s=3.0)
    except BusError as exc:
        return f"server {address}: DOWN ({exc})", False
    try:
        connected_ms = (time.monotonic() - t0) * 1000
        name = nc._server_info.get("server_name") or nc._server_info.get("name") or "?"
        cluster = nc._server_info.get("cluster") or "-"
        t1 = time.monotonic()
        try:
            await nc.jetstream().account_info()
            js = f"JetStream ok ({(time.monotonic() - t1) * 1000:.1f} ms)"
            ok = True
        except (nats.errors.Error, TimeoutError) as exc:
            js = f"JetStream UNAVAILABLE ({exc or type(exc).__name__})"
            ok = False
        return f"server {address}: up, name {name}, cluster {cluster}, connect {connected_ms:.1f} ms, {js}", ok
    finally:
        await nc.close()


def _stream_line(info: js_api.StreamInfo) -> tuple[str, bool]:
    cfg, cl = info.config, info.cluster
    want = cfg.num_replicas or 1
    if cl is None:
        return f"stream {cfg.name}: R{want}, {info.state.messages} messages (single server)", want == 1
    peers = [f"{cl.leader or 'NO LEADER'} (leader)"]
    ok = bool(cl.leader)
    for r in cl.replicas or []:
        state = "current" if r.current else f"BEHIND (lag {r.lag})"
        if r.offline:
            state = "OFFLINE"
        ok = ok and bool(r.current) and not r.offline
        peers.append(f"{r.name} ({state})")
    have = 1 + len(cl.replicas or [])
    if have < want:
        ok = False
        peers.append(f"{want - have} MISSING")
    return f"stream {cfg.name}: R{want}, {info.state.messages} messages, {', '.join(peers)}", ok


async def check(url: str, access: NatsAccess) -> ClusterHealth:
    """One line per server and per stream; `healthy` False when any is down, leaderless or behind."""
    if not access.has_credentials:
        access = connection.url_access(url, access)  # each server alone gets the URL's credential too
    nc = await connection.connect(url, "iop-check-cluster", access=access, wait_s=5.0)
    try:
        known = [_endpoint(u) for u in connection.servers_of(url)]
        for u in nc.discovered_servers:
            known.append(f"{u.hostname}:{u.port or 4222}")
        servers = list(dict.fromkeys(known))
        js = nc.jetstream()
        try:
            streams = await js.streams_info()
        except (nats.errors.Error, TimeoutError) as exc:
            raise BusError(
                f"NATS at {connection.redact(url)}: cannot list streams: {exc or type(exc).__name__}"
            ) from exc
    finally:
        await nc.close()
    lines, healthy = [], True
    for line, ok in await asyncio.gather(*(_server_line(s, access) for s in servers)):
        lines.append(line)
        healthy = healthy and ok
    for info in sorted(streams, key=lambda i: i.config.name or ""):
        line, ok = _stream_line(info)
        lines.append(line)
        healthy = healthy and ok
    return ClusterHealth(lines, healthy)


def target(dep: config.Deployment, nats_url: str | None) -> tuple[str, NatsAccess]:
    """Which NATS to check and with what credential: --nats, the external URL, or this machine's embedded server."""
    settings = dep.edge.nats
    url = nats_url or settings.url
    if url != "embedded":
        return url, NatsAccess.from_settings(settings)
    host, _, port = settings.listen.rpartition(":")
    if host in ("0.0.0.0", "", "::", "[::]"):
        host = "127.0.0.1"
    return f"nats://{host}:{port}", Credentials.load(settings.store_dir, create=False).edge()
