"""Changing a running deployment: the refresh transaction.

`iop refresh` (through `/admin/refresh`) and SIGHUP both end in `Refresher`; what it changes is
`iop.contracts.refresh.diff`, also what `iop refresh --dry-run` prints.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from pathlib import Path
from typing import Any

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js.client import JetStreamContext

from iop import config, wire
from iop.contracts.refresh import RefreshResult, diff
from iop.edge.current import CurrentDeployment
from iop.edge.registry import Registry
from iop.edge.routing import PoolRules
from iop.edge.scheduler import Scheduler
from iop.errors import BusError, ConfigError
from iop.nats import streams

log = logging.getLogger("iop.edge")


def node_section(dep: config.Deployment, node_id: str) -> bytes:
    """The part of the deployment one node runs from, as published to the catalog bucket."""
    return msgspec.json.encode(dep.node(node_id))


_BROKER_ERRORS = (nats.errors.Error, OSError)
"""What talking to JetStream raises: nats errors, timeouts, a lost connection."""


async def publish_catalog(nc: NATS, js: JetStreamContext, dep: config.Deployment, removed: Iterable[str] = ()) -> None:
    """Each node's section of the deployment, one KV key per node, for nodes run without a file."""
    kv = await streams.catalog_bucket(js, replicas=dep.edge.nats.replicas)
    for node in dep.nodes:
        section = node_section(dep, node.id)
        try:
            current = await kv.get(node.id)
        except nats.js.errors.KeyNotFoundError:
            current = None
        if current is None or current.value != section:
            await kv.put(node.id, section)
            await nc.publish(wire.catalog_subject(node.id), b"")  # the node re-reads its key
    for node_id in removed:
        try:
            await kv.delete(node_id)
        except _BROKER_ERRORS as exc:
            # The node is out of the edge's tables already; a stale key only lets it start again.
            log.warning("refresh: catalog key of removed node %s not deleted: %s", node_id, exc)


class Refresher:
    """Applies a new deployment to a running edge without a restart, one refresh at a time.

    Broker changes come first (they can fail; each is undone if a later one does), then the
    catalog bucket, then the edge's own tables in one synchronous step.
    """

    def __init__(
        self,
        current: CurrentDeployment,
        scheduler: Scheduler,
        registry: Registry,
        nc: NATS,
        js: JetStreamContext,
        *,
        authorize_nodes: Callable[[list[config.Node]], Awaitable[None]] | None = None,
    ) -> None:
        self.current = current
        self.scheduler = scheduler
        self.registry = registry
        self.nc = nc
        self.js = js
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()
        self.file: Path | None = None
        """The deployment file the edge was started from (SIGHUP and a restart read it again)."""
        self.file_deployment: config.Deployment | None = None
        """What that file said when last read."""
        self.drift: list[str] = []
        """How the running deployment differs from the file (refreshes applied from elsewhere): a
        restart or SIGHUP would undo exactly these changes, so status and the log say so."""
        self.authorize_nodes = authorize_nodes
        """Gives NATS users and permissions to a node list (the edge's embedded server), if set."""

    def started_from(self, path: Path, dep: config.Deployment) -> None:
        self.file, self.file_deployment = path, dep
        self.drift = []

    def _check_drift(self) -> None:
        if self.file_deployment is None:
            return
        self.drift = [c.line() for c in diff(self.file_deployment, self.current.deployment)]
        if self.drift:
            log.warning(
                "the running deployment differs from %s (%d changes: %s); a restart or SIGHUP reads the file "
                "again and undoes them: write them there to keep them",
                self.file,
                len(self.drift),
                "; ".join(self.drift),
            )

    async def apply(self, new: config.Deployment, *, dry_run: bool = False) -> RefreshResult:
        """Diff the running deployment against `new` and, unless `dry_run`, apply it."""
        changes = diff(self.current.deployment, new)
        result = RefreshResult(changes=[c.line() for c in changes])
        if dry_run or not changes:
            return result
        async with self._lock:
            old_dep, old_cat = self.current.deployment, self.current.catalog
            new_cat = config.Catalog.of(new)
            undo: list[tuple[str, int | None]] = []
            try:
                for pid, ref in new_cat.providers.items():
                    cap = ref.provider.capacity
                    before = old_cat.providers.get(pid)
                    before_cap = before.provider.capacity if before is not None else None
                    if cap is not None and cap != before_cap:
                        await streams.ensure_provider_consumer(self.js, pid, cap)
                        undo.append((pid, before_cap))
                        result.applied.append(f"consumer {wire.consumer_name(pid)}: max_ack_pending {cap}")
                kept = {m.id for m in new.nodes}
                removed_nodes = [n.id for n in old_dep.nodes if n.id not in kept]
                if removed_nodes:
                    # Before their NATS users go: told, a removed node waits quietly for its id
                    # to come back instead of retrying refused credentials blind.
                    await self.registry.tell_removed(removed_nodes)
                if self.authorize_nodes is not None:
                    # New nodes get their NATS users before their catalog exists; a removed node
                    # loses its user. A node's old section stays in the union so that a provider
                    # being retired can still ack what it runs (until the edge restarts).
                    await self.authorize_nodes([*new.nodes, *(n for n in old_dep.nodes if n.id in kept)])
                    result.applied.append("nats: node users and permissions reloaded")
                await publish_catalog(self.nc, self.js, new, removed_nodes)
                result.applied.append("catalog bucket: node sections published")
            except (*_BROKER_ERRORS, BusError) as exc:
                result.error = f"{type(exc).__name__}: {exc}"
                await self._undo(undo)
                result.rolled_back = True
                log.error("refresh failed, rolled back: %s", result.error)
                return result
            # From here on nothing awaits: requests see the old catalog or the new one, never a mix.
            draining = self.switch(new, new_cat)
            result.applied.append("edge: pools, providers and routes switched")
            for pid, ref in old_cat.providers.items():
                if pid not in new_cat.providers and ref.provider.capacity is not None:
                    self._spawn(self._retire_consumer(pid))
            if draining:
                result.applied.append(f"draining: {', '.join(draining)}")
            log.info("refresh applied: %d changes", len(changes))
            self._check_drift()
            result.drift = list(self.drift)
            return result

    def switch(self, new: config.Deployment, catalog: config.Catalog) -> list[str]:
        """Serve `new` from now on, in one synchronous step; returns the providers left draining."""
        self.current.replace(new, catalog)
        self.scheduler.max_waiting = new.edge.queue.max_waiting
        self.scheduler.max_waiting_bytes = int(new.edge.queue.max_waiting_mb * 1024 * 1024)
        self.scheduler.fair = new.edge.queue.fair_queueing
        self.scheduler.standby = new.edge.queue.standby
        self.scheduler.anticipate_s = new.edge.queue.anticipate_ms / 1000
        draining = self.scheduler.apply(
            {
                pid: (ref.node.id, ref.provider.capacity)
                for pid, ref in catalog.providers.items()
                if ref.provider.capacity is not None
            },
            catalog.pools,
        )
        rules = PoolRules.of(new)
        for alias, pool in self.scheduler.pools.items():
            pool.rules = rules.get(alias, PoolRules())
        self.registry.apply(new)
        return draining

    async def _undo(self, undo: list[tuple[str, int | None]]) -> None:
        for pid, before_cap in reversed(undo):
            try:
                if before_cap is None:
                    await self.js.delete_consumer(wire.WORK_STREAM, wire.consumer_name(pid))
                else:
                    await streams.ensure_provider_consumer(self.js, pid, before_cap)
            except _BROKER_ERRORS as exc:
                log.error("refresh rollback: consumer of %s not restored: %s", pid, exc)

    async def _retire_consumer(self, provider: str) -> None:
        # A removed provider finishes what it runs; its consumer goes once nothing is in flight.
        scheduler = self.scheduler
        while (slot := scheduler.providers.get(provider)) is not None and slot.removed:
            scheduler.changed.clear()
            await scheduler.changed.wait()
        if provider in self.current.catalog.providers:
            return  # re-added meanwhile
        try:
            await self.js.delete_consumer(wire.WORK_STREAM, wire.consumer_name(provider))
        except _BROKER_ERRORS as exc:
            # Harmless left behind: nobody publishes to its subject any more.
            log.warning("refresh: consumer of removed provider %s not deleted: %s", provider, exc)

    def reload(self, path: Path) -> None:
        """SIGHUP: read the deployment file again and apply what changed, in the background."""
        self._spawn(self._reload(path))

    async def _reload(self, path: Path) -> None:
        try:
            new = config.load(path).deployment
        except ConfigError as exc:
            log.error("SIGHUP: %s is invalid, nothing applied: %s", path, "; ".join(exc.problems))
            return
        if self.drift:
            log.warning("SIGHUP: going back to %s undoes the refreshes applied from elsewhere", path)
        self.started_from(path, new)
        result = await self.apply(new)
        self._check_drift()  # also when the apply failed: then the file and the edge differ
        log.info("SIGHUP: %s", "; ".join(result.changes) or "no changes")

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
