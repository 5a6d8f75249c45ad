"""What "ready" means for `iop smoke`, read from the edge's /status: who is connected, what is missing."""

from __future__ import annotations

from dataclasses import dataclass

from iop.contracts.status import PoolStatus, Status
from iop.errors import PlanError


@dataclass(frozen=True)
class Plan:
    """What smoke exercises and what it expects to find, settled from the first /status."""

    model: str
    """The pool alias the burst goes to."""
    direct: str | None
    """The direct-route alias sent one request while the pool is saturated (None: the edge has none)."""
    expect_nodes: int | None
    """Connected nodes expected; None: every node the edge knows."""
    expect_capacity: int | None
    """Connected capacity of the pool expected; None: its total capacity (every candidate)."""
    requests: int


def make_plan(
    status: Status,
    *,
    model: str | None,
    direct: str | None,
    expect_nodes: int | None,
    expect_capacity: int | None,
    requests: int | None,
) -> Plan:
    pools = [p.alias for p in status.pools]
    routes = [r.alias for r in status.routes]
    if model is None:
        if not pools:
            raise PlanError("the edge serves no pool alias, so there is no capacity to check")
        model = pools[0]
    elif model not in pools:
        kind = "a direct route, not a pool" if model in routes else "not an alias of this edge"
        raise PlanError(f"--model {model}: {kind} (its pools: {', '.join(pools) or 'none'})")
    if direct is not None and direct not in routes:
        known = ", ".join(routes) or "none"
        raise PlanError(f"--direct {direct}: not a direct route of this edge (its routes: {known})")
    if direct is None and routes:
        direct = routes[0]
    pool = status.pool(model)
    assert pool is not None
    capacity = expect_capacity if expect_capacity is not None else pool.total_capacity
    if requests is None:
        requests = max(40, 4 * capacity)
    elif requests <= capacity:
        raise PlanError(
            f"--requests {requests}: the burst must be larger than the pool's capacity ({capacity}) to fill it"
        )
    return Plan(model, direct, expect_nodes, expect_capacity, requests)


def missing(status: Status, plan: Plan, not_started: frozenset[str] = frozenset()) -> list[str]:
    """What stands between `status` and the plan's expectations, one line per gap; [] when ready."""
    gaps: list[str] = []
    connected = status.connected_nodes()

    def why(node: str) -> str:
        return " (not started: --skip-node)" if node in not_started else ""

    down = [n.id for n in status.nodes if n.id not in connected]
    if plan.expect_nodes is None:
        gaps += [f"node {n} is not connected{why(n)}" for n in down]
    elif len(connected) != plan.expect_nodes:
        listed = "; not connected: " + ", ".join(f"{n}{why(n)}" for n in down) if down else ""
        gaps.append(f"expected {plan.expect_nodes} connected nodes, the edge sees {len(connected)}{listed}")

    pool = status.pool(plan.model)
    if pool is None:
        gaps.append(f"pool {plan.model} is not served by this edge")
    else:
        gaps += _pool_gaps(status, pool, plan, not_started)

    aliases = [plan.direct] if plan.direct else []
    for alias in aliases:
        route = status.route(alias)
        if route is None:
            gaps.append(f"direct route {alias} is not served by this edge")
        elif not route.connected:
            gaps.append(
                f"direct route {alias}: CLI resource {route.resource} is on node {route.node},"
                f" which is not connected{why(route.node)}"
            )
    return gaps


def _pool_gaps(status: Status, pool: PoolStatus, plan: Plan, not_started: frozenset[str]) -> list[str]:
    candidates = pool.candidates
    by_id = {pid: node.id for pid, (node, _) in status.providers().items()}
    connected_nodes = status.connected_nodes()
    absent = [c for c in candidates if c not in by_id or by_id[c] not in connected_nodes]
    have, total = pool.connected_capacity, pool.total_capacity
    want = plan.expect_capacity if plan.expect_capacity is not None else total
    gaps: list[str] = []
    where = ", ".join(f"{c} on {by_id.get(c, '?')}" for c in absent)
    if plan.expect_capacity is None and absent:
        gaps.append(
            f"pool {plan.model}: {len(candidates) - len(absent)} of {len(candidates)} candidates connected"
            f" (missing {where}), capacity {have} of {total}"
        )
    elif have != want:
        extra = f" (missing {where})" if absent else ""
        gaps.append(f"pool {plan.model}: connected capacity {have}, expected {want}{extra}")
    return gaps


def describe_ready(status: Status, plan: Plan) -> str:
    """One line saying what was found, for progress and the report."""
    pool = status.pool(plan.model)
    text = f"{len(status.connected_nodes())} nodes connected; pool {plan.model}: " + (
        f"{pool.connected_candidates} of {len(pool.candidates)} candidates, capacity {pool.connected_capacity}"
        if pool is not None
        else "not served"
    )
    if plan.direct and (route := status.route(plan.direct)):
        text += f"; direct route {plan.direct} -> {route.node}/{route.resource}"
    return text
