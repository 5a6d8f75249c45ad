"""One pool's waiting requests, in the order a freed slot goes to them: fair between tenants.

Each tenant has its own FIFO. A freed slot goes to the tenant of the highest priority class
(interactive, then standard, then batch) that has received the least service here lately, and
within it to its oldest request. Service is counted in slot-seconds divided by the tenant's
weight: a grant charges the pool's recent mean hold at once (so a tenant that just took a slot
is behind the others for the next one), and its release corrects that by what it really held.

A tenant that starts waiting is lifted to the pool's virtual time: the service the tenant granted
last had before that grant (start-time fair queueing's rule). Every tenant that waits already was
charged at least that much, so the newcomer takes the next free slot, not one after the backlog;
and time spent idle earns no credit, so it gets one slot, then its share. A tenant with nothing
waiting or running is forgotten.

Priority is strict with one bound: a class with waiting requests that saw `STARVE_AFTER` grants in
a row go to higher classes gets the next one, so batch work still moves under a constant
interactive load (at least one slot in `STARVE_AFTER + 1`).

A tenant at its `max_concurrent` (its requests holding slots of this pool) is out of the order
until one of them ends; its requests keep their place in its FIFO and count against the queue's
bounds like any other. With one tenant (or fair queueing off) the order is arrival order.

Tenants sit in one heap per class, keyed by (service, oldest request): a grant is O(log n) in
the tenants that wait. An entry whose tenant changed since is skipped when it surfaces.
"""

from __future__ import annotations

import asyncio
import heapq
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from iop.edge.routing import Ask

Who = tuple[str, str, float, int | None]
"""A request's tenant and its policy: name, priority, weight, max_concurrent on the pool."""
NOBODY: Who = ("", "standard", 1.0, None)

S = TypeVar("S")
"""What a waiter may take (a provider's slots): this module sits below iop/edge/slots.py."""
C = TypeVar("C")
"""What `candidate` hands its callbacks beside the waiter (the pool): no closure made per call."""

PRIORITIES = ("interactive", "standard", "batch")
"""The classes, first served first."""
STARVE_AFTER = 8
"""Grants in a row that may pass a waiting lower class before it gets one."""
HOLD_ALPHA = 0.1
"""Weight of a release's slot-seconds in the pool's mean hold (the charge a grant makes at once)."""
FIRST_HOLD_S = 1.0
"""The charge before the pool's first release measured one."""


@dataclass(eq=False, slots=True)
class Waiter:
    future: asyncio.Future[Any]
    """Resolves to its `slots.Grant` (typed there: this module sits below the slots)."""
    order: int
    exclude: frozenset[str]
    size: int = 0
    """Bytes of the request body it holds while it waits (counted in Scheduler.waiting_bytes)."""
    prefer: str | None = None
    """The provider its session used last (prefix-cache affinity): taken whenever it is free."""
    holding: bool = False
    """Waits for `prefer` even while another provider is free, until its `affinity_wait_ms` is over."""
    queued: bool = True
    """Still in its pool's queue (Scheduler._left takes it out of the count when it leaves)."""
    tenant: TenantQueue | None = None
    tracked: bool = False
    """Its grant's release will say so (Scheduler.acquire_grant, not a pinned one): it counts toward max_concurrent."""

    @property
    def turn(self) -> tuple[int, int]:
        """Between pools sharing a provider: the higher class first, then the older."""
        return (self.tenant.rank if self.tenant is not None else 1, self.order)

    ask: Ask | None = None
    """Its size and deadline for the router (iop/edge/routing.py): it may pass over a free slot (too
    slow for its deadline, or a busy provider is worth waiting for), so the waiters behind it are asked too."""


@dataclass(eq=False, slots=True)
class TenantQueue:
    """One tenant's requests in one pool: those waiting (oldest first) and the count holding slots."""

    name: str
    rank: int = 1
    """Its class: an index of PRIORITIES."""
    weight: float = 1.0
    max_concurrent: int | None = None
    waiters: deque[Waiter] = field(default_factory=deque)
    running: int = 0
    """Its requests holding a slot granted from this pool (this edge's)."""
    standing: int = 0
    """Of those, the ones in standby: waiting in the broker, not yet started (iop/edge/standby.py)."""
    served: float = 0.0
    """Slot-seconds received, divided by weight (see the module's docstring)."""
    charged: float = 0.0
    """What its running requests were charged at their grant (their releases correct it)."""
    seq: int = -1
    """Its valid heap entry's sequence number; -1: not in the heap."""
    key: tuple[float, int] = (0.0, 0)
    """Its valid entry's (service, oldest waiter): at most its current key (see `FairQueue._push`)."""

    @property
    def eligible(self) -> bool:
        return self.max_concurrent is None or self.running < self.max_concurrent


_CLASS_ORDER = tuple(range(len(PRIORITIES)))
_FIFO_ORDER = (1,)
"""Fair queueing off: every tenant in one heap, keyed by its oldest request alone."""

_Entry = tuple[float, int, int, TenantQueue]
"""(served, oldest waiter's order, sequence, tenant) in one class's heap."""


class FairQueue:
    """The waiters of one pool: `len()` of them all, `candidate()` for the next slot."""

    def __init__(self) -> None:
        self.tenants: dict[str, TenantQueue] = {}
        self.fair = True
        """Off: one class, no service counts, every tenant in arrival order (max_concurrent still holds)."""
        self.hold_s = FIRST_HOLD_S
        """Mean slot-seconds of this pool's recent grants."""
        self._heaps: list[list[_Entry]] = [[] for _ in PRIORITIES]
        self._seq = 0
        self._count = 0
        self._eligible = 0
        """Waiters whose tenant is under its max_concurrent: while any, a new request queues behind."""
        self._passed = [0] * len(PRIORITIES)
        """Per class: grants in a row to higher classes while it had waiters."""
        self._starving = False
        """Some class reached STARVE_AFTER (its turn comes before the others')."""
        self._vclock = 0.0
        """The service the tenant granted last had before that grant: where a tenant that starts waiting is lifted."""

    def __len__(self) -> int:
        return self._count

    def __bool__(self) -> bool:
        return self._count > 0

    def __iter__(self) -> Iterator[Waiter]:
        """Every waiter, tenant by tenant (no particular order)."""
        for t in list(self.tenants.values()):
            yield from list(t.waiters)

    @property
    def eligible_waiting(self) -> int:
        return self._eligible

    def loads(self) -> list[tuple[str, str, int, int]]:
        """(tenant, priority, waiting, running) of every tenant with requests here, most waiting first
        (a standby waits until its node starts it)."""
        rows = [
            (t.name, PRIORITIES[t.rank], len(t.waiters) + t.standing, t.running - t.standing)
            for t in self.tenants.values()
        ]
        rows.sort(key=lambda r: (-r[2], -r[3], r[0]))
        return rows

    def set_fair(self, fair: bool) -> None:
        """Fair queueing on or off (a refresh): every tenant placed again by the new order."""
        if fair == self.fair:
            return
        self.fair = fair
        for heap in self._heaps:
            heap.clear()
        for t in self.tenants.values():
            t.seq = -1
            self._push(t)

    def tenant(self, name: str, priority: str, weight: float, max_concurrent: int | None) -> TenantQueue:
        """The tenant's queue here, made on its first request; its policy as its latest request says."""
        t = self.tenants.get(name)
        rank = PRIORITIES.index(priority) if priority in PRIORITIES else 1
        if t is None:
            t = self.tenants[name] = TenantQueue(name, rank, weight, max_concurrent)
            return t
        if (t.rank, t.weight, t.max_concurrent) != (rank, weight, max_concurrent):
            was = t.eligible
            t.rank, t.weight, t.max_concurrent = rank, weight, max_concurrent
            self._eligibility(t, was)
            t.seq = -1  # perhaps another class's heap now
            self._push(t)
        return t

    def add(self, waiter: Waiter, t: TenantQueue) -> None:
        """`waiter` joins `t` (what `tenant()` returned in the same step: no await between)."""
        waiter.tenant = t
        if not t.waiters:
            self.lift(t)
        t.waiters.append(waiter)
        self._count += 1
        if t.eligible:
            self._eligible += 1
        if len(t.waiters) == 1:
            self._push(t)

    def remove(self, waiter: Waiter, granted: bool = False) -> None:
        """`waiter` leaves; `granted`: for a slot, `start` follows at once (the tenant stays known)."""
        t = waiter.tenant
        assert t is not None
        head = t.waiters[0] is waiter
        t.waiters.remove(waiter)
        self._count -= 1
        if t.eligible:
            self._eligible -= 1
        if head:
            self._push(t)
        if not granted:
            self._forget_idle(t)

    def start(self, t: TenantQueue, tracked: bool) -> float:
        """A slot granted to `t` (queued or at once): charge it; returns the charge. `tracked`: its
        release will say so (`end`), and it counts toward max_concurrent until then."""
        charge = 0.0
        if self.fair:
            self._vclock = t.served
            charge = self.hold_s / t.weight
            t.served += charge
        if tracked:
            was = t.eligible
            t.running += 1
            t.charged += charge
            self._eligibility(t, was)
        self._push(t)
        self._forget_idle(t)
        return charge

    def granted_class(self, rank: int) -> None:
        """A grant went to class `rank`: lower classes that wait have been passed once more."""
        passed = self._passed
        passed[rank] = 0
        if self._count:
            for r in range(rank + 1, len(PRIORITIES)):
                if self._class_waits(r):
                    passed[r] += 1
        self._starving = max(passed) >= STARVE_AFTER

    def end(self, t: TenantQueue, held_s: float, charge: float) -> None:
        """A grant of `t` (tracked) ended after `held_s`: correct its charge and free its share."""
        self.hold_s += HOLD_ALPHA * (held_s - self.hold_s)
        was = t.eligible
        t.running -= 1
        t.charged -= charge
        if self.fair:
            t.served += held_s / t.weight - charge
        self._eligibility(t, was)
        self._push(t)
        self._forget_idle(t)

    def leads(self, rank: int) -> bool:
        """Whether a tenant of class `rank` that starts waiting now would be the next slot's: no
        higher class waits and no lower one is owed its turn, and every tenant of its class that
        waits has received more service than the newcomer is placed at (the virtual time)."""
        if not self.fair or self._starving:
            return False
        for r in range(rank):
            if self._class_waits(r):
                return False
        heap = self._heaps[rank]
        while heap and not self._current(heap):
            pass
        return not heap or heap[0][0] > self._vclock

    def candidate(
        self, choose: Callable[[C, Waiter], S | None], gone: Callable[[C, Waiter], None], ctx: C
    ) -> tuple[Waiter, S] | None:
        """The waiter the next free slot goes to and that slot (`choose(ctx, waiter)` says which it
        may take), or None. Waiters found already done (cancelled) are taken out and handed to `gone`."""
        if not self._count:
            return None
        dead: list[Waiter] = []
        try:
            for rank in self._class_order():
                if not self._heaps[rank]:
                    continue
                found = self._scan(self._heaps[rank], choose, ctx, dead)
                if found is None or isinstance(found, tuple):
                    return found
            return None
        finally:
            for w in dead:
                if w.queued:
                    self.remove(w)
                    gone(ctx, w)

    def _scan(
        self, heap: list[_Entry], choose: Callable[[C, Waiter], S | None], ctx: C, dead: list[Waiter]
    ) -> tuple[Waiter, S] | bool | None:
        """One class in its order: the pick, None when nothing is free for anyone, False when this
        class has nobody who can take a free slot (the next class may)."""
        popped: list[_Entry] = []
        try:
            while heap:
                entry = heap[0]
                if not self._current(heap):
                    continue
                for w in entry[3].waiters:
                    if w.future.done():
                        dead.append(w)
                        continue
                    slot = choose(ctx, w)
                    if slot is not None:
                        return w, slot
                    if not w.exclude and not w.holding and (w.ask is None or not w.ask.passed):
                        return None  # nothing free for anyone: later waiters can't do better
                popped.append(heapq.heappop(heap))
            return False
        finally:
            for e in popped:
                heapq.heappush(heap, e)

    def _class_order(self) -> tuple[int, ...]:
        if not self.fair:
            return _FIFO_ORDER
        if not self._starving:
            return _CLASS_ORDER
        first = max(_CLASS_ORDER, key=lambda r: self._passed[r])
        return (first, *(r for r in _CLASS_ORDER if r != first))

    def _class_waits(self, rank: int) -> bool:
        heap = self._heaps[rank]
        while heap and not self._current(heap):
            pass
        return bool(heap)

    def _current(self, heap: list[_Entry]) -> bool:
        """Whether the heap's top entry stands for its tenant as it is now; if not, it is dropped
        (a stale entry) or replaced by the tenant's current key (it grew since: see `_push`)."""
        served, head, seq, t = heap[0]
        if seq != t.seq:
            heapq.heappop(heap)
            return False
        now = self._key(t)
        if now == (served, head):
            return True
        # A valid entry's tenant waits and may run (else `_push` had made it stale): put it where
        # its key says now, in one pass down the heap instead of a pop and a push.
        self._seq += 1
        t.seq, t.key = self._seq, now
        heapq.heapreplace(heap, (*now, t.seq, t))
        return False

    def _key(self, t: TenantQueue) -> tuple[float, int]:
        return (t.served if self.fair else 0.0, t.waiters[0].order)

    def _push(self, t: TenantQueue) -> None:
        """(Re)place `t` in its class's heap by its current key, or out of it when it cannot be served."""
        if not t.waiters or not t.eligible or self.tenants.get(t.name) is not t:
            t.seq = -1
            return
        key = self._key(t)
        if t.seq != -1 and key >= t.key:
            # Its entry's key grew (a charge, a newer oldest waiter): the entry stays, placed too
            # early, and is put right when it surfaces (`_current`). Only a smaller key moves it now.
            return
        self._seq += 1
        t.seq, t.key = self._seq, key
        heapq.heappush(self._heaps[t.rank if self.fair else 1], (*key, t.seq, t))

    def lift(self, t: TenantQueue) -> None:
        """`t` starts waiting, or takes a slot kept for it (iop/edge/anticipate.py): no credit for the
        time it did not wait."""
        if not self.fair:
            return
        t.served = max(t.served, self._vclock)

    def _eligibility(self, t: TenantQueue, was: bool) -> None:
        if t.eligible != was:
            self._eligible += len(t.waiters) if t.eligible else -len(t.waiters)

    def _forget_idle(self, t: TenantQueue) -> None:
        if not t.waiters and not t.running and self.tenants.get(t.name) is t:
            del self.tenants[t.name]
            t.seq = -1
