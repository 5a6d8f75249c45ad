"""The edge's pool queues: a request takes a free slot now, or waits its turn until one frees.

A freed slot goes to the waiter whose turn it is in its pool's fair order (iop/edge/fairqueue.py),
bound late to the provider the router picks (iop/edge/routing.py). What the providers are and
whether they are usable (catalog, connections, breakers) is iop/edge/scheduler.py's.
"""

from __future__ import annotations

import asyncio
import itertools
import math
from collections.abc import Callable, Coroutine
from time import monotonic
from typing import Any

from iop.edge import anticipate
from iop.edge import standby as standby_
from iop.edge.affinity import Sessions
from iop.edge.deadlines import Deadlines
from iop.edge.fairqueue import NOBODY, PRIORITIES, TenantQueue, Waiter, Who
from iop.edge.fairshare import Elsewhere
from iop.edge.leases import TenantLeases
from iop.edge.memory import HighWater
from iop.edge.routing import Ask, Router, Scan
from iop.edge.slots import Grant, PinnedQueue, PoolQueue, ProviderSlots
from iop.errors import QueueFull, Unavailable
from iop.tenancy import Priority

CONNECT_GRACE_S = 2.5
"""How long a request waits for a provider of its pool to connect before 503 (edge or node start)."""
GONE_RETRY_AFTER_S = 1
"""Retry-After when every provider of a pool is on a node that is gone (a node restarts in about 1 s)."""


class Admission:
    """The waiting side of the scheduler: grants, releases, and the pump that serves waiters."""

    def __init__(
        self,
        max_waiting: int,
        max_waiting_bytes: int = 256 * 1024 * 1024,
        fair: bool = True,
        standby: int = 0,
        anticipate_s: float = 0.0,
    ) -> None:
        self.max_waiting = max_waiting
        self.max_waiting_bytes = max_waiting_bytes
        """Bound on the request bytes all waiting requests hold in memory together (every pool)."""
        self.waiting_bytes = 0
        self.fair = fair
        """Fair queueing between tenants (edge.queue.fair_queueing); off: arrival order."""
        self.standby = standby
        """Requests per provider that wait in the broker while all its slots are busy (edge.queue.standby,
        iop/edge/standby.py); 0: every request is bound when a slot frees."""
        self.anticipate_s = anticipate_s
        """How long a slot is kept for a tenant that asks again at once (edge.queue.anticipate_ms,
        iop/edge/anticipate.py); 0: never."""
        self.providers: dict[str, ProviderSlots] = {}
        self.pools: dict[str, PoolQueue] = {}
        self._order = itertools.count()
        self._deadlines = Deadlines()
        """One loop timer for every waiter's deadline (iop/edge/deadlines.py)."""
        self._queued = 0
        """Waiters in every queue (`_deadlines` is emptied when none is left)."""
        self.queued_high = HighWater()  # the most waiters at once since the burst trim looked (iop/edge/memory.py)
        self._connected = asyncio.Event()
        self.changed = asyncio.Event()
        """Set whenever a request starts or stops waiting (observers clear it, then wait)."""
        self.sessions = Sessions()
        """Prefix-cache affinity: the provider each session used last (the dispatch reads and feeds it)."""
        self.on_count: Callable[[ProviderSlots], None] | None = None
        """Called when a provider's `in_flight` or `kept` changed (iop/edge/share.py tells the other edges)."""
        self.router = Router()
        """Which free provider a request gets (iop/edge/routing.py), and what it knows of each one's speed."""
        self.router.wake = self.serve
        self.owed: Callable[[PoolQueue], bool] | None = None
        """Whether a pool's free slots wait for another edge's waiter (iop/edge/fairshare.py)."""
        self.waiting_elsewhere: Callable[[PoolQueue], list[Elsewhere]] | None = None
        """The tenants other edges announce waiting in a pool (iop/edge/fairshare.py): a kept slot
        (iop/edge/anticipate.py) is weighed against them too."""
        self.on_queue: Callable[[PoolQueue], None] | None = None
        """Called when a tenant's waiting or running count on a pool changed (iop/edge/share.py tells)."""
        self.leases: TenantLeases | None = None
        """Tenants' max_concurrent shared with the other edges (iop/edge/leases.py): a limited tenant's
        bound in the fair queue is the units this edge holds; None: the policy's bound, per edge."""

    def acquire_grant(
        self,
        alias: str,
        deadline: float,
        exclude: frozenset[str] = frozenset(),
        size: int = 0,
        *,
        prefer: str | None = None,
        prefer_wait_s: float = 0.0,
        tenant: str = "",
        priority: Priority = "standard",
        weight: float = 1.0,
        max_concurrent: int | None = None,
        ask: Ask | None = None,
    ) -> Coroutine[Any, Any, Grant]:
        """A slot of a provider of `alias` (none of `exclude`), counted for its tenant until
        `release(grant.slot, grant)`; `deadline` is on the loop's clock.

        `prefer` (prefix-cache affinity) is taken whenever it has a free slot at this request's turn;
        with `prefer_wait_s` the request waits up to that long for it while others are free.

        `tenant`, `priority`, `weight`: its place in the pool's fair order (iop/edge/fairqueue.py);
        `max_concurrent`: the tenant's bound on this pool's slots (its share, what /status shows
        running). `ask`: its size and deadline, for the router (iop/edge/routing.py).

        `size`: the bytes it holds while it waits (its body). QueueFull past `max_waiting` or
        `max_waiting_bytes`; Unavailable when no provider can take it or the deadline passes.
        """
        who = (tenant, priority, weight, max_concurrent)
        # The wait itself, not a coroutine around it: one frame fewer per waiting request.
        return self._acquire(self.pools[alias], deadline, exclude, size, prefer, prefer_wait_s, who, True, ask)

    async def acquire_pinned(self, provider: str, deadline: float) -> ProviderSlots:
        """A slot of `provider` itself, whatever pool it is in (qualification; admin only)."""
        slot = self.providers.get(provider)
        if slot is None:
            raise Unavailable(f"provider '{provider}' has no capacity here", code="no_provider")
        pinned = next((q for q in slot.pools if isinstance(q, PinnedQueue)), None)
        if pinned is None:
            pinned = PinnedQueue(f"pinned:{provider}", [slot])
            slot.pools.append(pinned)
        return (await self._acquire(pinned, deadline, frozenset(), 0, None, 0.0, NOBODY, False)).slot

    async def _acquire(
        self,
        pool: PoolQueue,
        deadline: float,
        exclude: frozenset[str],
        size: int,
        prefer: str | None,
        prefer_wait_s: float,
        who: Who,
        tracked: bool,
        ask: Ask | None = None,
    ) -> Grant:
        alias = pool.alias
        if self.leases is not None and tracked and who[3] is not None:
            who = (*who[:3], self.leases.bound(alias, who[0], who[3]))
        hold = prefer_wait_s > 0 and self._holdable(pool, prefer, exclude)
        queue = pool.waiters
        known = queue.tenants.get(who[0])
        may_run = known.eligible if known is not None else who[3] is None or who[3] > 0
        if tracked and pool.returns and (kept := self._kept(pool, who, exclude, may_run, ask)) is not None:
            return kept
        # Anyone who may take a slot before it waits already: a free slot is theirs, not this one's.
        if not queue.eligible_waiting and (not tracked or may_run):
            slot = self._choice(pool, exclude, prefer, hold, ask)
            if slot is not None:
                pool.waits_s.append(0.0)
                # A tenant with nothing here and nothing to give back later needs no entry.
                t = queue.tenant(*who) if tracked or known is not None else None
                return self._grant(slot, pool, t, tracked)
        if not _seen(pool):
            await self._await_connected(pool, deadline)
            return await self._acquire(pool, deadline, exclude, size, prefer, prefer_wait_s, who, tracked, ask)
        # A pinned request waits for its provider whatever its breaker says: it measures it.
        retry_s = None if isinstance(pool, PinnedQueue) else self.retry_after(pool, exclude)
        if retry_s is not None:
            raise _pool_unavailable(alias, retry_s)
        if (ahead := len(pool.waiters) + pool.standing) >= self.max_waiting:
            raise QueueFull(
                f"model '{alias}': {ahead} requests already wait for a free slot; retry later",
                headers={"Retry-After": "1"},
            )
        if self.waiting_bytes + size > self.max_waiting_bytes:
            # Each waiting request keeps its whole body here: bound the sum, not only the count.
            mib = self.max_waiting_bytes / (1024 * 1024)
            raise QueueFull(
                f"model '{alias}': waiting requests already hold {self.waiting_bytes / (1024 * 1024):.1f} MiB "
                f"of the edge's {mib:g} MiB for waiting requests (edge.queue.max_waiting_mb); retry later",
                headers={"Retry-After": "1"},
            )
        loop = asyncio.get_running_loop()
        waiter = Waiter(loop.create_future(), next(self._order), exclude, size, prefer, hold)
        waiter.tracked, waiter.ask = tracked, ask
        queued_at = loop.time()
        pool.waiters.add(waiter, t := queue.tenant(*who))  # after the last await: the entry is current
        self._tenant_changed(pool, t)
        self.waiting_bytes += size
        self._queued += 1
        self.queued_high.saw(self._queued)
        self.changed.set()
        hold_over = loop.call_later(prefer_wait_s, self._hold_over, pool, waiter) if hold else None
        # The first in the order may hold out for its preferred provider, not take one it failed on,
        # or be at its max_concurrent while another is free: one behind may take that slot now.
        if pool.best() is not None or standby_.room(pool, self.standby):
            self._pump([pool])
        self._deadlines.watch(loop, deadline, waiter.order, waiter.future)
        try:
            grant: Grant = await waiter.future
        except BaseException as exc:
            future = waiter.future
            if future.done() and not future.cancelled() and future.exception() is None:
                # Granted in the same instant as the client leaving: give it back.
                granted: Grant = future.result()
                self.trial_over(granted.slot)
                self.release(granted.slot, granted)
            else:
                future.cancel()
                # Expired, cancelled, or failed by the pool: still in the queue only if nobody took it out
                # (_pump clears finished waiters, a refusal removes its own).
                if waiter.queued:
                    pool.waiters.remove(waiter)
                    self._left(waiter)
                    self._tenant_changed(pool, waiter.tenant)
                    self.changed.set()
            if isinstance(exc, TimeoutError):
                raise Unavailable(
                    f"model '{alias}': no slot became free within the queue timeout", code="queue_timeout"
                ) from None
            raise
        finally:
            if hold_over is not None:
                hold_over.cancel()
        if grant.standing:
            grant.asked = queued_at  # its wait ends when its node starts it (`started`)
        else:
            pool.waits_s.append(loop.time() - queued_at)
        return grant

    def _kept(self, pool: PoolQueue, who: Who, exclude: frozenset[str], may_run: bool, ask: Ask | None) -> Grant | None:
        """The slot kept for this request's tenant, if the pool kept one (iop/edge/anticipate.py)."""
        anticipate.asked(pool, who[0], self.anticipate_s)
        slot = anticipate.take(pool, who[0]) if pool.kept else None
        if slot is None:
            return None
        if not may_run or slot.id in exclude or not slot.usable(monotonic()):
            self._counted(slot)
            self._pump(slot.pools)  # it may not take it: the next waiter may
            return None
        if ask is not None:
            ask.reason = "kept"
        pool.waits_s.append(0.0)
        t = pool.waiters.tenant(*who)
        pool.waiters.lift(t)
        return self._grant(slot, pool, t, True)

    def _lapsed(self, pool: PoolQueue, tenant: str) -> None:
        slot = anticipate.lapsed(pool, tenant)
        if slot is not None:
            self._counted(slot)
            self._pump(slot.pools)

    def _counted(self, slot: ProviderSlots) -> None:
        """A provider's `in_flight` or `kept` changed: the other edges hear of it (iop/edge/share.py)."""
        if self.on_count is not None:
            self.on_count(slot)

    def started(self, grant: Grant) -> None:
        """The node began a request granted in standby: it runs now, and held its slot from here."""
        if grant.standing:
            standby_.stood(grant)
            grant.pool.waits_s.append(asyncio.get_running_loop().time() - grant.asked)
            grant.at = monotonic()
            self.changed.set()

    def _grant(self, slot: ProviderSlots, pool: PoolQueue, tenant: TenantQueue | None, tracked: bool) -> Grant:
        self._take(slot, pool)
        if tenant is None:
            return Grant(slot, pool)
        charge = pool.waiters.start(tenant, tracked)
        pool.waiters.granted_class(tenant.rank)
        self._tenant_changed(pool, tenant)
        return Grant(slot, pool, tenant if tracked else None, charge)

    def _tenant_changed(self, pool: PoolQueue, t: TenantQueue | None) -> None:
        """A tenant's running or waiting count on `pool` changed: its lease follows (iop/edge/leases.py)."""
        if self.on_queue is not None:
            self.on_queue(pool)
        if self.leases is None or t is None or t.max_concurrent is None:
            return
        bound = self.leases.changed(pool.alias, t.name, t.running, len(t.waiters))
        if bound is not None and bound != t.max_concurrent and pool.waiters.tenants.get(t.name) is t:
            pool.waiters.tenant(t.name, PRIORITIES[t.rank], t.weight, bound)

    def lease_bound(self, alias: str, tenant: str, bound: int) -> None:
        """The units this edge holds of `tenant`'s bound on `alias` changed (another edge's want, a grant)."""
        pool = self.pools.get(alias)
        t = pool.waiters.tenants.get(tenant) if pool is not None else None
        if pool is None or t is None or t.max_concurrent == bound:
            return
        pool.waiters.tenant(t.name, PRIORITIES[t.rank], t.weight, bound)
        self._pump([pool])

    def _holdable(self, pool: PoolQueue, prefer: str | None, exclude: frozenset[str]) -> bool:
        """Whether `prefer` is a provider of the pool worth waiting for: in rotation and connected."""
        p = self.providers.get(prefer) if prefer is not None else None
        return (
            p is not None
            and pool in p.pools
            and p.id not in exclude
            and p.connected
            and not p.removed
            and not p.drained
            and not p.open_until
        )

    def _choice(
        self, pool: PoolQueue, exclude: frozenset[str], prefer: str | None, hold: bool, ask: Ask | None = None
    ) -> ProviderSlots | None:
        """The slot a request gets now: its preferred provider when free, else the router's pick (None
        while it holds out for its preferred provider, or no free provider can meet its deadline)."""
        if prefer is not None:
            p = self.providers.get(prefer)
            if p is not None and pool in p.pools and p.id not in exclude and p.usable(monotonic()):
                if ask is not None:
                    ask.reason = "affinity"
                return p
            if hold and self._holdable(pool, prefer, exclude):
                return None
        return pool.routed(self.router, exclude, ask)

    def _hold_over(self, pool: PoolQueue, waiter: Waiter) -> None:
        """A waiter's `affinity_wait_ms` is over: from now on any provider of its pool will do."""
        waiter.holding = False
        self._pump([pool])

    def _pump(self, pools: list[PoolQueue]) -> None:
        """Hand free slots to the waiters of the given pools whose turn it is (iop/edge/fairqueue.py);
        between pools that share a provider, the oldest of their first waiters goes first. With no
        free slot left, the next waiters go to standby in the broker (iop/edge/standby.py)."""
        while True:
            chosen = self._next(pools, False)
            standby = chosen is None and self.standby > 0
            if standby:
                chosen = self._next(pools, True)
            if chosen is None:
                return
            pool, waiter, slot = chosen
            pool.waiters.remove(waiter, granted=True)
            self._left(waiter)
            assert waiter.tenant is not None
            grant = self._grant(slot, pool, waiter.tenant, waiter.tracked)
            if standby:
                standby_.stand(grant)
            waiter.future.set_result(grant)
            self.changed.set()

    def _next(self, pools: list[PoolQueue], standby: bool) -> tuple[PoolQueue, Waiter, ProviderSlots] | None:
        """The waiter whose turn it is and its slot: a free one, or (`standby`) a place in the broker."""
        chosen: tuple[PoolQueue, Waiter, ProviderSlots] | None = None
        choose = self._choose_standby if standby else self._choose
        for pool in pools:
            if not pool.waiters or not (standby_.room(pool, self.standby) if standby else pool.best() is not None):
                continue  # nobody waits, or nothing is free for anyone of this pool
            if self.owed is not None and self.owed(pool):
                continue  # a tenant waiting on another edge is ahead: that edge takes the slot
            found = pool.waiters.candidate(choose, self._gone, (pool, Scan()))
            if found is not None and (chosen is None or found[0].turn < chosen[1].turn):
                chosen = (pool, *found)
        return chosen

    def _choose_standby(self, ctx: tuple[PoolQueue, Scan], w: Waiter) -> ProviderSlots | None:
        return standby_.place(self.router, self.providers, ctx[0], w, self.standby)

    def serve(self, alias: str) -> None:
        """Hand the free slots of pool `alias` to its waiters (something another edge said changed,
        or a routing hold ended)."""
        pool = self.pools.get(alias)
        if pool is not None:
            self._pump([pool])

    def _choose(self, ctx: tuple[PoolQueue, Scan], w: Waiter) -> ProviderSlots | None:
        pool, scan = ctx
        return self._choice(pool, w.exclude, w.prefer, w.holding, scan.asking(w.ask))

    def _gone(self, ctx: tuple[PoolQueue, Scan], waiter: Waiter) -> None:
        """A waiter the pump found cancelled (its own handler has not run yet): out of the count."""
        pool = ctx[0]
        self._left(waiter)
        self._tenant_changed(pool, waiter.tenant)
        self.changed.set()  # one fewer waits: observers (the burst trim) count again

    def _left(self, waiter: Waiter) -> None:
        """A waiter left the queue (granted, refused, gone): its bytes no longer count."""
        if waiter.queued:
            self._queued -= 1
            if not self._queued:
                self._deadlines.clear()
        self.waiting_bytes -= waiter.size
        waiter.size = 0
        waiter.queued = False

    def _take(self, slot: ProviderSlots, pool: PoolQueue) -> None:
        slot.in_flight += 1
        slot.rerank()
        self._counted(slot)
        slot.dispatched += 1
        # A pinned request (qualification) says nothing to the breaker, so it is never its trial.
        if slot.open_until and not isinstance(pool, PinnedQueue):
            slot.trial = True

    async def _await_connected(self, pool: PoolQueue, deadline: float) -> None:
        loop = asyncio.get_running_loop()
        until = min(deadline, loop.time() + CONNECT_GRACE_S)
        while not pool.connected:
            self._connected.clear()
            try:
                async with asyncio.timeout_at(until):
                    await self._connected.wait()
            except TimeoutError:
                raise Unavailable(
                    f"model '{pool.alias}': no provider of its pool is connected", code="no_provider"
                ) from None

    def release(self, slot: ProviderSlots, grant: Grant | None = None) -> None:
        """A request's slot is free again; with its `grant`, so is its tenant's share."""
        ran = grant is None or not grant.standing
        if grant is not None and grant.standing:
            standby_.stood(grant)  # ended in the broker, never started (client gone, deadline, node lost)
            self.changed.set()
        slot.in_flight -= 1
        slot.rerank()
        self._counted(slot)
        if slot.removed and slot.in_flight == 0 and self.providers.get(slot.id) is slot:
            del self.providers[slot.id]
            self.changed.set()
        if grant is not None and grant.tenant is not None:
            t = grant.tenant
            standby_.active(grant.pool, t.name)
            grant.pool.waiters.end(t, monotonic() - grant.at, grant.charge)
            self._tenant_changed(grant.pool, t)
            grant.tenant = None  # given back once, whoever calls again
            kept = self.anticipate_s and ran
            if kept and anticipate.ended(grant.pool, t, slot, self.anticipate_s, self._lapsed, self.waiting_elsewhere):
                self._tenant_changed(grant.pool, None)  # the other edges hear it is active
        self._pump(slot.pools)

    def trial_over(self, slot: ProviderSlots) -> None:
        """A request that held `slot` ended saying nothing of the provider's health (the client left,
        the request itself was refused): a half-open trial it carried is over, the next one may go."""
        if slot.trial:
            slot.trial = False
            self._pump(slot.pools)

    def retry_after(self, pool: PoolQueue, exclude: frozenset[str] = frozenset()) -> float | None:
        """None while a provider of the pool can take work now or once a running request ends;
        otherwise the seconds until one may (its breaker's next half-open try, or GONE_RETRY_AFTER_S
        when its node is gone). A half-open provider counts as usable: its trial decides."""
        now = monotonic()
        wait: float | None = None
        for p in pool.providers:
            if p.id in exclude or p.removed:
                continue
            if not p.connected:
                w = float(GONE_RETRY_AFTER_S)
            elif p.open_until and now < p.open_until:
                w = p.open_until - now
            else:
                return None
            wait = w if wait is None else min(wait, w)
        return GONE_RETRY_AFTER_S if wait is None else wait

    def _fail_if_unusable(self, pools: list[PoolQueue]) -> None:
        """Tell the waiters of a pool that just lost its last usable provider, instead of letting
        them wait out the queue timeout for a slot that cannot come."""
        for pool in pools:
            if isinstance(pool, PinnedQueue):
                continue  # its provider's breaker does not stop a qualification
            if not _seen(pool):
                continue  # none connected yet (edge start, a refresh's new providers): they wait a grace
            for waiter in list(pool.waiters):
                if waiter.future.done():
                    continue
                retry_s = self.retry_after(pool, waiter.exclude)
                if retry_s is not None:
                    pool.waiters.remove(waiter)
                    self._left(waiter)
                    self._tenant_changed(pool, waiter.tenant)
                    waiter.future.set_exception(_pool_unavailable(pool.alias, retry_s))
                    self.changed.set()

    def waiting(self, alias: str) -> int:
        """Requests of the pool not yet started: in its queue, or in standby in the broker."""
        pool = self.pools[alias]
        return len(pool.waiters) + pool.standing


def _seen(pool: PoolQueue) -> bool:
    """Whether a provider of the pool ever connected (a loop, not any(): no generator per request)."""
    for p in pool.providers:  # noqa: SIM110
        if p.seen:
            return True
    return False


def _pool_unavailable(alias: str, retry_s: float) -> Unavailable:
    return Unavailable(
        f"model '{alias}': no provider of its pool can take requests now (every one is out of rotation "
        f"after failures, or its node is gone); retry in {math.ceil(retry_s)} s",
        code="pool_unavailable",
        headers={"Retry-After": str(max(1, math.ceil(retry_s)))},
    )
