"""Anticipation: a slot freed by a tenant that asks again at once is kept for it a moment.

A client that sends one request at a time (an agent's turns, an editor's completions) asks again
only after its answer came. On a saturated pool the slot its request freed went at once to another
tenant's waiter; its next request, first in the fair order as it is, then waits for the next slot
to free, and where the pool's slots turn over together (one tenant's backlog of alike requests)
that is a whole hold of one.

So when a tenant's last request running in a pool ends while others wait, the slot stays free for
it up to `edge.queue.anticipate_ms` if the tenant
- came back within that time after most of its recent requests (`RETURNS`, measured here), or has
  not come back yet at all (its first request here: nothing says it will not; unless the pool has
  had more tenants than it remembers, `TENANTS`, so that it may be one it forgot),
- would be first in the fair order when it comes (iop/edge/fairqueue.py `FairQueue.leads`; between
  edges, no tenant another edge announces waiting is of a higher class or, of its class, runs none),
- and has a fair share of at least one slot: its weight over the weights of the tenants active in
  the pool (here, and waiting on other edges), times the pool's capacity at this edge.
Its next request takes the slot at once. If it does not come, the slot goes to the next waiter when
the time is over: the cost is at most that long of one slot, and a tenant whose requests come
further apart (a tool run between turns) is never kept a slot. The other edges hear a kept slot
as held (iop/edge/share.py), so their waiters leave it; the request must come back to this edge.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from time import monotonic

from iop.edge.fairqueue import TenantQueue
from iop.edge.fairshare import Elsewhere
from iop.edge.slots import Kept, PoolQueue, ProviderSlots

RETURNS = 0.5
"""A tenant is kept a slot while at least this share of its recent requests came within the time."""
ALPHA = 0.25
"""Weight of the latest return in that share."""
TENANTS = 1024
"""Tenants per pool whose returns are remembered (the least recently seen are forgotten)."""


def asked(pool: PoolQueue, tenant: str, window_s: float) -> None:
    """`tenant` sends a request to `pool`: if it was idle here, count whether it came back in time."""
    seen = pool.returns.get(tenant)
    if seen is None or seen[0] < 0:
        return
    since, share = seen
    came = 1.0 if monotonic() - since <= window_s else 0.0
    pool.returns[tenant] = (-1.0, came if share < 0 else share + ALPHA * (came - share))


def take(pool: PoolQueue, tenant: str) -> ProviderSlots | None:
    """The slot kept for `tenant` in `pool`, no longer kept (None: none is)."""
    kept = pool.kept.pop(tenant, None)
    if kept is None:
        return None
    kept.timer.cancel()
    _unkeep(pool, kept, "taken")
    return kept.slot


def ended(
    pool: PoolQueue,
    t: TenantQueue,
    slot: ProviderSlots,
    window_s: float,
    lapse: Callable[[PoolQueue, str], None],
    elsewhere: Callable[[PoolQueue], Sequence[Elsewhere]] | None = None,
) -> bool:
    """`t`'s request on `slot` ended (its share already given back): whether the slot is kept for it.

    `lapse(pool, tenant)` is called if the time runs out first. `elsewhere(pool)`: the tenants other
    edges announce waiting here (iop/edge/fairshare.py), asked only once the cheap checks passed."""
    if t.running or t.waiters:
        return False  # it still has a request here: it is not waiting on this one's answer
    name = t.name
    seen = pool.returns.pop(name, None)
    share = seen[1] if seen is not None else -1.0
    pool.returns[name] = (monotonic(), share)  # idle from now; the most recently seen last
    if len(pool.returns) > TENANTS:
        pool.returns.pop(next(iter(pool.returns)))
        pool.returns_forgot = True
    # A tenant with no return to judge by yet (its first request here, or none came back since) is
    # kept one: the second turn of a session waits no more than the later ones. One that does not
    # come back in time shows it then, and is kept none until most of its returns are in time.
    # Once the pool has forgotten a tenant, one with nothing here may be one that came back late.
    unproven = share < 0.0 and pool.returns_forgot
    if unproven or 0.0 <= share < RETURNS or name in pool.kept or not slot.usable(monotonic()):
        return False
    queue = pool.waiters
    remote = elsewhere(pool) if elsewhere is not None else ()
    if not queue.eligible_waiting and not remote:
        return False
    if queue.eligible_waiting and not queue.leads(t.rank):
        return False
    for _, rank, _, running in remote:
        # Between edges the order is slots running per weight: one of a higher class, or one of its
        # own running none (as `t` does), is first as much as `t` is.
        if rank < t.rank or (rank == t.rank and not running):
            return False
    if _share(pool, t, sum(r[2] for r in remote)) < 1.0:
        return False
    timer = asyncio.get_running_loop().call_later(window_s, lapse, pool, name)
    pool.kept[name] = Kept(slot, timer, t.rank, t.weight)
    slot.kept += 1
    slot.rerank()
    return True


def lapsed(pool: PoolQueue, tenant: str) -> ProviderSlots | None:
    """The time for `tenant` is over: the slot it was kept is free for anyone (None: it took it)."""
    kept = pool.kept.pop(tenant, None)
    if kept is None:
        return None
    _unkeep(pool, kept, "lapsed")
    return kept.slot


def _unkeep(pool: PoolQueue, kept: Kept, outcome: str) -> None:
    kept.slot.kept -= 1
    kept.slot.rerank()
    pool.kept_outcomes[outcome] = pool.kept_outcomes.get(outcome, 0) + 1


def _share(pool: PoolQueue, t: TenantQueue, remote_weights: float) -> float:
    """`t`'s fair share of the pool's slots at this edge, with the tenants that wait or run here and
    those other edges announce waiting (`remote_weights`)."""
    weights = t.weight + remote_weights
    for other in pool.waiters.tenants.values():
        if other is not t:
            weights += other.weight
    capacity = 0
    for p in pool.providers:
        if p.connected and not p.removed and not p.drained:
            capacity += p.capacity
    return capacity * t.weight / weights
