"""Background responses outlive the edge that runs them: another edge (or the same one, restarted)
takes over the work of one that died, and the store keeps exactly one answer.

Beside a background response's record the edge keeps, in the response store:

- `w.<owner>.<id>`: the request as the endpoint took it, and the client key's name, tenant and
  managed id (for the ledger and the tenant's limits of a run elsewhere, and to check the key was
  not revoked meanwhile): what another edge needs to run it again;
- `l.<owner>.<id>`, its lease: the edge process that runs it (`runner`, unique to a process: a
  restarted edge is another runner) and how often it was taken over.

Every edge watches the leases. A lease whose runner does not answer the response's `since`
subject (iop/responses/live.py) in two probes STALE_S apart (its process is gone, and with it its
subscriptions), or that a stopping edge released (runner ""), is claimed by a compare-and-set on
the lease's revision: one edge wins and runs the request again, as the same key, through its
pool's queue like any request. The answer is kept only after its runner moved the lease to
`keeping`, a compare-and-set on the revision it wrote last: a runner that lost its lease (cut off
while another edge took over) learns so there and drops its answer, or sooner, when it sees the
lease change, and stops its run. A claimer finds the record of
a runner that died while keeping either finished (the lease is cleaned) or not (it runs again).
After MAX_TAKEOVERS runs a response is kept as failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable, Coroutine
from typing import Any

import msgspec
import nats.errors
import nats.js.errors

from iop.errors import Unavailable
from iop.responses import live
from iop.responses.store import ResponseStore

log = logging.getLogger("iop.responses")

SWEEP_S = 1.0
"""How often an edge looks for leases whose runner is gone."""
STALE_S = 3.0
"""How long a runner must stay unanswering before its leases are claimed (a reconnect is shorter)."""
MAX_TAKEOVERS = 3
"""Runs after the first one; then the response is kept as failed (a request that kills its edges)."""
_PROBE_S = 1.0
_REWATCH_S = 60.0


class Lease(msgspec.Struct):
    runner: str
    """The edge process running the response ("": released by an edge that stopped)."""
    takeovers: int = 0
    keeping: bool = False
    """Its runner is keeping the answer (no other may take it over for that answer)."""


class Work(msgspec.Struct):
    """What another edge needs to run a background response again."""

    request: dict[str, Any]
    key: str = ""
    tenant: str = ""
    key_id: str = ""
    """A managed key's id ("" for the environment's keys): a run elsewhere checks it was not revoked."""


_lease = msgspec.json.Decoder(Lease).decode
_work = msgspec.json.Decoder(Work).decode
_encode = msgspec.json.Encoder().encode


def new_runner(edge_id: str) -> str:
    """This edge process's name in leases: a restarted edge with the same id is another runner."""
    return f"{edge_id}-{secrets.token_hex(4)}"


class Held:
    """A lease this edge process holds, changed only by compare-and-set on the revision it wrote."""

    def __init__(self, store: ResponseStore, owner: str, response_id: str, revision: int, lease: Lease) -> None:
        self.store = store
        self.owner = owner
        self.response_id = response_id
        self.revision = revision
        self.lease = lease
        self.lost = False
        """Another edge took it over: this edge's answer is not kept."""
        self.released = False

    @property
    def key(self) -> str:
        return f"l.{self.owner}.{self.response_id}"

    async def _set(self, lease: Lease) -> bool:
        try:
            self.revision = await self.store.kv.update(self.key, _encode(lease), last=self.revision)
        except nats.js.errors.KeyWrongLastSequenceError:
            self.lost = True
            return False
        self.lease = lease
        return True

    async def commit(self) -> bool:
        """Whether this edge may keep the answer (it still holds the lease, now marked `keeping`)."""
        if self.lost or self.released:
            return False
        try:
            return await self._set(msgspec.structs.replace(self.lease, keeping=True))
        except (nats.errors.Error, TimeoutError) as exc:
            log.warning("background %s: lease not marked: %s", self.response_id, type(exc).__name__)
            return True  # the store is out of reach: keeping the answer is tried (and logged) as ever

    async def release(self) -> None:
        """This edge stops: another edge takes the response over at once."""
        if self.lost or self.released:
            return
        try:
            await self._set(msgspec.structs.replace(self.lease, runner="", keeping=False))
        except (nats.errors.Error, TimeoutError) as exc:
            log.warning("background %s: lease not released: %s", self.response_id, type(exc).__name__)
        self.released = True

    async def end(self) -> None:
        """The response ended here: its lease and work record go."""
        if self.lost or self.released:
            return
        try:
            await self.store.kv.delete(self.key, last=self.revision)
            await self.store.forget_work(self.owner, self.response_id)
        except (nats.js.errors.KeyWrongLastSequenceError, nats.errors.Error, TimeoutError, Unavailable) as exc:
            log.warning("background %s: lease not ended: %s", self.response_id, type(exc).__name__)


async def hold(store: ResponseStore, owner: str, response_id: str, runner: str, work: Work) -> Held:
    """Keep the work record and take the lease of a new background response."""
    await store.keep_work(owner, response_id, _encode(work))
    lease = Lease(runner)
    try:
        revision = await store.kv.create(f"l.{owner}.{response_id}", _encode(lease))
    except (nats.errors.Error, TimeoutError) as exc:
        raise Unavailable(
            f"the response store cannot be reached now ({type(exc).__name__}); try again",
            code="response_store_unavailable",
        ) from exc
    return Held(store, owner, response_id, revision, lease)


async def work_of(store: ResponseStore, owner: str, response_id: str) -> Work | None:
    raw = await store.work(owner, response_id)
    if raw is None:
        return None
    try:
        return _work(raw)
    except msgspec.DecodeError:
        return None


Resume = Callable[[Held], Coroutine[Any, Any, None]]
"""The edge runs a claimed response again (iop/edge/api.py `ApiEndpoint.resume`)."""


class Takeover:
    """Watches every lease; claims those whose runner is gone and hands them to `resume`."""

    def __init__(
        self, store: ResponseStore, runner: str, resume: Resume, lost: Callable[[str], None] | None = None
    ) -> None:
        self.store = store
        self.runner = runner
        self.resume = resume
        self.lost = lost
        """Told the id of a response this edge ran that another edge took over (this one was cut off)."""
        self.leases: dict[str, tuple[int, Lease]] = {}
        self.suspects: dict[str, float] = {}
        self.unreadable: set[str] = set()
        """Keys whose entry was not a lease (logged once)."""
        """Leases whose runner did not answer, since when (monotonic)."""
        self.claimed: set[asyncio.Task[None]] = set()
        self.tasks: list[asyncio.Task[None]] = []
        self.watching = asyncio.Event()
        """Set once the watcher has every lease there was when it started."""

    def start(self) -> None:
        self.tasks = [asyncio.create_task(self._watch()), asyncio.create_task(self._sweeps())]

    async def stop(self) -> None:
        for task in (*self.tasks, *self.claimed):
            task.cancel()
        await asyncio.gather(*self.tasks, *self.claimed, return_exceptions=True)

    async def _watch(self) -> None:
        while True:
            try:
                watcher = await self.store.kv.watch("l.*.*")
            except (nats.errors.Error, TimeoutError) as exc:
                log.warning("background leases not watched: %s", type(exc).__name__)
                await asyncio.sleep(SWEEP_S)  # the store is out of reach: try again
                continue
            # Each watch starts from every lease there is: one deleted meanwhile is not kept.
            self.watching.clear()
            self.leases = {}
            try:
                while True:
                    try:
                        entry = await watcher.updates(timeout=_REWATCH_S)
                    except nats.errors.TimeoutError:
                        break  # quiet: watch anew (a watch can end unseen, with its server)
                    if entry is None:
                        self.watching.set()
                        continue
                    self._heard(entry)
            except nats.errors.Error as exc:
                log.warning("background leases' watch ended: %s", type(exc).__name__)
            finally:
                with contextlib.suppress(nats.errors.Error, TimeoutError):
                    await watcher.stop()

    def _heard(self, entry: Any) -> None:
        key = str(entry.key)
        if entry.operation in ("DEL", "PURGE"):
            self.leases.pop(key, None)
            self.suspects.pop(key, None)
            return
        before = self.leases.get(key)
        try:
            lease = _lease(entry.value or b"")
            foreign = False
        except msgspec.DecodeError:
            # Not a lease (a node can have the JetStream server store its answers here, see
            # docs/security.md): its runner can no longer keep the answer (the revision moved), so
            # it is claimed as a released one, and its run here stops.
            if key not in self.unreadable:
                self.unreadable.add(key)
                log.warning("background lease %s is unreadable: taken over", key)
            lease, foreign = Lease("", before[1].takeovers if before is not None else 0), True
        else:
            self.unreadable.discard(key)
        self.leases[key] = (int(entry.revision), lease)
        mine = before is not None and before[1].runner == self.runner
        taken = mine and (foreign or lease.runner not in ("", self.runner))
        if taken and self.lost is not None:
            self.lost(key.split(".")[2])  # its run here stops: the other edge's answer is kept
        self.suspects.pop(key, None)  # a lease that changed has a runner that just wrote it

    async def _sweeps(self) -> None:
        while True:
            await self.watching.wait()
            try:
                await self.sweep()
            except (nats.errors.Error, TimeoutError, Unavailable) as exc:
                log.warning("background takeover: %s", type(exc).__name__)
            await asyncio.sleep(SWEEP_S)  # the next look, not a synchronisation

    async def sweep(self) -> None:
        """Claim the leases released or left by a gone runner (a probe per runner, then per lease)."""
        now = time.monotonic()
        by_runner: dict[str, list[str]] = {}
        for key, (_, lease) in list(self.leases.items()):
            if lease.runner == self.runner:
                continue
            if not lease.runner:
                await self._claim(key)
            else:
                by_runner.setdefault(lease.runner, []).append(key)
        for keys in by_runner.values():
            if await live.answers(self.store.nc, keys[0].split(".")[2], _PROBE_S) is not False:
                for key in keys:
                    self.suspects.pop(key, None)
                continue
            for key in keys:
                alive = await live.answers(self.store.nc, key.split(".")[2], _PROBE_S)
                if alive is not False:
                    self.suspects.pop(key, None)
                elif now - self.suspects.setdefault(key, now) >= STALE_S:
                    await self._claim(key)

    async def _claim(self, key: str) -> None:
        held = self.leases.get(key)
        if held is None:
            return
        revision, lease = held
        _, owner, response_id = key.split(".")
        claimed = Lease(self.runner, lease.takeovers + 1)
        try:
            revision = await self.store.kv.update(key, _encode(claimed), last=revision)
        except nats.js.errors.KeyWrongLastSequenceError:
            return  # another edge claimed it first
        self.leases[key] = (revision, claimed)
        self.suspects.pop(key, None)
        log.info("background %s: taken over from %s", response_id, lease.runner or "a stopped edge")
        task = asyncio.create_task(self._resume(Held(self.store, owner, response_id, revision, claimed)))
        self.claimed.add(task)
        task.add_done_callback(self.claimed.discard)

    async def _resume(self, held: Held) -> None:
        try:
            await self.resume(held)
        except Exception as exc:  # the store out of reach, above all: any edge claims it again (counted)
            log.warning("background %s: not taken over: %s", held.response_id, type(exc).__name__)
            await held.release()
