"""Tenants' max_concurrent across every edge of one NATS: each edge's share of the bound, leased in KV.

A tenant's bound on a pool (`max_concurrent`) is a number of units. The key of (pool, tenant) in
the JetStream KV bucket `iop_leases` holds, per edge, the units it holds, the units it wants and
when its entry expires. Edges change it only by compare-and-set, and none ever writes holdings
that sum past the bound, so the tenant's requests in flight on all edges together never pass it:
an edge grants a request of the tenant only while it runs fewer than the units it holds (the
tenant's bound in this edge's fair queue, iop/edge/fairqueue.py); more wait in its queue.

Units go where requests wait. An edge asks for more when its requests of the tenant wait (one
KV round trip), and gives back what it no longer uses: at once when another edge waits for units,
after LINGER_S otherwise (a burst on one edge costs one write, not one per request). While the
edges together want more than the bound, each holds its max-min fair part (`fair_parts`, the same
on every edge), lowering its own holding as its requests end, before it tells the bucket. Every
edge watches the bucket, so a want or a unit given back reaches the others within a KV round.

Nothing leaks. A request gives its unit back when its slot is released, whatever ended it
(success, failure, queue timeout, cancel: iop/edge/dispatch.py releases once). An entry expires
TTL_S after its edge last wrote it, and each edge renews its entries every TTL_S / 3, so the units
of an edge that died (SIGKILL) come back. TTL_S is longer than a node takes to stop the requests of
an edge that no longer answers (PROBES_UNANSWERED probes, wire.PROBE_INTERVAL_S apart), so a dead
edge's units return only once its requests no longer run. An edge that cannot renew its entries
(NATS unreachable) grants nothing more until it can: its entry may have expired for the others.
Expiry is judged on each edge's own clock alone: another edge's entry counts for TTL_S after this
edge saw it written (its `expires` changed), so edges' clocks need not agree.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import nats.errors
import nats.js.errors
from nats.js import api as js_api
from nats.js.client import JetStreamContext

from iop.nats import streams

log = logging.getLogger("iop.edge")

LEASES_BUCKET = "iop_leases"
"""KV bucket of tenants' max_concurrent shares: key `c.<pool>.<tenant>`; value a msgpack {edge: Share}."""
TTL_S = 10.0
"""An edge's entry counts this long after it wrote it (longer than a node takes to stop a dead edge's work)."""
LINGER_S = 1.0
"""Units no longer used are kept this long while no other edge wants them (the next request needs no write)."""

_OP_TIMEOUT_S = 2.0
_REWATCH_S = 30.0
_MAX_TRIES = 64
_BROKER_ERRORS = (nats.errors.Error, OSError, asyncio.TimeoutError)
_KEY_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


class Share(msgspec.Struct, array_like=True, gc=False):
    """One edge's part of a (pool, tenant) bound, as the bucket holds it."""

    held: int
    want: int
    """Units it would use now (running + waiting, at most the bound); above `held`: it waits for units."""
    expires: float
    """Unix time on its writer's clock, TTL_S after the write. Edges judge expiry by when they saw the
    entry written (on their own clocks, which need not agree); older edges read this."""


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(dict[str, Share]).decode


def lease_key(alias: str, tenant: str) -> str:
    """The KV key of (pool alias, tenant): characters a key may not hold as `=XX` (hex)."""

    def safe(s: str) -> str:
        return _KEY_UNSAFE.sub(lambda m: "".join(f"={b:02X}" for b in m.group().encode()), s) or "="

    return f"c.{safe(alias)}.{safe(tenant)}"


def fair_parts(limit: int, wants: dict[str, int]) -> dict[str, int]:
    """The max-min fair division of `limit` units among edges wanting `wants`; the same on every edge
    (edges taken by want, then id: a remainder goes to the first of those that want more)."""
    parts: dict[str, int] = {}
    left = limit
    order = sorted(wants.items(), key=lambda kv: (kv[1], kv[0]))
    for i, (edge, want) in enumerate(order):
        part = min(want, -(-left // (len(order) - i)))
        parts[edge] = part
        left -= part
    return parts


@dataclass(eq=False)
class Lease:
    """This edge's part of one tenant's bound on one pool."""

    key: str
    alias: str
    tenant: str
    limit: int
    bound: int = 0
    """Units this edge may use now: `held`, or less while it gives units back (never below `running`)."""
    held: int = 0
    """What this edge's entry in the bucket says it holds (its last write that succeeded)."""
    wanted: int = 0
    """The want its entry says."""
    running: int = 0
    waiting: int = 0
    spare_since: float | None = None
    """Since when (monotonic) it holds units it does not use, with no other edge wanting them."""
    written_at: float = 0.0
    """Monotonic time of its entry's last write that succeeded."""
    dirty: bool = False
    renew: bool = False
    """Its next write renews its entry even if nothing else changed."""
    task: asyncio.Task[None] | None = None
    timer: asyncio.TimerHandle | None = None

    @property
    def want(self) -> int:
        return min(self.limit, self.running + self.waiting)


class TenantLeases:
    """This edge's leases of tenants' max_concurrent, kept with the other edges' in `iop_leases`."""

    def __init__(self, edge_id: str, ttl_s: float = TTL_S, linger_s: float = LINGER_S) -> None:
        self.edge_id = edge_id
        self.ttl_s = ttl_s
        self.linger_s = linger_s
        self.kv: Any = None
        self.leases: dict[str, Lease] = {}
        self.values: dict[str, tuple[int, dict[str, Share]]] = {}
        """Key → (revision, shares) as this edge last read, wrote or watched it."""
        self.on_bound: Callable[[str, str, int], None] = lambda alias, tenant, bound: None
        """Called with (alias, tenant, bound) when a lease's bound grew (the scheduler serves its waiters)."""
        self.writes = 0
        self.conflicts = 0
        self._watch: asyncio.Task[None] | None = None
        self._renew: asyncio.Task[None] | None = None
        self._closed = False
        self.wall: Callable[[], float] = time.time
        """The clock `expires` is written by (for older edges, which judge expiry by it)."""
        self._stamps: dict[tuple[str, str], tuple[float, float]] = {}
        """(key, other edge) → (the `expires` its entry said, when this edge first saw that, monotonic)."""
        self._unreadable: set[str] = set()
        """Keys whose entry was not a lease (logged once, written over by the next write)."""
        self.rewatch_s = _REWATCH_S
        """The watch is made anew after this long without an update."""

    async def open(self, js: JetStreamContext, replicas: int | None = None) -> None:
        cfg = js_api.KeyValueConfig(bucket=LEASES_BUCKET, history=1, direct=True)
        self.kv = await streams.ensure_bucket(js, cfg, replicas=replicas)
        watcher = await self._watched()
        self._watch = asyncio.create_task(self._follow(watcher))
        self._renew = asyncio.create_task(self._renewing())

    async def stop(self) -> None:
        """Give every unit back (the edge stops: its requests have ended)."""
        for task in (self._renew, self._watch):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._renew = self._watch = None
        for lease in self.leases.values():
            lease.running = lease.waiting = 0
            lease.bound = 0
            lease.spare_since = -1e18  # nothing to linger for
            self._dirty(lease)
        tasks = [lease.task for lease in self.leases.values() if lease.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=_OP_TIMEOUT_S)
        self._closed = True  # a write still failing gives up (its entry expires by itself)
        for task in tasks:
            task.cancel()

    # --- what the scheduler asks and tells -------------------------------------------------------

    def bound(self, alias: str, tenant: str, limit: int) -> int:
        """The units of (alias, tenant) this edge may use now (0 until it holds some)."""
        lease = self._lease(alias, tenant, limit)
        return lease.bound

    def changed(self, alias: str, tenant: str, running: int, waiting: int) -> int | None:
        """The tenant's requests on the pool here now run `running` and wait `waiting`; returns the
        bound in force at once (lowered already when units go back to another edge), None for a
        tenant without a lease here."""
        lease = self.leases.get(lease_key(alias, tenant))
        if lease is None:
            return None
        lease.running, lease.waiting = running, waiting
        self._decide(lease, tell=False)
        return lease.bound

    # --- the decision ----------------------------------------------------------------------------

    def _lease(self, alias: str, tenant: str, limit: int) -> Lease:
        key = lease_key(alias, tenant)
        lease = self.leases.get(key)
        if lease is None:
            lease = self.leases[key] = Lease(key, alias, tenant, limit)
        elif lease.limit != limit:
            lease.limit = limit  # a refresh changed it: a lower one takes effect as requests end
            self._decide(lease)
        return lease

    def _stamp(self, key: str) -> None:
        """Note when this edge saw each other edge's entry of `key` written (as it reads it)."""
        now = time.monotonic()
        for edge, share in self.values[key][1].items():
            if edge != self.edge_id:
                self._fresh(key, edge, share, now)

    def _fresh(self, key: str, edge: str, share: Share, now: float) -> bool:
        """Whether another edge's share still counts: for the TTL after this edge first saw it
        written, on this edge's monotonic clock (an entry first seen now counts a whole TTL)."""
        stamp = self._stamps.get((key, edge))
        if stamp is None or (stamp[0] != share.expires and not (math.isnan(stamp[0]) and math.isnan(share.expires))):
            self._stamps[(key, edge)] = (share.expires, now)
            return True
        return now - stamp[1] < self.ttl_s

    def _others(self, lease: Lease, now: float) -> dict[str, Share]:
        shares = self.values.get(lease.key, (0, {}))[1]
        return {e: s for e, s in shares.items() if e != self.edge_id and self._fresh(lease.key, e, s, now)}

    def _goal(self, lease: Lease, now: float) -> int:
        """The units this edge should hold now."""
        others = self._others(lease, now)
        cap = max(0, lease.limit - sum(s.held for s in others.values()))
        want = lease.want
        if any(s.want > s.held for s in others.values()):
            # Another edge waits for units: each holds its fair part, spare units go back at once.
            wants = {e: min(lease.limit, s.want) for e, s in others.items()}
            wants[self.edge_id] = want
            goal = min(want, fair_parts(lease.limit, wants)[self.edge_id])
            lease.spare_since = None
        elif want >= lease.held:
            goal = want
            lease.spare_since = None
        else:
            if lease.spare_since is None:
                lease.spare_since = now
            # Kept a while: the tenant's next request here needs no write.
            goal = want if now - lease.spare_since >= self.linger_s else lease.held
        # Never below what runs (a unit in use goes back when its request ends), never more than the
        # others leave (`bound` is within that already, by the write that gave it).
        return max(lease.running, min(goal, max(cap, lease.bound)))

    def _decide(self, lease: Lease, tell: bool = True) -> None:
        goal = self._goal(lease, time.monotonic())
        if goal < lease.bound:
            lease.bound = goal  # giving back is safe before the bucket knows
            if tell:
                self.on_bound(lease.alias, lease.tenant, goal)
        if goal != lease.held or self._stored_want(lease, goal) != lease.wanted:
            self._dirty(lease)
        elif lease.spare_since is not None and lease.timer is None:
            lease.timer = asyncio.get_running_loop().call_later(self.linger_s, self._lingered, lease)

    def _lingered(self, lease: Lease) -> None:
        lease.timer = None
        if self.leases.get(lease.key) is lease:
            self._decide(lease)

    @staticmethod
    def _stored_want(lease: Lease, held: int) -> int:
        # Others care only whether it waits for units, and for how many: a want within what it holds is its holding.
        return max(lease.want, held)

    def _dirty(self, lease: Lease) -> None:
        lease.dirty = True
        if lease.task is None and not self._closed:
            lease.task = asyncio.create_task(self._run(lease))

    # --- the bucket --------------------------------------------------------------------------------

    async def _run(self, lease: Lease) -> None:
        try:
            while lease.dirty:
                lease.dirty = False
                try:
                    await asyncio.wait_for(self._commit(lease), _OP_TIMEOUT_S * 2)
                except _BROKER_ERRORS as exc:
                    log.warning("leases: %s of tenant %s not written: %s", lease.alias, lease.tenant or "''", exc)
                    self.values.pop(lease.key, None)
                    if self._closed:
                        return
                    await asyncio.sleep(0.2)  # the broker is away: try again shortly, not in a tight loop
                    lease.dirty = True
        finally:
            lease.task = None
            if lease.dirty:
                self._dirty(lease)
            elif lease.spare_since is not None and lease.timer is None and lease.held > lease.want:
                # Kept through its linger by this write: given back once that is over.
                lease.timer = asyncio.get_running_loop().call_later(self.linger_s, self._lingered, lease)
            elif not lease.held and not lease.wanted and not lease.running and not lease.waiting:
                if lease.timer is not None:
                    lease.timer.cancel()
                self.leases.pop(lease.key, None)

    async def _commit(self, lease: Lease) -> None:
        renew, lease.renew = lease.renew, False
        known: dict[str, Share] = {}
        for _ in range(_MAX_TRIES):
            if lease.key not in self.values:
                await self._read(lease.key, known)
            revision, shares = self.values[lease.key]
            known = shares
            now = time.monotonic()
            goal = self._goal(lease, now)
            want = self._stored_want(lease, goal)
            mine = shares.get(self.edge_id)
            if not renew and mine is not None and (mine.held, mine.want) == (goal, want) and goal == lease.held:
                return
            if mine is None and goal == 0 and want == 0:
                lease.held = lease.wanted = 0
                return
            value = {e: s for e, s in shares.items() if e != self.edge_id and self._fresh(lease.key, e, s, now)}
            if goal or want:
                value[self.edge_id] = Share(goal, want, self.wall() + self.ttl_s)
            try:
                if revision:
                    new = await self.kv.update(lease.key, _encode(value), last=revision)
                else:
                    new = await self.kv.create(lease.key, _encode(value))
            except nats.js.errors.KeyWrongLastSequenceError:
                self.conflicts += 1
                self.values.pop(lease.key, None)
                continue
            self.writes += 1
            self.values[lease.key] = (new, value)
            lease.held, lease.wanted, lease.written_at = goal, want, now
            if goal != lease.bound:
                lease.bound = goal
                self.on_bound(lease.alias, lease.tenant, goal)
            return
        raise TimeoutError(f"too many concurrent writers of {lease.key}")

    async def _read(self, key: str, known: dict[str, Share]) -> None:
        try:
            entry = await self.kv.get(key)
        except nats.js.errors.KeyNotFoundError:
            self.values[key] = (0, {})
            return
        self.values[key] = (entry.revision or 0, self._shares(entry, known))
        self._stamp(key)

    def _shares(self, entry: Any, known: dict[str, Share]) -> dict[str, Share]:
        """The shares an entry holds; for one that holds no lease (anything may be written there, see
        docs/security.md), the shares this edge knew: the next write puts them back over it."""
        if entry.operation in ("DEL", "PURGE"):
            return {}
        try:
            shares = _decode(entry.value or b"")  # edges never write an empty value
        except msgspec.DecodeError as exc:
            if entry.key not in self._unreadable:
                self._unreadable.add(entry.key)
                log.warning("lease %s in %s is unreadable (%s): written over", entry.key, LEASES_BUCKET, exc)
            return known
        self._unreadable.discard(entry.key)
        return shares

    async def _watched(self) -> Any:
        """A watch of the bucket, after what it holds now (up to the watcher's None)."""
        watcher = await self.kv.watchall()
        async for entry in watcher:
            if entry is None:
                break
            self._seen(entry)
        return watcher

    async def _follow(self, watcher: Any) -> None:
        try:
            while True:
                try:
                    entry = await watcher.updates(timeout=self.rewatch_s)
                except nats.errors.TimeoutError:
                    # Quiet for a while: watch anew (a watch can end unseen, with its server). What it
                    # replays is known already (`_seen` skips revisions it has).
                    with contextlib.suppress(nats.errors.Error, OSError):
                        await watcher.stop()
                    try:
                        watcher = await self._watched()
                    except _BROKER_ERRORS as exc:
                        log.warning("leases: the watch of %s not renewed: %s", LEASES_BUCKET, exc)
                    continue
                if entry is not None:
                    self._seen(entry)
        finally:
            with contextlib.suppress(nats.errors.Error, OSError):
                await watcher.stop()

    def _seen(self, entry: Any) -> None:
        """Another edge (or this one) wrote a key: keep it, and see whether this edge's share moves."""
        revision = entry.revision or 0
        known = self.values.get(entry.key)
        if known is not None and known[0] >= revision:
            return
        shares = self._shares(entry, known[1] if known is not None else {})
        self.values[entry.key] = (revision, shares)
        self._stamp(entry.key)
        lease = self.leases.get(entry.key)
        if lease is not None:
            self._decide(lease)

    async def _renewing(self) -> None:
        every_s = self.ttl_s / 3
        while True:
            await asyncio.sleep(every_s)  # a timer: nothing else marks the time to renew
            now = time.monotonic()
            for stamped in [k for k in self._stamps if k[1] not in self.values.get(k[0], (0, {}))[1]]:
                del self._stamps[stamped]  # that edge's entry is gone from the key
            for lease in list(self.leases.values()):
                if now - lease.written_at > self.ttl_s * 0.8 and lease.bound > lease.running:
                    # Not renewed for most of its life: the others may soon count it expired.
                    lease.bound = lease.running
                    self.on_bound(lease.alias, lease.tenant, lease.bound)
                if (lease.held or lease.wanted) and now - lease.written_at >= every_s:
                    lease.renew = True
                    self._dirty(lease)

    def parts(self) -> list[tuple[str, str, int, int, int]]:
        """(alias, tenant, max_concurrent, units this edge holds, units all edges hold) of each lease here."""
        now = time.monotonic()
        out = []
        for lz in self.leases.values():
            held = sum(sh.held for sh in self._others(lz, now).values())
            out.append((lz.alias, lz.tenant, lz.limit, lz.bound, held + lz.held))
        return out
