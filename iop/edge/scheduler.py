"""The edge's pool scheduler: one fair queue per pool, late binding to the provider with the most free slots.

The broker's `max_ack_pending` is the hard cap; this schedules on top of it so that a request
never waits in the broker while another provider of its pool has a free slot. A provider that
keeps failing is taken out of rotation for a while (circuit breaker), then tried again.

This module keeps the providers' state (the catalog, connections, drains, breakers) and serves
waiters when it changes; the queues themselves are iop/edge/admission.py's.
"""

from __future__ import annotations

import asyncio
from time import monotonic

from iop.edge.admission import Admission
from iop.edge.slots import PoolQueue, ProviderSlots
from iop.errors import Unavailable

BREAKER_FAILURES = 3
"""Consecutive failures that take a provider out of rotation."""
BREAKER_COOLDOWN_S = 5.0
"""First time out of rotation; doubles on every failed trial, up to BREAKER_COOLDOWN_MAX_S."""
BREAKER_COOLDOWN_MAX_S = 60.0


class Scheduler(Admission):
    """Admission for pool aliases: take a slot now, or wait in the pool's queue until one frees."""

    def add_provider(self, provider: str, node: str, capacity: int) -> ProviderSlots:
        slots = self.providers.get(provider)
        if slots is None:
            slots = self.providers[provider] = ProviderSlots(provider, node, capacity)
        return slots

    def add_pool(self, alias: str, members: list[str]) -> None:
        pool = PoolQueue(alias, [self.providers[m] for m in members])
        pool.waiters.set_fair(self.fair)
        self.pools[alias] = pool
        for p in pool.providers:
            p.pools.append(pool)

    def apply(self, providers: dict[str, tuple[str, int]], pools: dict[str, list[str]]) -> list[str]:
        """Switch to a new catalog in one synchronous step, so no request sees a half-applied pool.

        `providers` maps id → (node, capacity); `pools` maps alias → member ids. Returns the ids of
        removed providers that still run requests (they drain, then disappear).
        """
        for pid, (node, capacity) in providers.items():
            slot = self.providers.get(pid)
            if slot is None or slot.removed:
                connected = slot.connected if slot is not None else False
                slot = self.providers[pid] = ProviderSlots(pid, node, capacity, connected=connected, seen=connected)
            slot.node, slot.capacity = node, capacity
            slot.rerank()
        draining = []
        for pid, slot in list(self.providers.items()):
            if pid not in providers:
                slot.removed = True
                slot.rerank()
                if slot.in_flight:
                    draining.append(pid)
                else:
                    del self.providers[pid]
        for alias in list(self.pools):
            if alias not in pools:
                gone = self.pools.pop(alias)
                for p in gone.providers:
                    p.pools.remove(gone)
                for waiter in gone.waiters:
                    self._left(waiter)
                    if not waiter.future.done():
                        waiter.future.set_exception(
                            Unavailable(f"model '{alias}' was removed by a refresh", code="model_removed")
                        )
        for alias, members in pools.items():
            pool = self.pools.get(alias)
            if pool is None:
                pool = self.pools[alias] = PoolQueue(alias, [])
            pool.waiters.set_fair(self.fair)
            for p in pool.providers:
                if pool in p.pools:
                    p.pools.remove(pool)
            pool.providers = [self.providers[m] for m in members]
            for p in pool.providers:
                p.pools.append(pool)
            pool.rebuild()
        self._pump(list(self.pools.values()))
        self._fail_if_unusable(list(self.pools.values()))
        self.changed.set()
        return draining

    def set_drained(self, provider: str, drained: bool, by: str = "qualify", why: str = "exclusive qualify") -> None:
        """Take a provider out of its pools (no new user work) or put it back, for `by` (a qualification,
        its policy, an operator): back once nobody holds it out. Its waiters go elsewhere or wait."""
        slot = self.providers.get(provider)
        if slot is not None and slot.drain(by, why if drained else None) and not slot.drained:
            self._pump(slot.pools)

    def set_elsewhere(self, provider: str, held: int) -> None:
        """Slots of `provider` other edges hold (its node's heartbeat); fewer than before: serve waiters."""
        slot = self.providers.get(provider)
        if slot is None or slot.elsewhere == held:
            return
        fewer = held < slot.elsewhere
        slot.elsewhere = held
        slot.rerank()
        if fewer:
            self._pump(slot.pools)

    def set_connected(self, provider: str, connected: bool) -> None:
        slot = self.providers.get(provider)
        if slot is None or slot.connected == connected:
            return
        slot.connected = connected
        slot.rerank()
        if connected:
            slot.seen = True
            self._connected.set()
            self._pump(slot.pools)
        else:
            self._fail_if_unusable(slot.pools)

    def succeeded(self, slot: ProviderSlots) -> None:
        slot.failures = 0
        if slot.open_until:
            slot.open_until = 0.0
            slot.rerank()
            slot.trips = 0
            slot.trial = False
            self._pump(slot.pools)

    def failed(self, slot: ProviderSlots) -> None:
        """The provider failed a request (before answering): count it toward its breaker."""
        slot.failures += 1
        now = monotonic()
        if slot.trial or (not slot.open_until and slot.failures >= BREAKER_FAILURES):
            cooldown = min(BREAKER_COOLDOWN_S * 2**slot.trips, BREAKER_COOLDOWN_MAX_S)
            slot.trips += 1
            slot.trial = False
            slot.open_until = now + cooldown
            slot.rerank()
            # When the cooldown ends the provider may take a trial request: wake its waiters then.
            asyncio.get_running_loop().call_later(cooldown, self._cooled, slot)
            self._fail_if_unusable(slot.pools)

    def _cooled(self, slot: ProviderSlots) -> None:
        """A breaker's cooldown timer fired: hand the trial to a waiter, or re-arm if it fired early."""
        now = monotonic()
        if slot.open_until and now < slot.open_until:
            # The loop's timers (uvloop's: whole milliseconds) may fire a hair before `open_until`
            # on this clock; nothing else would wake the waiters, so wait out the rest.
            asyncio.get_running_loop().call_later(slot.open_until - now + 0.001, self._cooled, slot)
            return
        self._pump(slot.pools)
