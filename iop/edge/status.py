"""`GET /status`: the configured catalog joined with live heartbeats and this edge's queues."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TypedDict

from nats.aio.client import Client as NATS

from iop import __version__, config, endpoints, wire
from iop.contracts.status import (
    CliResourceStatus,
    EdgeInfo,
    NodeStatus,
    PoolProviderStatus,
    PoolStatus,
    ProviderStatus,
    QualificationSummary,
    RouteStatus,
    Status,
    TenantLimits,
    TenantLoad,
)
from iop.edge.current import CurrentDeployment
from iop.edge.limits import Limiter
from iop.edge.refresh import Refresher
from iop.edge.registry import Registry
from iop.edge.scheduler import Scheduler
from iop.edge.storage import WorkStream
from iop.edge.window import day_of, month_of
from iop.percentile import nearest_rank


@dataclass(frozen=True, eq=False)
class StatusSources:
    """The parts the status document is read from: the running deployment and the edge's live tables."""

    edge_id: str
    nats_url: str
    started_at: float
    current: CurrentDeployment
    registry: Registry
    scheduler: Scheduler
    nc: NATS
    work_stream: WorkStream
    refresher: Refresher
    qualifications: Mapping[str, QualificationSummary]
    """The qualification desk's latest summary per provider (kept up to date in place)."""
    limits: Limiter | None = None

    @property
    def deployment(self) -> config.Deployment:
        return self.current.deployment

    @property
    def catalog(self) -> config.Catalog:
        return self.current.catalog

    @property
    def nats_connected(self) -> bool:
        return bool(self.nc.is_connected)

    @property
    def drift(self) -> list[str]:
        return self.refresher.drift

    @property
    def storage_error(self) -> str | None:
        return self.work_stream.error


class _Common(TypedDict):
    """The fields of `ResourceStatus`, shared by both kinds of catalog entry."""

    id: str
    adapter: str
    type: str
    model: str | None
    capacity: int | None
    unlimited: bool
    in_flight: int
    peak_in_flight: int
    served: int
    failed: int
    refused: str | None


def status_of(src: StatusSources) -> Status:
    """Every node once, every provider once under its node, then pools and direct routes."""
    now = time.time()
    mono = time.monotonic()
    pools_of: dict[str, list[str]] = {}
    for alias, members in src.catalog.pools.items():
        for m in members:
            pools_of.setdefault(m, []).append(alias)
    routes_of = {f"{n}/{p}": alias for alias, (n, p) in src.catalog.routes.items()}
    nodes = []
    for node in src.deployment.nodes:
        st = src.registry.nodes[node.id]
        providers: list[ProviderStatus] = []
        for p in node.providers:
            adapter = node.adapter(p.adapter)
            live = st.live.get(p.id) if st.connected else None
            in_flight = live.in_flight if live else 0
            slots = src.scheduler.providers.get(p.id)
            fig = src.scheduler.router.figures.get(p.id)
            common: _Common = {
                "id": p.id,
                "adapter": p.adapter,
                "type": _type_of(adapter),
                "model": p.model,
                "capacity": p.capacity,
                "unlimited": p.capacity is None,
                "in_flight": in_flight,
                "peak_in_flight": live.peak_in_flight if live else 0,
                "served": live.served if live else 0,
                "failed": live.failed if live else 0,
                "refused": (live.refused or None) if live else None,
            }
            if slots is not None:
                providers.append(
                    PoolProviderStatus(
                        **common,
                        pools=pools_of.get(p.id, []),
                        dispatched_in_flight=slots.in_flight,
                        # Late binding: waiting requests belong to the pool, not to a provider. What
                        # is queued *at* a provider is what this edge sent it that has not started.
                        queued=max(0, slots.in_flight - in_flight) if live else slots.in_flight,
                        breaker=slots.breaker(mono),
                        breaker_open_for_s=round(slots.open_until - mono, 1) if slots.open_until > mono else None,
                        consecutive_failures=slots.failures,
                        qualifying="qualify" in slots.drains,
                        drained="; ".join(slots.drains.values()) or None,
                        ttft_ms=_round(fig.ttft_s * 1000 if fig is not None and fig.ttft_s is not None else None),
                        decode_tok_s=_round(fig.decode_tok_s if fig is not None else None),
                        qualification=src.qualifications.get(p.id),
                        server=live.server if live else None,
                    )
                )
            else:
                providers.append(CliResourceStatus(**common, route=routes_of.get(f"{node.id}/{p.id}")))
        nodes.append(
            NodeStatus(
                id=node.id,
                connected=st.connected,
                last_seen=st.last_seen,
                last_seen_s_ago=round(now - st.last_seen, 3) if st.last_seen else None,
                instance=st.instance,
                version=st.version or None,
                legacy_concurrency=node.legacy_concurrency(),
                providers=providers,
                device=st.device,
            )
        )
    pools = []
    affinity = src.scheduler.sessions.counts
    for alias, members in src.catalog.pools.items():
        members_slots = [src.scheduler.providers[m] for m in members]
        p50_ms, p95_ms = wait_quantiles_ms(src.scheduler.pools[alias].waits_s)
        members_live = [lv for ms in members_slots if (lv := _live(src, ms.node, ms.id)) is not None]
        pools.append(
            PoolStatus(
                alias=alias,
                candidates=members,
                connected_candidates=sum(1 for ms in members_slots if ms.connected),
                total_capacity=sum(ms.capacity for ms in members_slots),
                connected_capacity=sum(ms.capacity for ms in members_slots if ms.connected),
                # What can take work now: connected and not out of rotation (breaker open).
                usable_capacity=sum(ms.capacity for ms in members_slots if ms.connected and ms.breaker(mono) != "open"),
                retry_after_s=retry_after_of(src.scheduler, alias),
                in_flight=sum(lv.in_flight for lv in members_live),
                dispatched_in_flight=sum(ms.in_flight for ms in members_slots),
                waiting=src.scheduler.waiting(alias),
                running=src.scheduler.pools[alias].running,
                peak_running=src.scheduler.pools[alias].peak_running,
                queue_wait_p50_ms=p50_ms,
                queue_wait_p95_ms=p95_ms,
                affinity_wait_ms=round(src.catalog.affinity_wait_s.get(alias, 0.0) * 1000, 3),
                affinity_hits=affinity[alias].hits if alias in affinity else 0,
                affinity_misses=affinity[alias].misses if alias in affinity else 0,
                endpoints=list(endpoints.ordered(endpoints.of_alias(src.catalog, alias))),
                tenants=[
                    TenantLoad(tenant=t, priority=prio, waiting=w, running=r)
                    for t, prio, w, r in src.scheduler.pools[alias].waiters.loads()
                ],
            )
        )
    routes = [
        RouteStatus(
            alias=alias,
            node=n,
            resource=p,
            connected=src.registry.connected(n),
            endpoints=list(endpoints.ordered(endpoints.of_alias(src.catalog, alias))),
        )
        for alias, (n, p) in src.catalog.routes.items()
    ]
    return Status(
        edge=edge_info(src, now),
        nodes=nodes,
        pools=pools,
        routes=routes,
        tenants=tenant_limits(src, now),
    )


def tenant_limits(src: StatusSources, now: float) -> list[TenantLimits]:
    """The limited tenants the file lists, with their use as this edge last saw it."""
    seen = src.limits.state() if src.limits is not None else {}
    window = src.limits.window if src.limits is not None else None
    out = []
    for name, p in sorted(src.current.tenants.policies.items()):
        if not p.limited:
            continue
        row = TenantLimits(
            tenant=name, rpm=p.rpm, tpm=p.tpm, tokens_per_day=p.tokens_per_day, tokens_per_month=p.tokens_per_month
        )
        use = seen.get(name)
        if use is not None and window is not None:
            live = window.live(use.window, window.slot(now))
            row.requests_in_window = sum(s.requests for s in live)
            row.tokens_in_window = sum(s.tokens for s in live)
            row.tokens_today = use.day_tokens if use.day == day_of(now) else 0
            row.tokens_this_month = use.month_tokens if use.month == month_of(now) else 0
            row.seen = True
        out.append(row)
    return out


def edge_info(src: StatusSources, now: float) -> EdgeInfo:
    """The edge's own line, the same in the full document and in the summary."""
    return EdgeInfo(
        id=src.edge_id,
        version=__version__,
        uptime_s=round(now - src.started_at, 3),
        nats=src.nats_url,
        nats_connected=src.nats_connected,
        drift=src.drift,
        storage_error=src.storage_error,
    )


def retry_after_of(scheduler: Scheduler, alias: str) -> float | None:
    pool = scheduler.pools[alias]
    if not any(p.seen for p in pool.providers):
        return None  # not connected yet since the edge started: requests wait for it a moment
    retry_s = scheduler.retry_after(pool)
    return None if retry_s is None else round(retry_s, 1)


def wait_quantiles_ms(waits_s: Iterable[float]) -> tuple[float | None, float | None]:
    """p50 and p95 of the recent queue waits (nearest rank), in ms; None while nothing was admitted."""
    waits = list(waits_s)
    p50, p95 = nearest_rank(waits, 0.50), nearest_rank(waits, 0.95)
    if p50 is None or p95 is None:
        return None, None
    return round(p50 * 1000, 1), round(p95 * 1000, 1)


def _live(src: StatusSources, node: str, provider: str) -> wire.ProviderLive | None:
    st = src.registry.nodes[node]
    return st.live.get(provider) if st.connected else None


def _type_of(adapter: config.Adapter) -> str:
    if isinstance(adapter, config.CliAdapter):
        return "cli"
    if isinstance(adapter, config.MockAdapter):
        return "mock"
    return "openai"


def _round(x: float | None) -> float | None:
    return round(x, 1) if x is not None else None
