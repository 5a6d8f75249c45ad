"""Fair shares across edges: a slot freed on one edge goes to the tenant that deserves it on any edge.

Each edge orders its own waiters (iop/edge/fairqueue.py), and the one whose request ended sees the
freed slot first: alone, an edge with a flooder's backlog would hand every slot it frees to that
backlog, and a quiet tenant waiting on another edge would wait for a slot of its own edge's to
free, possibly never. So every edge announces, per pool it has requests waiting for, each tenant's
class, weight, waiting requests (that it may run now) and running requests, beside its slot counts
(`wire.EdgeSlots.waiting`, iop/edge/share.py). Before it hands a free slot to its own waiters, an
edge compares the best of them with the best tenant waiting elsewhere, both by (class, running on
all edges / weight): when the other edge's is ahead, it leaves the slot free for one announcement's
trip, and the other edge, seeing the slot free, takes it. Both edges compare the same numbers, so
at most one of them leaves a slot; if the other does not take it within DEFER_S (its waiter left,
the announcement was lost), the slot goes to the edge's own waiters after all.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable
from time import monotonic

from iop.edge.slots import PinnedQueue, PoolQueue

log = logging.getLogger("iop.edge")

DEFER_S = 0.05
"""The longest a slot is left free for another edge's waiter (one announcement's trip is ~1 ms)."""

Load = tuple[str, int, float, int, int]
"""(tenant, class rank, weight, waiting it may run, running) of one tenant on one pool of one edge."""
Elsewhere = tuple[str, int, float, int]
"""(tenant, class rank, weight, running) of a tenant another edge announces waiting in a pool."""


def loads(pool: PoolQueue) -> list[Load]:
    """This edge's tenants of `pool` as the other edges hear them (only while some of them wait, in
    its queue or in standby, or one is kept a slot: the others' standbys keep clear of an active
    tenant, iop/edge/standby.py)."""
    if not pool.waiters and not pool.standing and not pool.kept:
        return []
    tenants = pool.waiters.tenants
    rows = [(t.name, t.rank, t.weight, len(t.waiters) if t.eligible else 0, t.running) for t in tenants.values()]
    # A tenant kept a slot (iop/edge/anticipate.py) is active too: no other edge's standby may take it.
    rows.extend((name, k.rank, k.weight, 0, 0) for name, k in pool.kept.items() if name not in tenants)
    return rows


def _sound(row: Load) -> bool:
    """Whether an announced row is one an edge sends: its weight a share (> 0, as the deployment's
    tenants are), its counts not below 0; another would divide by zero or always be ahead."""
    _, _, weight, waiting, running = row
    return math.isfinite(weight) and weight > 0 and waiting >= 0 and running >= 0


class FairShare:
    """The other edges' waiting tenants, and whether a slot this edge frees is owed to one of them."""

    def __init__(self, pump: Callable[[str], None]) -> None:
        self.pump = pump
        """Serve the waiters of pool `alias` again (a deferral ended, or another edge's waiters changed)."""
        self.elsewhere: dict[str, dict[str, list[Load]]] = {}
        """Other edge → pool alias → its tenants there, from its announcements."""
        self.deferred = 0
        """Slots left free for another edge's waiter (status, tests)."""
        self._since: dict[str, float] = {}
        """Pool → when its current deferral began (monotonic)."""
        self._junk: set[str] = set()
        """Edges that announced rows no edge sends (logged once each)."""

    def heard(self, edge: str, full: bool, waiting: dict[str, list[Load]]) -> None:
        before = self.elsewhere.get(edge) or {}
        pools = {} if full else dict(before)
        for alias, announced in waiting.items():
            rows = [row for row in announced if _sound(row)]
            if len(rows) < len(announced) and edge not in self._junk:
                self._junk.add(edge)  # (no edge sends these: logged once, not per announcement)
                log.warning("edge %s announces waiting tenants with a weight <= 0 or a count < 0: ignored", edge)
            if rows:
                pools[alias] = rows
            else:
                pools.pop(alias, None)
        self.elsewhere[edge] = pools
        for alias in set(pools) | set(before):
            if pools.get(alias) != before.get(alias):
                # News (not a full announcement repeating itself): a deferral may begin or end afresh.
                self._since.pop(alias, None)
                self.pump(alias)

    def forget(self, edge: str) -> None:
        """`edge` is silent (gone): its waiters no longer count."""
        for alias in self.elsewhere.pop(edge, {}):
            self._since.pop(alias, None)
            self.pump(alias)

    def waiting_elsewhere(self, pool: PoolQueue) -> list[Elsewhere]:
        """(tenant, class rank, weight, running) of the tenants other edges announce waiting in `pool`
        and that have nothing here (iop/edge/anticipate.py weighs a kept slot against them)."""
        if not self.elsewhere:
            return []
        here = pool.waiters.tenants
        return [
            (name, rank, weight, running)
            for pools in self.elsewhere.values()
            for name, rank, weight, waiting, running in pools.get(pool.alias, ())
            if waiting and name not in here
        ]

    def owed(self, pool: PoolQueue) -> bool:
        """Whether the free slots of `pool` should wait for a tenant waiting on another edge."""
        if not self.elsewhere or isinstance(pool, PinnedQueue) or not pool.waiters.fair:
            return False
        remote: dict[str, tuple[int, float, int, int]] = {}
        for pools in self.elsewhere.values():
            for name, rank, weight, waiting, running in pools.get(pool.alias, ()):
                r = remote.get(name)
                remote[name] = (rank, weight, waiting + (r[2] if r else 0), running + (r[3] if r else 0))
        if not any(r[2] for r in remote.values()):
            return False
        here = pool.waiters.tenants
        best_here = min(
            (
                (t.rank, (t.running + (remote[t.name][3] if t.name in remote else 0)) / t.weight)
                for t in here.values()
                if t.waiters and t.eligible
            ),
            default=None,
        )
        if best_here is None:
            return False
        best_there = min(
            (rank, (running + (here[name].running if name in here else 0)) / weight)
            for name, (rank, weight, waiting, running) in remote.items()
            if waiting
        )
        if best_there >= best_here:
            self._since.pop(pool.alias, None)
            return False
        now = monotonic()
        since = self._since.get(pool.alias)
        if since is None:
            self._since[pool.alias] = now
            self.deferred += 1
            asyncio.get_running_loop().call_later(DEFER_S, self.pump, pool.alias)
            return True
        # Not taken in time: until the other edge says more, this edge serves its own.
        return now - since < DEFER_S
