"""Edges on one NATS tell each other the provider slots they hold, so each dispatches where one is free.

Each edge counts its own requests per provider exactly (the scheduler's `in_flight`: dispatched,
not yet ended), and the slots it keeps a moment for a tenant that asks again at once
(iop/edge/anticipate.py). It announces them on `wire.EDGE_SLOTS_SUBJECT` in the loop turn after they change
(the changed providers only) and all of them every `EDGE_SLOTS_FULL_S`; every edge adds the
others' announced counts into each provider's `elsewhere`. A slot another edge frees therefore
reaches this edge's waiters one NATS hop later, not at the node's next heartbeat (up to 1 s).

An edge not heard from (starting, or gone without a word: SIGKILL, lost network) counts from the
nodes' heartbeats instead (`ProviderLive.by_edge`, at most one heartbeat old): a dead edge's
requests keep their slots there until their nodes stop them. Announcements are core NATS (at
most once): one lost is repaired by the next full one. An edge that stops says so with a last
full announcement, so the others do not wait out its silence.
"""

from __future__ import annotations

import asyncio
import logging
from time import monotonic

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from iop import wire
from iop.edge import standby
from iop.edge.fairshare import FairShare, Load, loads
from iop.edge.junk import Junk
from iop.edge.scheduler import Scheduler
from iop.edge.slots import PinnedQueue, PoolQueue, ProviderSlots

log = logging.getLogger("iop.edge")


class SlotShare:
    """This edge's announcements out, the other edges' in; feeds `Scheduler.set_elsewhere`."""

    def __init__(self, scheduler: Scheduler, edge_id: str) -> None:
        self.scheduler = scheduler
        self.edge_id = edge_id
        self.announced: dict[str, dict[str, int]] = {}
        """Other edge → provider → slots it holds, from its announcements (since its last full one)."""
        self.heard: dict[str, float] = {}
        """Other edge → when it last announced (monotonic)."""
        self.by_node: dict[str, dict[str, int]] = {}
        """Provider → edge → requests its node runs for that edge (the node's last heartbeat)."""
        self.oversubscribed: dict[str, int] = {}
        """Provider → requests the edges together sent past its capacity, as this edge learnt of them
        (two edges took its last slot at once, or a count arrived late): each waits in the broker."""
        self.sent = 0
        self.received = 0
        self._dirty: set[str] = set()
        self._dirty_pools: set[str] = set()
        self._waiting_sent: set[str] = set()
        """Pools whose tenants this edge last announced as waiting (a later 'none' is owed for them)."""
        self.undecodable = Junk("edge_slots")
        """Messages on the announcements' subject that are none."""
        self._junk: set[str] = set()
        """Edges that announced counts below 0 (logged once each)."""
        self._wake = asyncio.Event()
        """Set when there is something to announce: a change while another edge listens, a full one due."""
        self._full = True
        """A full announcement is due (the first, then every `wire.EDGE_SLOTS_FULL_S`)."""
        self._nc: NATS | None = None
        self._task: asyncio.Task[None] | None = None
        self.fair = FairShare(scheduler.serve)
        """The other edges' waiting tenants: a slot freed here may be owed to one of them."""
        scheduler.on_count = self._count_changed
        scheduler.on_queue = self._queue_changed
        scheduler.owed = self.fair.owed
        scheduler.waiting_elsewhere = self.fair.waiting_elsewhere

    async def start(self, nc: NATS) -> None:
        self._nc = nc
        await nc.subscribe(wire.EDGE_SLOTS_SUBJECT, cb=self._on_slots, pending_msgs_limit=100_000)
        self._task = asyncio.create_task(self.announce())

    async def stop(self) -> None:
        if self._task is None:
            return
        self._task.cancel()
        self._task = None
        # A last full word (nothing held, after a drain): the others need not wait out its silence.
        held = {p.id: p.in_flight for p in self.scheduler.providers.values() if p.in_flight}
        await self._publish(True, held)

    async def _publish(self, full: bool, held: dict[str, int], waiting: dict[str, list[Load]] | None = None) -> None:
        if self._nc is None or not self._nc.is_connected:
            return
        try:
            message = wire.EdgeSlots(self.edge_id, full, held, waiting or {})
            await self._nc.publish(wire.EDGE_SLOTS_SUBJECT, wire.encode(message))
            self.sent += 1
        except Exception as exc:  # a closed or reconnecting connection: the next full one repairs it
            log.debug("edge slots announcement not sent: %s", exc)

    # --- out ------------------------------------------------------------------------------------

    def _count_changed(self, slot: ProviderSlots) -> None:
        self._dirty.add(slot.id)
        if self.heard:  # alone, only the full announcements go out: no wake-up per request
            self._wake.set()

    def _queue_changed(self, pool: PoolQueue) -> None:
        if not isinstance(pool, PinnedQueue):
            self._dirty_pools.add(pool.alias)
            if self.heard:
                self._wake.set()

    def _full_due(self) -> None:
        self._full = True
        self._wake.set()

    def _waiting(self, aliases: set[str] | None) -> dict[str, list[Load]]:
        """The tenants of the pools in `aliases` (None: every pool) that have requests waiting here,
        and an empty list for those that had in the last announcement and have none now."""
        pools = self.scheduler.pools
        names = set(pools) if aliases is None else aliases
        out: dict[str, list[Load]] = {}
        for alias in names:
            pool = pools.get(alias)
            rows = loads(pool) if pool is not None else []
            if rows or alias in self._waiting_sent:
                out[alias] = rows
        self._waiting_sent = {a for a in self._waiting_sent if a not in names} | {a for a, r in out.items() if r}
        return out

    def _listened(self, now: float) -> bool:
        """Whether another edge announced lately: alone, an edge sends only its full announcements."""
        return any(now - t < wire.EDGE_SLOTS_SILENT_S for t in self.heard.values())

    async def announce(self) -> None:
        """Announce this edge's counts until cancelled (`start` runs it; a bench runs it alone)."""
        loop = asyncio.get_running_loop()
        self._full = True  # the first one, at once
        timer: asyncio.TimerHandle | None = None
        try:
            while True:
                if not self._full:
                    await self._wake.wait()
                # Woken in the loop turn after the change: every change of that turn goes in one message.
                self._wake.clear()
                full, self._full = self._full, False
                if full:
                    timer = loop.call_later(wire.EDGE_SLOTS_FULL_S, self._full_due)  # one timer, not one a wake
                await self._announce_once(full)
        finally:
            if timer is not None:
                timer.cancel()

    async def _announce_once(self, full: bool) -> None:
        """What changed since the last announcement (all of it when `full`), if another edge listens."""
        providers = self.scheduler.providers
        waiting: dict[str, list[Load]] = {}
        if full:
            held = {p.id: p.in_flight + p.kept for p in providers.values() if p.in_flight + p.kept}
            waiting = {a: r for a, r in self._waiting(None).items() if r}
            self._forget_silent()
        elif self._listened(monotonic()):
            held = {pid: p.in_flight + p.kept if (p := providers.get(pid)) else 0 for pid in self._dirty}
            waiting = self._waiting(self._dirty_pools)
        else:
            held = {}
        self._dirty.clear()
        self._dirty_pools.clear()
        if full or held or waiting:
            await self._publish(full, held, waiting)

    # --- in -------------------------------------------------------------------------------------

    async def _on_slots(self, msg: Msg) -> None:
        try:
            m = wire.decode_edge_slots(msg.data)
        except Exception:
            # No edge sends these (a node can have the JetStream server answer here, docs/security.md).
            self.undecodable.dropped(msg.subject)
            return
        if m.edge == self.edge_id:
            return
        self.received += 1
        if any(n < 0 for n in m.held.values()):
            if m.edge not in self._junk:  # no edge sends these: logged once, counted as none
                self._junk.add(m.edge)
                log.warning("edge %s announces fewer than no slots held: counted as none", m.edge)
            m = wire.EdgeSlots(m.edge, m.full, {p: max(0, n) for p, n in m.held.items()}, m.waiting)
        known = self.announced.get(m.edge)
        for alias, rows in m.waiting.items():
            if (pool := self.scheduler.pools.get(alias)) is not None:
                for row in rows:
                    standby.active(pool, row[0])  # active there: not to be stood ahead of here
        if m.full or (m.waiting and known is not None):
            # (A change from an edge not yet heard in full waits for its full word: only an edge
            # heard in full is forgotten when it falls silent.)
            self.fair.heard(m.edge, m.full, m.waiting)
        if m.full:
            # From now on this edge's own word counts, not the heartbeats' (also for what it no longer holds).
            touched = set(m.held) | set(known or ()) | self._in_heartbeats(m.edge)
            self.announced[m.edge] = {p: n for p, n in m.held.items() if n}
        elif known is not None:
            touched = set(m.held)
            for p, n in m.held.items():
                if n:
                    known[p] = n
                else:
                    known.pop(p, None)
        else:
            return  # its counts before this change are unknown until its next full announcement
        self.heard[m.edge] = monotonic()
        for p in touched:
            self._recount(p)

    def heard_node(self, provider: str, by_edge: dict[str, int]) -> None:
        """A node's heartbeat: the requests it runs for `provider`, per edge."""
        self.by_node[provider] = by_edge
        self._recount(provider)

    def node_lost(self, provider: str) -> None:
        """The provider's node is gone, and everything it ran with it (the edges release theirs)."""
        self.by_node.pop(provider, None)
        self._recount(provider)

    def _in_heartbeats(self, edge: str) -> set[str]:
        return {p for p, by_edge in self.by_node.items() if by_edge.get(edge)}

    def _live(self, edge: str, now: float) -> bool:
        return edge in self.announced and now - self.heard.get(edge, 0.0) < wire.EDGE_SLOTS_SILENT_S

    def _recount(self, provider: str) -> None:
        now = monotonic()
        held = sum(c.get(provider, 0) for e, c in self.announced.items() if self._live(e, now))
        held += sum(
            n for e, n in self.by_node.get(provider, {}).items() if e != self.edge_id and not self._live(e, now)
        )
        slot = self.scheduler.providers.get(provider)
        if slot is not None and slot.connected and held > slot.elsewhere:
            limit = slot.capacity + self.scheduler.standby  # standby requests wait in the broker by design
            before = max(0, slot.in_flight + slot.elsewhere - limit)
            over = max(0, slot.in_flight + held - limit)
            if over > before:
                self.oversubscribed[provider] = self.oversubscribed.get(provider, 0) + over - before
        self.scheduler.set_elsewhere(provider, held)

    def _forget_silent(self) -> None:
        """Edges silent too long count from the heartbeats again; every provider is recounted (a
        refresh may have replaced its slot, which starts from no `elsewhere`)."""
        now = monotonic()
        for edge in [e for e in self.announced if not self._live(e, now)]:
            log.info("edge %s stopped announcing its slots: counting them from the nodes' heartbeats", edge)
            del self.announced[edge]
            self.fair.forget(edge)
        for edge in [e for e, t in self.heard.items() if now - t >= wire.EDGE_SLOTS_SILENT_S]:
            del self.heard[edge]
        for provider in list(self.scheduler.providers):
            self._recount(provider)
