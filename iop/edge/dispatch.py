"""One request's way through the edge: its slot, its channel to the node, failover, and its result.

A pool request's slot is owned here and nowhere else. `PoolDispatch.run()` acquires a slot from
the scheduler, opens the relay channel, publishes the work, counts the run while the node runs
it, releases the slot exactly once (when the node reports the end, or when the attempt is over,
whichever comes first), records success or failure in the provider's breaker, and fails over to
another provider while the client has seen nothing. `DirectDispatch` is the same shape for a
direct route (a CLI resource: no slot, no failover).

Both hand one `DispatchResult` to `on_finished` when the request is over, whatever way it ended:
that is the one place per request to account for it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal

from iop import wire
from iop.edge.affinity import Sessions
from iop.edge.relay import Channel, Relay
from iop.edge.scheduler import PoolQueue, ProviderSlots, Scheduler
from iop.errors import RequestError, Unavailable

log = logging.getLogger("iop.edge")

MAX_RETRIES = 2
"""Other providers a pool request may fail over to after its first one failed before answering."""

Answer = Callable[[Channel, str], Awaitable[RequestError | None]]
"""Relays the channel's answer to the client (`provider` names who answers); returns the error the
answer ended with after the response had started (the client saw it in the stream), else None."""
MakeItem = Callable[[Channel], wire.WorkItem]
"""The work item for a channel (its id and reply subject come from the channel)."""


@dataclass(eq=False)
class DispatchResult:
    """What became of one request, handed to `on_finished` exactly once when it is over.

    Times are milliseconds from the request's arrival at the dispatch (body read, head parsed).
    """

    alias: str
    route: Literal["pool", "direct"]
    id: str = ""
    """The id of the last attempt's channel (the work item id the node saw)."""
    node: str = ""
    provider: str = ""
    attempts: int = 0
    """Providers tried: 1 unless the request failed over."""
    queue_wait_ms: float | None = None
    """Until the node started the answering attempt (None: no node ever started it)."""
    first_byte_ms: float | None = None
    """Until the first bytes of the answer reached the edge."""
    outcome: Literal["ok", "error", "cancelled"] = "ok"
    status: int | None = 200
    """The HTTP status the client got: an error's when it failed before the response started, 200
    when it succeeded or its stream ended with an error event, None when the client left."""
    """`cancelled`: the client went away before the end."""
    error: RequestError | None = None
    """What the client was told (as the HTTP error, or as the stream's error event)."""
    duration_ms: float = 0.0
    report: wire.Done | wire.Failure | None = None
    """The node's last word on the last attempt: what only it knows (tokens, upstream status, exit code)."""
    affinity: bool = False
    """The last attempt went to the provider its session used last (prefix-cache affinity)."""


Finished = Callable[[DispatchResult], None]


class _Lease:
    """One slot taken from the scheduler; `end()` gives it back once, however often it is called."""

    __slots__ = ("ended", "pool", "scheduler", "slot", "started")

    def __init__(self, scheduler: Scheduler, slot: ProviderSlots, pool: PoolQueue) -> None:
        self.scheduler = scheduler
        self.slot = slot
        self.pool = pool
        self.started = False
        self.ended = False

    def start(self) -> None:
        """The node began running the item: it counts as running in its pool until it ends."""
        if not self.ended and not self.started:
            self.started = True
            self.pool.run_started()

    def end(self) -> None:
        if self.ended:
            return
        self.ended = True
        if self.started:
            self.pool.run_ended()
        self.scheduler.release(self.slot)


class _Dispatch:
    """What both routes share: the result, its clock, and the one call of `on_finished`."""

    def __init__(self, relay: Relay, result: DispatchResult, on_finished: Finished | None) -> None:
        self.relay = relay
        self.result = result
        self.on_finished = on_finished
        self.arrived = time.monotonic()

    def _observe(self, ch: Channel) -> None:
        r = self.result
        # The last attempt is the one that counts: an earlier one that failed over says nothing here.
        r.id, r.node, r.report = ch.id, ch.node, ch.outcome
        r.queue_wait_ms = max(0.0, (ch.started_mono - self.arrived) * 1000) if ch.started_mono else None
        r.first_byte_ms = max(0.0, (ch.first_chunk_mono - self.arrived) * 1000) if ch.first_chunk_mono else None

    def _finish(self, exc: BaseException | None) -> None:
        r = self.result
        if isinstance(exc, RequestError):
            r.outcome, r.error, r.status = "error", exc, exc.status
        elif isinstance(exc, asyncio.CancelledError):
            r.outcome, r.status = "cancelled", None
        elif exc is not None:
            r.outcome, r.status = "error", 500
        elif r.error is not None:
            r.outcome = "error"
        r.duration_ms = (time.monotonic() - self.arrived) * 1000
        if self.on_finished is not None:
            try:
                self.on_finished(r)
            except Exception:  # broad on purpose: accounting must never turn a served request into a failure
                log.exception("request %s: on_finished failed", r.id)


class PoolDispatch(_Dispatch):
    """The whole life of one pool request's slots: acquire, dispatch, run, release, record, fail over."""

    def __init__(
        self,
        scheduler: Scheduler,
        relay: Relay,
        alias: str,
        deadline: float,
        *,
        on_finished: Finished | None = None,
        size: int = 0,
        sessions: Sessions | None = None,
        session: str | None = None,
        affinity_wait_s: float = 0.0,
    ) -> None:
        super().__init__(relay, DispatchResult(alias, "pool"), on_finished)
        self.size = size
        """The request body's bytes: what it holds in the edge's memory while it waits."""
        self.scheduler = scheduler
        self.alias = alias
        self.deadline = deadline
        """Loop clock: the latest a slot may be granted or the node may start the work."""
        self.sessions = sessions if session else None
        self.session = session or ""
        """The request's session key (prefix-cache affinity); "" without one."""
        self.affinity_wait_s = affinity_wait_s

    async def run(self, make_item: MakeItem, answer: Answer, responded: Callable[[], bool]) -> None:
        """Serve the request; raises the RequestError the client must get as an HTTP error.

        `responded()` tells whether the client's response has started: from then on nothing is
        retried, whatever fails.
        """
        tried: frozenset[str] = frozenset()
        last: RequestError | None = None
        exc: BaseException | None = None
        try:
            sessions = self.sessions
            prefer = sessions.preferred(self.alias, self.session) if sessions is not None else None
            while True:
                try:
                    slot = await self.scheduler.acquire(
                        self.alias, self.deadline, tried, self.size, prefer=prefer, prefer_wait_s=self.affinity_wait_s
                    )
                except Unavailable as unusable:
                    if last is not None and unusable.code == "pool_unavailable":
                        raise last from None  # no other provider to fail over to: the client hears why
                    raise
                if self.alias not in self.scheduler.pools:
                    # A refresh removed the alias between the grant and now: give the slot back untouched.
                    self.scheduler.trial_over(slot)
                    self.scheduler.release(slot)
                    raise Unavailable(f"model '{self.alias}' was removed by a refresh", code="model_removed")
                if sessions is not None:
                    self.result.affinity = sessions.served(self.alias, self.session, slot.id, prefer)
                prefer = None  # a failover goes wherever is free; the provider that answers is remembered
                try:
                    await self._attempt(slot, make_item, answer)
                    return
                except RequestError as err:
                    if not err.retryable or err.status < 500:
                        # A 4xx is about the request (an upstream's 422 arrives as an UpstreamError
                        # with its status): another provider would refuse it too, and it says
                        # nothing of this provider's health.
                        self.scheduler.trial_over(slot)
                        raise
                    self.scheduler.failed(slot)
                    tried |= {slot.id}
                    last = err
                    pool = self.scheduler.pools.get(self.alias)  # a refresh may have removed it meanwhile
                    others = [p for p in pool.providers if p.id not in tried] if pool is not None else []
                    if responded() or len(tried) > MAX_RETRIES or not others:
                        raise
                    log.warning("provider %s failed before answering (%s); retrying on another", slot.id, err.code)
                except BaseException:
                    self.scheduler.trial_over(slot)  # the client left: nothing learnt of the provider
                    raise
        except BaseException as err:  # noted for the result (a cancelled client too), then raised on
            exc = err
            raise
        finally:
            self._finish(exc)

    async def _attempt(self, slot: ProviderSlots, make_item: MakeItem, answer: Answer) -> None:
        # Nothing awaits between the check in run() and this try: the pool is there, the lease always ends.
        lease = _Lease(self.scheduler, slot, self.scheduler.pools[self.alias])
        ch = self.relay.open(slot.node, on_started=lease.start, on_ended=lease.end)
        self.result.attempts += 1
        self.result.provider = slot.id
        try:
            await self.relay.dispatch_pool(ch, slot.id, make_item(ch))
            self.result.error = await answer(ch, slot.id)
            self.scheduler.succeeded(slot)
        finally:
            self._observe(ch)
            self.relay.close(ch)
            lease.end()


class DirectDispatch(_Dispatch):
    """A request on a direct route: one CLI resource, no queue, no slot, no failover."""

    def __init__(
        self, relay: Relay, alias: str, node: str, resource: str, *, on_finished: Finished | None = None
    ) -> None:
        super().__init__(relay, DispatchResult(alias, "direct", node=node, provider=resource), on_finished)
        self.node = node
        self.resource = resource

    async def run(self, make_item: MakeItem, answer: Answer) -> None:
        """Serve the request; raises the RequestError the client must get as an HTTP error."""
        exc: BaseException | None = None
        ch = self.relay.open(self.node)
        self.result.attempts = 1
        try:
            await self.relay.dispatch_direct(ch, self.node, self.resource, make_item(ch))
            self.result.error = await answer(ch, self.resource)
        except BaseException as err:  # noted for the result (a cancelled client too), then raised on
            exc = err
            raise
        finally:
            self._observe(ch)
            self.relay.close(ch)
            self._finish(exc)
