"""What the scheduler ranks: a provider's slots at this edge, and the queue of requests for one pool.

A provider's rank in its pools' indexes (free slots, or out of rotation) changes only through
`ProviderSlots.rerank()`, which the scheduler calls after every change of a field the rank
depends on (a dispatch, a release, a heartbeat's `elsewhere`, a breaker, a refresh, a drain).
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from time import monotonic

from iop.edge.fairqueue import FairQueue, TenantQueue, Waiter
from iop.edge.freeslots import FreeSlots
from iop.edge.routing import Ask, PoolRules, Router

__all__ = ["Grant", "Kept", "PinnedQueue", "PoolQueue", "ProviderSlots", "Waiter"]

WAIT_SAMPLES = 512
"""Queue waits kept per pool (the most recent admissions) for the p50/p95 that /status shows."""
_BROKEN = -1
"""Index rank of a provider whose breaker is open or half-open: whether it may take work depends on
the clock and its trial, so its pools check it on every dispatch instead of ranking it."""


@dataclass(eq=False)
class ProviderSlots:
    """This edge's view of one provider: capacity, requests it sent there, and its breaker."""

    id: str
    node: str
    capacity: int
    pools: list[PoolQueue] = field(default_factory=list)
    in_flight: int = 0
    elsewhere: int = 0
    """Slots other edges hold, from the node's last heartbeat (at most one interval old)."""
    kept: int = 0
    """Free slots kept a moment for the tenant whose request just left them (iop/edge/anticipate.py)."""
    connected: bool = False
    seen: bool = False
    """Connected at least once since this edge started (before that, requests wait a grace period)."""
    dispatched: int = 0
    """Requests ever dispatched to it (status, tests)."""
    failures: int = 0
    """Consecutive failures (reset by a success)."""
    open_until: float = 0.0
    """Monotonic time until which the breaker keeps it out of rotation."""
    trips: int = 0
    trial: bool = False
    """Half-open: one request is out to see whether it works again."""
    removed: bool = False
    """Taken out by a refresh: takes no new work, finishes what it runs, then disappears."""
    drained: bool = False
    """Out of its pools (pinned requests only): `drains` is not empty."""
    drains: dict[str, str] = field(default_factory=dict)
    """Who holds it out of its pools and why: an exclusive qualification (iop/edge/qualification.py),
    its lifecycle policy or an operator (iop/edge/lifecycle.py)."""

    def rerank(self) -> None:
        """Its place in its pools' indexes after a change of what ranks it: in_flight, elsewhere,
        capacity, connected, removed, drained or open_until (the scheduler calls it after each)."""
        rank = self.rank()
        for pool in self.pools:
            pool.ranked(self, rank)

    def drain(self, by: str, why: str | None) -> bool:
        """Held out of its pools by `by` for `why` (None: no longer); True when `drained` changed."""
        if why is None:
            self.drains.pop(by, None)
        else:
            self.drains[by] = why
        if self.drained == bool(self.drains):
            return False
        self.drained = bool(self.drains)
        self.rerank()
        return True

    def rank(self) -> int | None:
        """Its key in its pools' indexes: free slots; None when it can take nothing; _BROKEN."""
        if not self.connected or self.removed or self.drained:
            return None
        if self.open_until:
            return _BROKEN
        free = self.capacity - self.in_flight - self.elsewhere - self.kept
        return free if free > 0 else None

    def usable(self, now: float) -> bool:
        if not self.connected or self.removed or self.drained:
            return False
        if self.in_flight + self.elsewhere + self.kept >= self.capacity:
            return False
        if self.open_until:
            return now >= self.open_until and not self.trial
        return True

    @property
    def free(self) -> int:
        return self.capacity - self.in_flight - self.elsewhere - self.kept if self.connected else 0

    def standby_room(self, standby: int) -> bool:
        """Whether one more request may wait in the broker for it: every slot is busy and fewer than
        `standby` wait there already (iop/edge/admission.py's standby pass), breaker closed."""
        if not self.connected or self.removed or self.drained or self.open_until or self.capacity <= 0:
            return False
        return self.capacity <= self.in_flight + self.elsewhere < self.capacity + standby

    def breaker(self, now: float) -> str:
        if not self.open_until:
            return "closed"
        return "open" if now < self.open_until else "half_open"


@dataclass(eq=False, slots=True)
class Grant:
    """A slot granted to one request: released with it, so its tenant's share is given back."""

    slot: ProviderSlots
    pool: PoolQueue
    tenant: TenantQueue | None = None
    """Set when the release will say so (the tenant's running count and its charge correct then)."""
    charge: float = 0.0
    at: float = field(default_factory=monotonic)
    """When it began to hold the slot: the grant, or for a standby the node's start."""
    standby: bool = False
    """Granted while every slot of the provider was busy: the work waits in the broker for the next."""
    standing: bool = False
    """A standby not yet started by its node: shown as waiting (`Admission.waiting`), not running."""
    asked: float = 0.0
    """Loop time its request began to wait (a standby's queue wait ends when its node starts it)."""


@dataclass(eq=False, slots=True)
class Kept:
    """A slot of `slot` kept free for one tenant until `timer` fires (iop/edge/anticipate.py)."""

    slot: ProviderSlots
    timer: asyncio.TimerHandle
    rank: int = 1
    weight: float = 1.0
    """The tenant's class and weight (the other edges hear of it as active meanwhile)."""


@dataclass(eq=False)
class PoolQueue:
    """The requests waiting for one alias, in the order they get a slot (iop/edge/fairqueue.py)."""

    alias: str
    providers: list[ProviderSlots]
    waiters: FairQueue = field(default_factory=FairQueue)
    running: int = 0
    """Requests of this pool that a node has started and not yet finished (this edge's)."""
    standing: int = 0
    """Its requests granted in standby that wait in the broker for their provider's next free slot."""
    ended: tuple[str, float, str, float] = ("", -1e9, "", -1e9)
    """The tenants last seen active (a request ended here, another edge announced it), with when
    (monotonic): the latest, and the latest other than it (iop/edge/standby.py `shared`)."""
    kept: dict[str, Kept] = field(default_factory=dict)
    """Tenant: the slot kept for its next request (iop/edge/anticipate.py)."""
    returns: dict[str, tuple[float, float]] = field(default_factory=dict)
    """Tenant: since when it has had nothing here (-1: it has), and the share of its recent requests
    that came back within `edge.queue.anticipate_ms`, -1 before the first (iop/edge/anticipate.py)."""
    returns_forgot: bool = False
    """`returns` has forgotten a tenant (it holds at most iop/edge/anticipate.py's `TENANTS`): a
    tenant with no return there may be one that did not come back in time."""
    kept_outcomes: dict[str, int] = field(default_factory=dict)
    """Kept slots by what became of them: `taken` by their tenant, `lapsed` to the next waiter."""
    peak_running: int = 0
    waits_s: deque[float] = field(default_factory=lambda: deque(maxlen=WAIT_SAMPLES))
    """How long recent admissions waited in this queue (0 for a slot taken at once)."""
    ranking: FreeSlots[ProviderSlots] = field(default_factory=FreeSlots, repr=False)
    """Its usable providers with a closed breaker, by free slots: `best()` reads it, never scans."""
    broken: dict[ProviderSlots, None] = field(default_factory=dict, repr=False)
    """Its providers whose breaker is open or half-open (usually none): checked on every `best()`."""
    rules: PoolRules = field(default_factory=PoolRules)
    """How the router picks among its free providers, and its requests' default deadline."""

    def __post_init__(self) -> None:
        self.rebuild()

    def rebuild(self) -> None:
        """Rank every member afresh (the pool was made or its members changed)."""
        self.ranking.clear()
        self.broken.clear()
        for p in self.providers:
            self.ranked(p, p.rank())

    def ranked(self, p: ProviderSlots, rank: int | None) -> None:
        """`p` has a new rank (`ProviderSlots.rerank`)."""
        if rank == _BROKEN:
            self.ranking.set(p, None)
            self.broken[p] = None
        else:
            self.broken.pop(p, None)
            self.ranking.set(p, rank)

    def run_started(self) -> None:
        self.running += 1
        if self.running > self.peak_running:
            self.peak_running = self.running

    def run_ended(self) -> None:
        self.running -= 1

    def routed(self, router: Router, exclude: frozenset[str], ask: Ask | None) -> ProviderSlots | None:
        """The free provider the router picks for `ask` (None: it holds out for a full one); the most
        free slots without one (a pinned request) or when the pool opted out (`routing: free_slots`)
        and the request has no deadline."""
        by_finish = self.rules.routing == "expected_finish"
        if ask is None or (not by_finish and ask.finish_by is None):
            slot = self.best(exclude)
            if ask is not None and slot is not None:
                ask.reason = "free_slots"
            return slot
        busy = self.full_providers(exclude) if by_finish else []
        return router.choose(self.alias, by_finish, self.free_providers(exclude), ask, busy)

    def free_providers(self, exclude: frozenset[str]) -> list[ProviderSlots]:
        """Its providers that can take a request now, none of `exclude` (the router scores them)."""
        now = monotonic()
        free = [p for p in self.ranking if p.id not in exclude]
        free.extend(p for p in self.broken if p.usable(now) and p.id not in exclude)
        return free

    def full_providers(self, exclude: frozenset[str]) -> list[ProviderSlots]:
        """Its providers in rotation with a closed breaker and no free slot now, none of `exclude`."""
        return [
            p
            for p in self.providers
            if p.connected and not p.removed and not p.drained and not p.open_until and p.free <= 0
            if p.id not in exclude
        ]

    def in_rotation(self) -> list[ProviderSlots]:
        """Its providers that may take work once free: connected, neither removed nor drained."""
        return [p for p in self.providers if p.connected and not p.removed and not p.drained]

    def best(self, exclude: frozenset[str] = frozenset()) -> ProviderSlots | None:
        """The usable provider with the most free slots; ties take turns so load spreads evenly.

        O(log k) in the index (k distinct free-slot counts), plus one check per provider whose
        breaker is open: the pool's size does not enter."""
        best = self.ranking.first(exclude)
        if self.broken:
            now = monotonic()
            for p in self.broken:
                if p.usable(now) and p.id not in exclude and (best is None or p.free > best.free):
                    best = p
        return best

    @property
    def connected(self) -> bool:
        return any(p.connected for p in self.providers)


@dataclass(eq=False)
class PinnedQueue(PoolQueue):
    """Requests pinned to one provider by a qualification: no pool, the breaker and a drain ignored.

    It sits in the provider's `pools` so that a freed slot reaches its waiters in arrival order
    with everyone else's; the slot is taken and released like any pool request's.
    """

    def rebuild(self) -> None:
        pass  # one provider, checked directly: no index

    def ranked(self, p: ProviderSlots, rank: int | None) -> None:
        pass

    def best(self, exclude: frozenset[str] = frozenset()) -> ProviderSlots | None:
        p = self.providers[0]
        if p.connected and not p.removed and p.in_flight + p.elsewhere + p.kept < p.capacity:
            return p
        return None
