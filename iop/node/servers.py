"""Model servers a node runs itself: started on demand, stopped when idle, swapped within a group.

States: `stopped` (no process), `starting` (process up, not ready yet), `ready`, `draining` (no new
work, its running requests finish, then it stops), `failed` (died or never became ready; restarted
after a back-off). A request for a server that is not ready waits in `acquire` — the node holds its
work message meanwhile (iop/node/fetch.py), so capacity stays what the consumer allows. In a group of
size N at most N servers have a process at once: a request for another one drains the least recently
used ready server, waits for it to stop, then starts its own (what llama-swap does).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any, Literal

from iop import wire
from iop.errors import ServerNotReady
from iop.node.serverproc import ServerProcess
from iop.serverconf import ServerSettings

log = logging.getLogger("iop.node.server")

State = Literal["stopped", "starting", "ready", "draining", "failed"]

MAX_BACKOFF_S = 60.0
STEADY_S = 60.0
"""A server ready this long before it died starts its back-off again from `restart_backoff_s`."""


class Group:
    """Servers of one node that share a GPU or its memory: at most `size` have a process at once."""

    def __init__(self, name: str, size: int | None) -> None:
        self.name = name
        self.size = size
        """None: no bound (a server outside any group)."""
        self.members: list[ManagedServer] = []
        self.lock = asyncio.Lock()
        """Held while one server makes room and starts: the others queue behind it, first come first."""
        self._changed = asyncio.Event()

    def notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def changed(self) -> None:
        await self._changed.wait()

    def running(self) -> list[ManagedServer]:
        return [m for m in self.members if m.has_process()]


class ManagedServer:
    """One adapter's model server on this node and the requests that use it."""

    def __init__(self, name: str, cfg: ServerSettings, group: Group, on_change: Callable[[], None]) -> None:
        self.name = name
        """Its providers' ids, for log lines."""
        self.cfg = cfg
        self.group = group
        group.members.append(self)
        self.on_change = on_change
        self.state: State = "stopped"
        self.since = time.time()
        self.proc: ServerProcess | None = None
        self._spawned: set[ServerProcess] = set()
        """Every process started and not yet seen stopped: what `close` ends, whatever a stop was doing."""
        self.active = 0
        """Requests running on it now."""
        self.waiting = 0
        """Requests waiting for it to be ready."""
        self.granted = 0
        """Requests let through since it last became ready: one at least before a swap may drain it."""
        self.last_used = time.monotonic()
        self.cold_starts = 0
        self.swaps = 0
        """Starts that had to stop another server of the group first."""
        self.crashes = 0
        self.last_cold_start_ms = 0.0
        self.closed = False
        self._stopping = False
        self._backoff_s = cfg.restart_backoff_s
        self._ready_at = 0.0
        self._start_failed: tuple[float, str] = (0.0, "")
        """When its latest start failed (monotonic) and why: the requests waiting for that start fail."""
        self._tasks: set[asyncio.Task[None]] = set()

    # --- what requests do ------------------------------------------------------------------------

    async def acquire(self) -> float:
        """Wait until the server is ready and count one request on it; the seconds it waited (0: warm).

        Starts the server (draining another of its group first when the group is full). Cancel it
        to give up waiting; `release` must follow every acquire that returned. Raises ServerNotReady
        (503) when a start it waited for failed: not ready within `start_timeout_s`, or the process
        exited first (the server is restarted after its back-off for whoever asks next).
        """
        began = time.monotonic()
        cold = False
        self.waiting += 1
        try:
            while True:
                if self.closed:
                    raise RuntimeError("the node is stopping")
                if self.state == "ready":
                    self.active += 1
                    self.granted += 1
                    self.last_used = time.monotonic()
                    if self.granted == 1:
                        self.group.notify()  # a server waiting to swap it out may now
                    return time.monotonic() - began if cold else 0.0
                cold = True
                failed_at, why = self._start_failed
                if failed_at >= began:
                    raise ServerNotReady(f"the model server of {self.name} {why}")
                if self.state == "stopped":
                    await self._start_when_room()
                    continue
                await self.group.changed()
        finally:
            self.waiting -= 1

    def release(self) -> None:
        self.active -= 1
        self.last_used = time.monotonic()
        if self.active == 0 and self.state == "draining":
            self._spawn(self._stop_now())

    # --- starting and stopping -------------------------------------------------------------------

    def has_process(self) -> bool:
        return self.state in ("starting", "ready", "draining")

    async def _start_when_room(self, *, demand: bool = True) -> None:
        """Start the server once its group has room; `demand`: a request waits for it (a cold start)."""
        g = self.group
        async with g.lock:
            swapped = False
            while self.state == "stopped" and g.size is not None and len(g.running()) >= g.size:
                victim = self._victim()
                if victim is not None:
                    log.info("[%s] group %s is full: draining %s to start this one", self.name, g.name, victim.name)
                    victim.drain()
                    swapped = True
                await g.changed()
            if self.state == "stopped" and not self.closed:
                if swapped:
                    self.swaps += 1
                if demand:
                    self.cold_starts += 1
                self._set("starting")
                self._spawn(self._run_start(time.monotonic()))

    def _victim(self) -> ManagedServer | None:
        """The least recently used ready server of the group that has served its waiters at least once."""
        ready = [m for m in self.group.members if m.state == "ready" and (m.granted > 0 or m.waiting == 0)]
        return min(ready, key=lambda m: m.last_used, default=None)

    def drain(self) -> None:
        """Take no new request; stop once the running ones have finished."""
        if self.state == "ready":
            self._set("draining")
            if self.active == 0:
                self._spawn(self._stop_now())

    async def _run_start(self, began: float) -> None:
        try:
            self.proc = await ServerProcess.spawn(self.name, self.cfg)
            self._spawned.add(self.proc)
        except OSError as exc:
            log.error("[%s] cannot start its server: %s", self.name, exc)
            self._failed()
            return
        proc = self.proc
        log.info("[%s] server started (pid %d)", self.name, proc.pid)
        exited = asyncio.create_task(proc.proc.wait())
        ready = asyncio.create_task(proc.ready())
        try:
            done, _ = await asyncio.wait(
                {exited, ready}, timeout=self.cfg.start_timeout_s, return_when="FIRST_COMPLETED"
            )
        finally:
            ready.cancel()
        if ready in done and not exited.done() and not ready.cancelled():
            self.last_cold_start_ms = round((time.monotonic() - began) * 1000, 3)
            self._ready_at = time.monotonic()
            self.granted = 0
            log.info("[%s] server ready after %.0f ms", self.name, self.last_cold_start_ms)
            self._set("ready")
            self._spawn(self._watch(proc, exited))
            if self.cfg.idle_stop_s is not None:
                self._spawn(self._idle_watch(proc))
            return
        exited.cancel()
        if self._stopping or self.closed:
            return
        if proc.proc.returncode is None:
            why = f"was not ready within its start_timeout_s ({self.cfg.start_timeout_s:g} s)"
        else:
            why = f"exited with {proc.proc.returncode} before it was ready"
        log.error("[%s] server %s: stopped", self.name, why)
        self._start_failed = (time.monotonic(), why)
        await proc.stop(self.cfg.stop_grace_s)  # its group too, whatever the leader did
        self._spawned.discard(proc)
        self._failed()

    async def _watch(self, proc: ServerProcess, exited: asyncio.Task[int]) -> None:
        code = await exited
        if self.proc is not proc or self._stopping or self.closed:
            return
        # Its running requests fail by themselves (the upstream connection breaks: a lost upstream).
        log.error("[%s] server died (exit %s)", self.name, code)
        await proc.stop(0.1)  # whatever it started in its group goes too
        self._spawned.discard(proc)
        self._failed()

    def _failed(self) -> None:
        self.crashes += 1
        self.proc = None
        if self._ready_at and time.monotonic() - self._ready_at >= STEADY_S:
            self._backoff_s = self.cfg.restart_backoff_s
        delay = self._backoff_s
        self._backoff_s = min(self._backoff_s * 2, MAX_BACKOFF_S)
        self._set("failed")
        log.warning("[%s] restarting its server in %gs", self.name, delay)
        self._spawn(self._restart_after(delay))

    async def _restart_after(self, delay: float) -> None:
        await asyncio.sleep(delay)
        if self.state != "failed" or self.closed:
            return
        self._set("stopped")
        if self.waiting or self.cfg.idle_stop_s is None:
            # Someone waits for it, or it is meant to run all the time: start it again now.
            self._spawn(self._start_when_room(demand=self.waiting > 0))

    async def _idle_watch(self, proc: ServerProcess) -> None:
        idle = self.cfg.idle_stop_s
        assert idle is not None
        while self.proc is proc and self.state == "ready":
            left = self.last_used + idle - time.monotonic()
            if self.active == 0 and self.waiting == 0 and left <= 0:
                log.info("[%s] idle for %gs: stopping its server", self.name, idle)
                self._set("draining")
                await self._stop_now()
                return
            await asyncio.sleep(max(left, 0.05) if self.active == 0 else idle)

    async def _stop_now(self) -> None:
        proc, self.proc = self.proc, None
        self._stopping = True
        try:
            if proc is not None:
                await proc.stop(self.cfg.stop_grace_s)
                self._spawned.discard(proc)
                log.info("[%s] server stopped", self.name)
        finally:
            self._stopping = False
            self._set("stopped")

    async def restart(self) -> None:
        """Drain, stop and start the server again (an operator's `iop provider restart`)."""
        while not self.closed:
            if self.state == "ready":
                self.drain()
            elif self.state in ("stopped", "failed"):
                self._set("stopped")
                self.start_soon()
                return
            await self.group.changed()

    def start_soon(self) -> None:
        """Start the server now if its group has room (else once it has), with no request waiting."""
        self._spawn(self._start_when_room(demand=False))

    async def retire(self) -> None:
        """Its adapter left the catalog: no new request; stop once the running ones have finished."""
        self.drain()
        while self.active and not self.closed:
            await self.group.changed()
        if self in self.group.members:
            self.group.members.remove(self)
        await self.close()

    async def close(self) -> None:
        """The node is leaving: stop the server and anything it started, now."""
        self.closed = True
        for t in list(self._tasks):
            t.cancel()
        self.proc = None
        grace = min(self.cfg.stop_grace_s, 5.0)
        await asyncio.gather(*(p.stop(grace) for p in self._spawned), return_exceptions=True)
        self._spawned.clear()
        self._set("stopped")

    # --- what others see -------------------------------------------------------------------------

    def _set(self, state: State) -> None:
        if state != self.state:
            self.state = state
            self.since = time.time()
            self.on_change()
        self.group.notify()

    def live(self) -> wire.ServerLive:
        return wire.ServerLive(
            state=self.state,
            since=self.since,
            pid=self.proc.pid if self.proc is not None else 0,
            group=self.group.name if self.group.size is not None else "",
            cold_starts=self.cold_starts,
            swaps=self.swaps,
            crashes=self.crashes,
            last_cold_start_ms=self.last_cold_start_ms,
        )

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        t = asyncio.create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)


class Servers:
    """Every managed server of a node, one per adapter with a `server:` block, and their groups."""

    def __init__(self, on_change: Callable[[], None]) -> None:
        self.by_adapter: dict[str, ManagedServer] = {}
        self.groups: dict[str, Group] = {}
        self.on_change = on_change

    def get(self, adapter: str, name: str, cfg: ServerSettings) -> ManagedServer:
        """The server of `adapter`, made when first asked; a changed `server:` block applies at its next start."""
        s = self.by_adapter.get(adapter)
        if s is not None:
            s.cfg, s.name = cfg, name
            return s
        if cfg.group is not None:
            group = self.groups.setdefault(cfg.group, Group(cfg.group, cfg.group_size))
            group.size = cfg.group_size
        else:
            group = Group(adapter, None)
        s = self.by_adapter[adapter] = ManagedServer(name, cfg, group, self.on_change)
        if cfg.idle_stop_s is None:
            s.start_soon()  # always on: start with the node
        return s

    def drop(self, adapter: str) -> asyncio.Task[None] | None:
        """Retire the server of an adapter that left the catalog (in the background)."""
        s = self.by_adapter.pop(adapter, None)
        return asyncio.create_task(s.retire()) if s is not None else None

    async def close(self) -> None:
        await asyncio.gather(*(s.close() for s in self.by_adapter.values()), return_exceptions=True)
