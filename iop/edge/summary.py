"""`GET /status?view=summary`: totals per pool, providers counted by state, only what is not healthy listed.

The full `/status` lists every node and provider, so its size and cost grow with the catalog
(115 KB at 300 providers). The summary lists pools (a handful) and whatever needs a look; healthy
nodes and providers are only counted, so a catalog that grows by healthy providers leaves the
document's size alone. It is built in one pass over the catalog without a Struct per healthy entry
and kept, encoded, for up to `MAX_AGE_S`: a monitor or a dashboard polling it (any number of them)
costs the edge one build per period, and each request the bytes it gets.
"""

from __future__ import annotations

import time
from typing import Literal

from iop import wire
from iop.contracts.status import (
    NodeAttention,
    PoolSummary,
    ProviderAttention,
    StateCounts,
    StatusSummary,
    encode_summary,
)
from iop.edge.slots import ProviderSlots
from iop.edge.status import StatusSources, edge_info, retry_after_of, wait_quantiles_ms

MAX_AGE_S = 0.25
"""How long a built summary is served before the next request builds a fresh one. Node counts are
up to a heartbeat (1 s) old anyway; this edge's own queue counts are at most this much older."""

State = Literal["ready", "full", "breaker_open", "half_open", "qualifying", "refused", "disconnected", "drained"]


def provider_state(live: wire.ProviderLive | None, slots: ProviderSlots | None, mono: float) -> State:
    """The state a catalog entry is counted in; `live` is None while its node is gone or does not run it."""
    if live is None:
        return "disconnected"
    if live.refused:
        return "refused"
    if slots is None:
        return "ready"  # a CLI resource: unlimited, no breaker
    if slots.drained:
        return "qualifying" if "qualify" in slots.drains else "drained"
    breaker = slots.breaker(mono)
    if breaker != "closed":
        return "breaker_open" if breaker == "open" else "half_open"
    return "ready" if slots.free > 0 else "full"


def summary_of(src: StatusSources) -> StatusSummary:
    """One pass over the catalog: counts for everything, an entry only for what is not healthy."""
    now = time.time()
    mono = time.monotonic()
    sched = src.scheduler
    providers: dict[str, int] = {}
    cli: dict[str, int] = {}
    state_of: dict[str, State] = {}
    live_in_flight: dict[str, int] = {}
    attention: list[NodeAttention] = []
    pools_of: dict[str, list[str]] | None = None
    nodes_connected = in_flight = 0
    for node in src.deployment.nodes:
        st = src.registry.nodes[node.id]
        lives = st.live if st.connected else {}
        nodes_connected += st.connected
        unhealthy: list[ProviderAttention] = []
        node_capacity = node_in_flight = 0
        for p in node.providers:
            live = lives.get(p.id)
            slots = sched.providers.get(p.id)
            state = provider_state(live, slots, mono)
            counts = cli if slots is None else providers
            counts[state] = counts.get(state, 0) + 1
            if live is not None:
                node_in_flight += live.in_flight
            if slots is not None:
                node_capacity += p.capacity or 0
                state_of[p.id] = state
                live_in_flight[p.id] = live.in_flight if live is not None else 0
            if state == "ready" or state == "full" or not st.connected:
                continue
            if pools_of is None:
                pools_of = _pools_of(src)
            unhealthy.append(_attention(src, node.id, p.id, p.capacity, state, live, slots, pools_of, mono))
        in_flight += node_in_flight
        if unhealthy or not st.connected:
            attention.append(
                NodeAttention(
                    id=node.id,
                    connected=st.connected,
                    last_seen_s_ago=round(now - st.last_seen, 3) if st.last_seen else None,
                    providers=len(node.providers),
                    capacity=node_capacity,
                    in_flight=node_in_flight,
                    unhealthy=unhealthy,
                )
            )
    pools = []
    total_capacity = usable_capacity = waiting = 0
    for alias, members in src.catalog.pools.items():
        queue = sched.pools[alias]
        by_state: dict[str, int] = {}
        total = usable = dispatched = running_there = 0
        for m in members:
            slots = sched.providers[m]
            state = state_of.get(m, "disconnected")
            by_state[state] = by_state.get(state, 0) + 1
            total += slots.capacity
            if state in ("ready", "full", "half_open"):
                usable += slots.capacity
            dispatched += slots.in_flight
            running_there += live_in_flight.get(m, 0)
        p50_ms, p95_ms = wait_quantiles_ms(queue.waits_s)
        pools.append(
            PoolSummary(
                alias=alias,
                providers=len(members),
                states=StateCounts(**by_state),
                total_capacity=total,
                usable_capacity=usable,
                retry_after_s=retry_after_of(sched, alias),
                in_flight=running_there,
                dispatched_in_flight=dispatched,
                waiting=len(queue.waiters) + queue.standing,
                running=queue.running,
                queue_wait_p50_ms=p50_ms,
                queue_wait_p95_ms=p95_ms,
            )
        )
        waiting += len(queue.waiters)
    for pid, state in state_of.items():
        cap = sched.providers[pid].capacity
        total_capacity += cap
        if state in ("ready", "full", "half_open"):
            usable_capacity += cap
    routes = src.catalog.routes
    return StatusSummary(
        built_at=round(now, 3),
        edge=edge_info(src, now),
        nodes=len(src.deployment.nodes),
        nodes_connected=nodes_connected,
        providers=StateCounts(**providers),
        cli_resources=StateCounts(**cli),
        routes=len(routes),
        routes_connected=sum(1 for n, _ in routes.values() if src.registry.connected(n)),
        total_capacity=total_capacity,
        usable_capacity=usable_capacity,
        in_flight=in_flight,
        waiting=waiting,
        pools=pools,
        attention=attention,
    )


def _pools_of(src: StatusSources) -> dict[str, list[str]]:
    pools_of: dict[str, list[str]] = {}
    for alias, members in src.catalog.pools.items():
        for m in members:
            pools_of.setdefault(m, []).append(alias)
    return pools_of


def _attention(
    src: StatusSources,
    node: str,
    pid: str,
    capacity: int | None,
    state: State,
    live: wire.ProviderLive | None,
    slots: ProviderSlots | None,
    pools_of: dict[str, list[str]],
    mono: float,
) -> ProviderAttention:
    if slots is None:
        route = next((alias for alias, (n, p) in src.catalog.routes.items() if (n, p) == (node, pid)), None)
        return ProviderAttention(
            id=pid, kind="cli", state=state, route=route, refused=(live.refused or None) if live else None
        )
    return ProviderAttention(
        id=pid,
        kind="pool",
        state=state,
        pools=pools_of.get(pid, []),
        capacity=capacity,
        dispatched_in_flight=slots.in_flight,
        consecutive_failures=slots.failures,
        breaker_open_for_s=round(slots.open_until - mono, 1) if slots.open_until > mono else None,
        refused=(live.refused or None) if live else None,
        drained="; ".join(slots.drains.values()) or None,
    )


class SummaryCache:
    """The encoded summary, rebuilt by the first request after it is `max_age_s` old."""

    def __init__(self, src: StatusSources, max_age_s: float = MAX_AGE_S) -> None:
        self.sources = src
        self.max_age_s = max_age_s
        self.builds = 0
        self._body = b""
        self._built = -1e18

    def body(self) -> bytes:
        mono = time.monotonic()
        if mono - self._built > self.max_age_s:
            self._body = encode_summary(summary_of(self.sources))
            self._built = mono
            self.builds += 1
        return self._body
