"""One request's tries: a slot, a channel to the node, failover, and what each try left in the record.

The endpoint drives the tries and reads top to bottom:

    async for attempt in dispatch:          # a slot of the best provider (or the next one)
        async with attempt:                 # ends the try, whatever happens inside
            await attempt.send(item)        # the work to the node
            ...relay attempt.replies() to the client...

A pool request's slot is owned here and nowhere else. It is given back exactly once, at the first
of: the node's end reaching the edge (the relay tells the attempt as the reply arrives, so a slow
client never holds a slot its node no longer uses, see `Attempt.node_ended`), or the end of the
`async with` (client gone, failure at the edge, node lost). Leaving the block also closes the
channel (the node told to stop if it still runs) and tells the provider's breaker. A retryable
failure before the client got any answer is swallowed there, and the loop's next attempt goes to
another provider; anything else leaves the loop.

`PoolDispatch(pin=provider)` is the same dispatch pinned to one provider (qualification): its
slot through the scheduler, no failover, no breaker. `DirectDispatch` is the same shape for a
direct route (a CLI resource: no slot, no failover).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from types import TracebackType
from typing import Any

from iop import tracing, wire
from iop.edge import spans
from iop.edge.affinity import Sessions
from iop.edge.channel import Channel
from iop.edge.observe import Trace
from iop.edge.relay import Relay
from iop.edge.routing import Ask, unmeetable
from iop.edge.scheduler import Scheduler
from iop.edge.slots import Grant, PinnedQueue, PoolQueue, ProviderSlots
from iop.edge.tenants import UNLIMITED, Tenant
from iop.errors import RequestError, Unavailable

log = logging.getLogger("iop.edge")

MAX_RETRIES = 2
"""Other providers a pool request may fail over to after its first one failed before answering."""


_NO_TENANT = Tenant("", UNLIMITED)


class Attempt:
    """One try of a request on one provider (or CLI resource), ended by leaving `async with`."""

    __slots__ = ("_ended", "_started", "channel", "dispatch", "grant", "pool", "provider", "scheduler", "slot", "span")

    def __init__(
        self,
        dispatch: _Dispatch,
        provider: str,
        slot: ProviderSlots | None = None,
        pool: PoolQueue | None = None,
        scheduler: Scheduler | None = None,
        grant: Grant | None = None,
        routed: dict[str, Any] | None = None,
    ) -> None:
        self.dispatch = dispatch
        self.scheduler = scheduler
        self.provider = provider
        """Who answers: the provider's id, or the CLI resource's name."""
        self.slot = slot
        self.grant = grant
        """The tenant's share the slot holds (None: pinned, or a direct route)."""
        self.pool = pool
        """The queue the slot was granted from: its running count is this try's while the node runs it."""
        self._started = False
        self._ended = False
        self.channel: Channel = dispatch.relay.open(slot.node if slot is not None else dispatch.node, holder=self)
        record = dispatch.record
        self.span = (
            spans.attempt(record, provider, self.channel.node, record.route, routed)
            if record.span is not None
            else None
        )
        """This try's span when the request is traced: its context travels with the work to the node."""

    # --- told by the channel, as the node's replies arrive --------------------------------------

    def node_started(self) -> None:
        """The node began running the item: it counts as running in its pool until it ends."""
        if self.pool is not None and not self._ended and not self._started:
            self._started = True
            self.pool.run_started()
            if self.grant is not None and self.scheduler is not None:
                self.scheduler.started(self.grant)  # a standby: waiting until now, running from here

    def node_ended(self) -> None:
        """The node is done with the item (or lost): the slot is free now, before the client read it all."""
        self._release()

    def _release(self) -> None:
        if self._ended:
            return
        self._ended = True
        if self.pool is not None and self._started:
            self.pool.run_ended()
        if self.slot is not None and self.scheduler is not None:
            self.scheduler.release(self.slot, self.grant)

    # --- driven by the endpoint -----------------------------------------------------------------

    async def send(self, item: wire.WorkItem) -> None:
        """Put the work where the node takes it: the provider's work queue, or the CLI resource."""
        publish = self.dispatch.relay.publish
        headers = tracing.headers_of(self.span) if self.span is not None else None
        if self.slot is None:
            await publish.to_resource(self.channel, self.dispatch.node, self.provider, item, headers)
        else:
            await publish.to_pool(self.channel, self.provider, item, headers)

    def replies(self) -> AsyncIterator[bytes]:
        """The answer's bytes in order; raises the RequestError the node or the edge failed it with."""
        return self.dispatch.relay.replies(self.channel, self.dispatch.start_deadline)

    async def __aenter__(self) -> Attempt:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        d = self.dispatch
        d.noted(self.channel)
        d.relay.close(self.channel)  # the node told to stop, if it may still run it
        self._release()
        retried = d.ended(self, exc)
        if self.span is not None:
            spans.attempt_ended(self.span, exc, retried)
        return retried


class _Dispatch:
    """What every route shares: the relay, the record the tries write to, and their clock."""

    def __init__(self, relay: Relay, alias: str, record: Trace, start_deadline: float | None) -> None:
        self.relay = relay
        self.alias = alias
        """The model the work item names (a pinned provider's first pool)."""
        self.record = record
        self.start_deadline = start_deadline
        """Loop clock: the latest the node may start the work (None: no bound, a direct route)."""
        self.node = ""
        self.arrived = time.monotonic()
        self.done = False

    def noted(self, ch: Channel) -> None:
        """The try's facts in the record: the last try is the one that counts."""
        r = self.record
        r.node, r.report = ch.node, ch.outcome
        r.queue_ms = round(max(0.0, (ch.started_mono - self.arrived) * 1000), 3) if ch.started_mono else None
        r.cold_start_ms = ch.cold_start_ms or None

    def ended(self, attempt: Attempt, exc: BaseException | None) -> bool:
        """The try is over; True when its failure is swallowed for another try."""
        self.done = True
        return False

    def __aiter__(self) -> _Dispatch:
        return self

    async def __anext__(self) -> Attempt:
        raise NotImplementedError


class PoolDispatch(_Dispatch):
    """A pool request's tries: acquire a slot, try, learn, fail over while the client has seen nothing.

    With `pin`, every try goes to that one provider (qualification): once, no breaker, no affinity.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        relay: Relay,
        alias: str,
        deadline: float,
        record: Trace,
        *,
        size: int = 0,
        sessions: Sessions | None = None,
        session: str | None = None,
        affinity_wait_s: float = 0.0,
        pin: str | None = None,
        tenant: Tenant | None = None,
        ask: Ask | None = None,
    ) -> None:
        super().__init__(relay, alias, record, deadline)
        record.route = "pool"
        self.scheduler = scheduler
        self.size = size
        """The request body's bytes: what it holds in the edge's memory while it waits."""
        self.deadline = deadline
        """Loop clock: the latest a slot may be granted or the node may start the work."""
        self.pin = pin
        self.sessions = sessions if session and pin is None else None
        self.session = session or ""
        """The request's session key (prefix-cache affinity); "" without one."""
        self.affinity_wait_s = affinity_wait_s
        self.tenant = tenant
        """Whose request this is: the scheduler's fair queueing reads its name, priority and weight."""
        self.ask = ask
        """The request's size and deadline for the router; its `reason` goes to the record."""
        self.prefer: str | None = None
        self.tried: frozenset[str] = frozenset()
        self.last: RequestError | None = None
        if self.sessions is not None:
            self.prefer = self.sessions.preferred(alias, self.session)

    async def __anext__(self) -> Attempt:
        if self.done:
            raise StopAsyncIteration
        sched = self.scheduler
        if self.pin is not None:
            slot = await sched.acquire_pinned(self.pin, self.deadline)
            pinned = next(q for q in slot.pools if isinstance(q, PinnedQueue))
            return self._attempt(slot, pinned)
        deadline, ask, pool = self.deadline, self.ask, sched.pools.get(self.alias)
        if ask is not None and ask.finish_by is not None and pool is not None:
            deadline = sched.router.bound(
                self.alias, pool.in_rotation(), ask, deadline, asyncio.get_running_loop().time()
            )
        traced = self.record.span is not None
        waited = spans.queue(self.record, pool, self.alias, len(self.tried)) if traced else None
        try:
            tenant = self.tenant or _NO_TENANT
            grant = await sched.acquire_grant(
                self.alias,
                deadline,
                self.tried,
                self.size,
                prefer=self.prefer,
                prefer_wait_s=self.affinity_wait_s,
                tenant=tenant.name,
                priority=tenant.priority,
                weight=tenant.weight,
                max_concurrent=tenant.policy.max_concurrent_on(self.alias),
                ask=self.ask,
            )
        except Unavailable as unusable:
            if waited is not None:
                spans.queue_ended(waited, unusable.code)
            if self.last is not None and unusable.code == "pool_unavailable":
                raise self.last from None  # no other provider to fail over to: the client hears why
            late = ask.late if ask is not None else None
            if unusable.code == "queue_timeout" and late is not None and time.monotonic() >= late - 0.01:
                raise unmeetable(self.alias, self.ask or Ask(), None) from None
            raise
        except BaseException as exc:
            if waited is not None:
                spans.queue_ended(waited, getattr(exc, "code", "cancelled"))
            raise
        if waited is not None:
            spans.queue_ended(waited, "granted")
        slot = grant.slot
        pool = sched.pools.get(self.alias)
        if pool is None:
            # A refresh removed the alias between the grant and now: give the slot back untouched.
            sched.trial_over(slot)
            sched.release(slot, grant)
            raise Unavailable(f"model '{self.alias}' was removed by a refresh", code="model_removed")
        if self.sessions is not None:
            self.record.affinity = self.sessions.served(self.alias, self.session, slot.id, self.prefer)
        if self.ask is not None:
            self.record.route_reason = self.ask.reason
        routed = (
            spans.route(pool, slot, self.prefer, self.tried, self.record.affinity, self.record.route_reason)
            if traced
            else None
        )
        self.prefer = None  # a failover goes wherever is free; the provider that answers is remembered
        return self._attempt(slot, pool, grant, routed)

    def _attempt(
        self,
        slot: ProviderSlots,
        pool: PoolQueue,
        grant: Grant | None = None,
        routed: dict[str, Any] | None = None,
    ) -> Attempt:
        # Nothing awaits between the grant and the attempt: its `async with` always ends the slot.
        self.record.attempts += 1
        self.record.provider = slot.id
        return Attempt(self, slot.id, slot, pool, self.scheduler, grant, routed)

    def ended(self, attempt: Attempt, exc: BaseException | None) -> bool:
        sched, slot = self.scheduler, attempt.slot
        assert slot is not None
        if self.pin is not None:
            self.done = True
            return False  # a measurement: it teaches the breaker nothing, and is never moved
        size = self.ask.input_tokens if self.ask is not None else 0
        held_s = time.monotonic() - attempt.grant.at if attempt.grant is not None else None
        if exc is None:
            sched.succeeded(slot)
            # A stream that failed after its 200 ended the try well for the breaker, not for the policy.
            ok = not self.record.error
            sched.router.ended(slot.id, self.alias, ok, attempt.channel.outcome, size, _load(slot), held_s)
            self.done = True
            return False
        if isinstance(exc, RequestError) and exc.status >= 500 and not self.record.cancelled:
            sched.router.ended(slot.id, self.alias, False, attempt.channel.outcome, size, _load(slot), held_s)
        if not isinstance(exc, RequestError) or not exc.retryable or exc.status < 500:
            # A 4xx is about the request (an upstream's 422 arrives as an UpstreamError with its
            # status): another provider would refuse it too, and it says nothing of this provider's
            # health. A client that left taught nothing about the provider either.
            sched.trial_over(slot)
            return False
        sched.failed(slot)
        self.tried |= {slot.id}
        self.last = exc
        pool = sched.pools.get(self.alias)  # a refresh may have removed it meanwhile
        others = [p for p in pool.providers if p.id not in self.tried] if pool is not None else []
        if self.record.status or len(self.tried) > MAX_RETRIES or not others:
            return False  # the client has its answer's start, or there is nobody left to ask
        log.warning("provider %s failed before answering (%s); retrying on another", slot.id, exc.code)
        return True


class DirectDispatch(_Dispatch):
    """A request on a direct route: one CLI resource, no queue, no slot, no failover."""

    def __init__(self, relay: Relay, alias: str, node: str, resource: str, record: Trace) -> None:
        super().__init__(relay, alias, record, None)
        self.node = node
        self.resource = resource
        record.route, record.node, record.provider = "direct", node, resource

    async def __anext__(self) -> Attempt:
        if self.done:
            raise StopAsyncIteration
        self.record.attempts = 1
        return Attempt(self, self.resource)


def _load(slot: ProviderSlots) -> int:
    """The concurrency a request that just ended ran at (its own slot is already given back; a
    standby waiting in the broker is not running)."""
    return min(slot.capacity, slot.in_flight + slot.elsewhere + 1)
