"""Standby: while every slot of a pool is busy, the next requests already wait in the broker.

A request is normally bound to a provider only when one of its slots frees (late binding), and that
costs a freed slot a whole handover before its next request starts: the node's Done to the edge,
the grant, the publish, JetStream's delivery (1.5 to 7 ms on a busy two-core machine, 2 to 10 % of a
60 ms answer). With `edge.queue.standby: n`, once every slot of a provider is busy up to `n` more
requests of its pools are published to it at once; the broker's `max_ack_pending` keeps them
undelivered until an ack frees a slot, and the node's next pull takes one at once.

The broker still holds the provider to its capacity exactly. What a standby gives up is the late
binding of those few requests: each waits for its own provider's next free slot. So standbys are
placed only while at least as many requests wait as providers have room, so that a slot that frees
finds its own provider's standby, not one standing by elsewhere (with fewer waiting, they stay
late-bound). A standby goes to the provider expected to free a slot first (the shortest turn: its
slots' hold time over its capacity, as this edge measured it), never to one whose turn is more than
`SLOWER` times the pool's shortest (a slow machine beside fast ones keeps its late binding); a
request that holds out for its session's provider waits for that one only. A client that leaves
meanwhile takes its request out of the broker as before (iop/edge/publish.py `withdraw`).
"""

from __future__ import annotations

from collections.abc import Iterable
from time import monotonic

from iop.edge.fairqueue import Waiter
from iop.edge.routing import Router
from iop.edge.slots import Grant, PinnedQueue, PoolQueue, ProviderSlots

SLOWER = 2.0
"""A provider whose turn is longer than this many times the pool's shortest takes no standby."""


def turn_s(router: Router, p: ProviderSlots) -> float | None:
    """How often one of `p`'s slots frees, as measured here (None: not yet measured)."""
    f = router.figures.get(p.id)
    if f is None or f.held_s is None or p.capacity <= 0:
        return None
    return f.held_s / p.capacity


def choice(router: Router, rooms: list[ProviderSlots], members: Iterable[ProviderSlots]) -> ProviderSlots | None:
    """Which of `rooms` (full providers with standby room) a request waits for: the shortest turn,
    an unmeasured one first (it gets measured), then the most slots; None when all are too slow."""
    known = [t for p in members if (t := turn_s(router, p)) is not None]
    shortest = min(known) if known else None
    best: tuple[float, int, ProviderSlots] | None = None
    for p in rooms:
        t = turn_s(router, p)
        if t is not None and shortest is not None and t > SLOWER * shortest:
            continue
        key = (t or 0.0, -p.capacity, p)
        if best is None or key[:2] < best[:2]:
            best = key
    return best[2] if best is not None else None


def room(pool: PoolQueue, n: int) -> bool:
    """Whether the pool's next waiter may stand by now: some provider has room, and at least as many
    wait as providers have room, so each of them gets its own (never a pinned queue's). With fewer
    waiting, they stay late-bound: one standing by at one provider while another frees first would
    leave that slot idle while it waits."""
    if not n or isinstance(pool, PinnedQueue):
        return False
    rooms = 0
    for p in pool.providers:
        if p.standby_room(n):
            rooms += 1
    return 0 < rooms <= pool.waiters.eligible_waiting


def place(
    router: Router, providers: dict[str, ProviderSlots], pool: PoolQueue, w: Waiter, n: int
) -> ProviderSlots | None:
    """Where waiter `w` of `pool` stands by: its session's provider when it has room (only there
    while it holds out for it), else `choice` among the pool's providers it may take. None for a
    tenant that has a request here already while another tenant is active (`shared`)."""
    t = w.tenant
    if t is not None and t.running and shared(pool, t.name):
        return None
    if w.prefer is not None:
        p = providers.get(w.prefer)
        if p is not None and pool in p.pools and p.id not in w.exclude and p.standby_room(n):
            return p
        if w.holding:
            return None
    rooms = [p for p in pool.providers if p.id not in w.exclude and p.standby_room(n)]
    return choice(router, rooms, pool.providers) if rooms else None


def stand(grant: Grant) -> None:
    """`grant` is a standby: its request counts as waiting, in its pool and its tenant, until it starts."""
    grant.standby = grant.standing = True
    grant.pool.standing += 1
    if grant.tenant is not None:
        grant.tenant.standing += 1


def stood(grant: Grant) -> None:
    """A standby's wait in the broker is over: its node started it, or it ended unstarted."""
    grant.standing = False
    grant.pool.standing -= 1
    if grant.tenant is not None:
        grant.tenant.standing -= 1


RECENT_S = 1.0
"""A tenant whose last request here ended this recently is still active (a client between turns)."""


def shared(pool: PoolQueue, tenant: str) -> bool:
    """Whether a tenant other than `tenant` is active in the pool: waiting or running here, ended
    here lately, or waiting or running on another edge lately (its announcements, iop/edge/share.py).

    Then only a tenant with nothing here yet may stand by: a standby is placed in the fair order
    of its moment, before the next slot frees, so one of a busy tenant's would sit ahead of another
    tenant's request that arrives meanwhile, and that request would wait for the slot after."""
    tenants = pool.waiters.tenants
    if len(tenants) > 1 or (tenants and tenant not in tenants):
        return True
    last, at, _, other_at = pool.ended
    return monotonic() - (at if last != tenant else other_at) < RECENT_S


def active(pool: PoolQueue, tenant: str) -> None:
    """`tenant` was active in the pool just now: a request of it ended here, or another edge
    announced it waiting or running (`shared` reads when)."""
    last, at, other, other_at = pool.ended
    now = monotonic()
    pool.ended = (tenant, now, other, other_at) if tenant == last else (tenant, now, last, at)
