"""`GET /status`: the configured catalog joined with live heartbeats and this edge's queues."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from iop import __version__, config, wire

if TYPE_CHECKING:
    from iop.edge.server import Edge


def status_of(edge: Edge) -> dict[str, Any]:
    """Every node once, every provider once under its node, then pools and direct routes."""
    now = time.time()
    mono = time.monotonic()
    pools_of: dict[str, list[str]] = {}
    for alias, members in edge.catalog.pools.items():
        for m in members:
            pools_of.setdefault(m, []).append(alias)
    routes_of = {f"{n}/{p}": alias for alias, (n, p) in edge.catalog.routes.items()}
    nodes = []
    for node in edge.deployment.nodes:
        st = edge.registry.nodes[node.id]
        providers = []
        for p in node.providers:
            adapter = node.adapter(p.adapter)
            live = st.live.get(p.id) if st.connected else None
            slots = edge.scheduler.providers.get(p.id)
            entry: dict[str, Any] = {
                "id": p.id,
                "kind": "cli" if isinstance(adapter, config.CliAdapter) else "pool",
                "adapter": p.adapter,
                "type": _type_of(adapter),
                "model": p.model,
                "capacity": p.capacity,
                "unlimited": p.capacity is None,
                "in_flight": live.in_flight if live else 0,
                "peak_in_flight": live.peak_in_flight if live else 0,
                "served": live.served if live else 0,
                "failed": live.failed if live else 0,
            }
            if slots is not None:
                entry["pools"] = pools_of.get(p.id, [])
                entry["dispatched_in_flight"] = slots.in_flight
                # Late binding: waiting requests belong to the pool, not to a provider. What is
                # queued *at* a provider is what this edge sent it that has not started running.
                entry["queued"] = max(0, slots.in_flight - entry["in_flight"]) if live else slots.in_flight
                entry["breaker"] = slots.breaker(mono)
                if slots.open_until > mono:
                    entry["breaker_open_for_s"] = round(slots.open_until - mono, 1)
                entry["consecutive_failures"] = slots.failures
            else:
                entry["route"] = routes_of.get(f"{node.id}/{p.id}")
            providers.append(entry)
        nodes.append(
            {
                "id": node.id,
                "connected": st.connected,
                "last_seen": st.last_seen,
                "last_seen_s_ago": round(now - st.last_seen, 3) if st.last_seen else None,
                "instance": st.instance,
                "version": st.version or None,
                "legacy_concurrency": node.legacy_concurrency(),
                "providers": providers,
            }
        )
    pools = []
    for alias, members in edge.catalog.pools.items():
        members_slots = [edge.scheduler.providers[m] for m in members]
        members_live = [lv for ms in members_slots if (lv := _live(edge, ms.node, ms.id)) is not None]
        pools.append(
            {
                "alias": alias,
                "candidates": members,
                "connected_candidates": sum(1 for ms in members_slots if ms.connected),
                "total_capacity": sum(ms.capacity for ms in members_slots),
                "connected_capacity": sum(ms.capacity for ms in members_slots if ms.connected),
                # What can take work now: connected and not out of rotation (breaker open).
                "usable_capacity": sum(
                    ms.capacity for ms in members_slots if ms.connected and ms.breaker(mono) != "open"
                ),
                "in_flight": sum(lv.in_flight for lv in members_live),
                "dispatched_in_flight": sum(ms.in_flight for ms in members_slots),
                "waiting": edge.scheduler.waiting(alias),
                "running": edge.scheduler.pools[alias].running,
                "peak_running": edge.scheduler.pools[alias].peak_running,
            }
        )
    routes = [
        {"alias": alias, "node": n, "resource": p, "connected": edge.registry.connected(n)}
        for alias, (n, p) in edge.catalog.routes.items()
    ]
    return {
        "edge": {
            "id": edge.edge_id,
            "version": __version__,
            "uptime_s": round(now - edge.started_at, 3),
            "nats": edge.nats_url,
            "nats_connected": edge.nc.is_connected,
        },
        "nodes": nodes,
        "pools": pools,
        "routes": routes,
    }


def _live(edge: Edge, node: str, provider: str) -> wire.ProviderLive | None:
    st = edge.registry.nodes[node]
    return st.live.get(provider) if st.connected else None


def _type_of(adapter: config.Adapter) -> str:
    if isinstance(adapter, config.CliAdapter):
        return "cli"
    if isinstance(adapter, config.MockAdapter):
        return "mock"
    return "openai"
