"""A running node: its lifecycle, and the catalog it serves (changed while serving when the edge says so)."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Coroutine
from typing import Any

import nats.errors
from nats.aio.client import Client as NATS

from iop import config, wire
from iop.nats import auth, connection, inline
from iop.nats.access import NatsAccess
from iop.node import adapters, device, direct, fetch, policy
from iop.node.adapters.base import Adapter
from iop.node.catalog import CatalogSource, differences
from iop.node.control import Controls
from iop.node.flow import STALL_TIMEOUT_S
from iop.node.presence import Lease, Presence
from iop.node.resource import Resource, kind_of
from iop.node.running import Running, RunningRequests
from iop.node.servers import ManagedServer, Servers
from iop.tracing import Tracing
from iop.tracingconf import TracingSettings

log = logging.getLogger("iop.node")


class NodeRuntime:
    """Serves one node's catalog over NATS. There is no node-wide limit of any kind.

    The parts: `Presence` (hello, heartbeats), `fetch` (a provider's fetch loops), `direct` (a CLI
    resource's subscription) and `RunningRequests` (what runs, its flow window, cancels, probes).
    """

    def __init__(
        self,
        deployment: config.Deployment | None,
        node_id: str,
        nats_url: str,
        *,
        access: NatsAccess | None = None,
        follow_edge: bool = True,
        node_policy: policy.NodePolicy | None = None,
    ) -> None:
        """`deployment` None: take the catalog from the edge (the iop_catalog bucket) at start.

        With a deployment, the node starts from its section and, if `follow_edge`, switches to the
        edge's section when one exists and follows it from then on.
        """
        self.node_id = node_id
        self.node = deployment.node(node_id) if deployment is not None else config.Node(id=node_id)
        self.from_file = deployment is not None
        # What this machine's operator allows: given, else exactly what the local file names, else
        # nothing but mock adapters (a node without a file runs no command it was not allowed).
        self.policy = node_policy or (policy.NodePolicy.of_node(self.node) if self.from_file else policy.NodePolicy())
        self.refused: dict[str, policy.Refused] = {}
        """Catalog entries the policy refused: reported in heartbeats, never served."""
        self.follow_edge = follow_edge
        self.nats_url = nats_url
        self.access = access
        self.instance = secrets.token_hex(6)
        self.tracing = Tracing(deployment.tracing if deployment is not None else TracingSettings(), "iop-node", node_id)
        """This machine's: the deployment's `tracing` section and the OTEL_* variables, read once at start."""
        self.lease = Lease()
        """This process may take work for the node id (presence.py): ends when the edge says it was replaced."""
        self.started_at = time.time()
        self.nc: NATS | None = None
        self._adapters: dict[str, Adapter] = {}
        self._adapter_cfgs: dict[str, config.Adapter] = {}
        self._old_adapters: list[Adapter] = []
        self.resources: dict[str, Resource] = {}
        self._running: RunningRequests | None = None
        self._presence: Presence | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._stall_timeout_s = STALL_TIMEOUT_S
        self._probe_interval_s = wire.PROBE_INTERVAL_S
        self.changed = asyncio.Event()
        """Set when a request starts, ends, or waits for credit, when a new catalog is applied, and
        when a model server changes state (observers clear it, then wait)."""
        self.servers = Servers(self.changed.set)
        """The model servers this node runs itself (adapters with a `server:` block)."""

    def requests(self) -> list[Running]:
        """The requests running now (status, tests)."""
        return list(self._running.by_id.values()) if self._running is not None else []

    @property
    def stall_timeout_s(self) -> float:
        """How long a request may wait for credit before it fails as stalled (tests lower it)."""
        return self._stall_timeout_s

    @stall_timeout_s.setter
    def stall_timeout_s(self, value: float) -> None:
        self._stall_timeout_s = value
        if self._running is not None:
            self._running.stall_timeout_s = value

    @property
    def probe_interval_s(self) -> float:
        """How often the edge of a running request is asked whether it still wants it (tests lower it)."""
        return self._probe_interval_s

    @probe_interval_s.setter
    def probe_interval_s(self, value: float) -> None:
        self._probe_interval_s = value
        if self._running is not None:
            self._running.probe_interval_s = value

    # --- lifecycle ------------------------------------------------------------------------------

    async def start(self, *, connect_wait_s: float | None = None, catalog_wait_s: float = 60.0) -> None:
        self.nc = await connection.connect(
            self.nats_url,
            f"iop-node-{self.node_id}",
            access=self.access,
            wait_s=connect_wait_s,
            # Inboxes only this node may subscribe to (its NATS permissions say so).
            inbox_prefix=auth.node_inbox_prefix(self.node_id),
        )
        running = self._running = RunningRequests(self.nc, self.node_id, self.instance, self.changed)
        running.stall_timeout_s, running.probe_interval_s = self._stall_timeout_s, self._probe_interval_s
        running.lease = self.lease
        running.tracing = self.tracing
        presence = self._presence = Presence(
            self.nc,
            self.node_id,
            self.instance,
            self.started_at,
            lambda: (self.node, [*self.resources.values(), *self.refused.values()]),
            self.lease,
        )
        self.catalog = CatalogSource(self.nc, self.node_id)
        if not self.from_file:
            self.node = await self.catalog.wait_first(catalog_wait_s)
        elif self.follow_edge:
            got = await self.catalog.get()
            if got is not None:
                self.catalog.revision, edge_node = got
                if edge_node != self.node:
                    log.warning(
                        "node %s: the edge's catalog differs from the local file (%s); following the edge",
                        self.node_id,
                        differences(self.node, edge_node),
                    )
                    self.node = edge_node
        # Once per process, off the event loop: it may run nvidia-smi or sysctl (each time-bounded).
        presence.device = await asyncio.to_thread(device.gather)
        await presence.hello()
        # What an edge says of a running request, read as it comes (iop/nats/inline.py) and so in
        # wire order with the work items themselves: a cancel, a request's body parts (held up to
        # `max_bytes`), the answer's credit, the replies it has whole.
        await inline.subscribe(self.nc, wire.cancel_subject(self.node_id), running.on_cancel)
        await inline.subscribe(self.nc, wire.body_subject(self.node_id), running.bodies.on_part)
        await inline.subscribe(self.nc, wire.credit_subject(self.node_id), running.on_credit)
        await inline.subscribe(self.nc, wire.received_subject(self.node_id), running.on_received)
        await self.nc.subscribe(wire.resend_subject(self.node_id), cb=running.on_resend)
        controls = Controls(self.node_id, lambda: self.resources)
        await self.nc.subscribe(wire.control_subject(self.node_id), cb=controls.on_control)
        await self._apply(self.node)
        # "Started" means the server has our subscriptions, not that they are still in our buffer.
        await connection.flush(self.nc, 5)
        self._spawn(presence.heartbeat_loop())
        self._spawn(running.progress_loop())
        self._spawn(running.probe_loop())
        if self.follow_edge:
            self._spawn(self.catalog.follow(self.apply_catalog))
        await presence.heartbeat()
        pool = [r for r in self.resources.values() if r.kind == "pool"]
        log.info(
            "node %s serving %d providers, %d CLI resources (instance %s)",
            self.node_id,
            len(pool),
            len(self.resources) - len(pool),
            self.instance,
        )

    async def apply_catalog(self, node: config.Node) -> None:
        """Switch to a new catalog while serving: running requests finish where they run."""
        assert self._presence is not None
        await self._apply(node)
        self.changed.set()  # capacities and peaks may have moved: whoever waits on them looks again
        await self._presence.heartbeat()

    async def _apply(self, node: config.Node) -> None:
        assert self.nc is not None and self._running is not None
        self.node = node
        refusals = {a.id: why for a in node.adapters if (why := self.policy.refusal(a)) is not None}
        refused = {
            p.id: policy.Refused(p, "cli" if kind_of(node, p) == "cli" else "pool", refusals[p.adapter])
            for p in node.providers
            if p.adapter in refusals
        }
        for pid, no in refused.items():
            if pid not in self.refused or self.refused[pid].reason != no.reason:
                log.warning(
                    "node %s: refused %s (adapter %s): %s by this node's policy",
                    self.node_id,
                    pid,
                    no.provider.adapter,
                    no.reason,
                )
        self.refused = refused
        new_cfgs = {a.id: a for a in node.adapters if a.id not in refusals}
        for aid, cfg in new_cfgs.items():
            if self._adapter_cfgs.get(aid) != cfg:
                if aid in self._adapters:
                    self._old_adapters.append(self._adapters[aid])  # closed at stop: requests may still use it
                self._adapters[aid] = adapters.build(cfg)
                self._adapter_cfgs[aid] = cfg
        for aid in list(self._adapters):
            if aid not in new_cfgs:
                self._old_adapters.append(self._adapters.pop(aid))
                del self._adapter_cfgs[aid]
        for aid in list(self.servers.by_adapter):
            now = new_cfgs.get(aid)
            if not isinstance(now, config.OpenAIAdapter) or now.server is None:
                retiring = self.servers.drop(aid)  # its running requests finish first
                if retiring is not None:
                    self._tasks.add(retiring)
                    retiring.add_done_callback(self._tasks.discard)
        wanted = {p.id: p for p in node.providers if p.id not in refused}
        for pid, gone in list(self.resources.items()):
            p = wanted.get(pid)
            if p is None or kind_of(node, p) != gone.kind:
                await self._retire(gone)
                del self.resources[pid]
        for pid, p in wanted.items():
            adapter = self._adapters[p.adapter]
            existing = self.resources.get(pid)
            server = self._server_of(node, p)
            if existing is None:
                fresh = self.resources[pid] = Resource(cfg=p, adapter=adapter, kind=kind_of(node, p), server=server)
                await self._serve(fresh)
                continue
            r = existing
            r.server = server
            before = r.cfg.capacity or 0
            if p.capacity != r.cfg.capacity:
                # The peak is measured against a capacity: a new capacity starts a new peak (from
                # what runs now), so a lowered one is not judged by what the old one allowed.
                r.peak_in_flight = r.in_flight
            r.cfg, r.adapter = p, adapter
            if r.kind == "pool" and (p.capacity or 0) > before:
                # One fetch loop per slot: more slots, more loops (fewer: the extra loops end).
                r.workers += fetch.start_workers(self._running, r, range(before, p.capacity or 0))

    def _server_of(self, node: config.Node, p: config.Provider) -> ManagedServer | None:
        cfg = self._adapter_cfgs.get(p.adapter)
        if not isinstance(cfg, config.OpenAIAdapter) or cfg.server is None:
            return None
        name = ",".join(q.id for q in node.providers if q.adapter == p.adapter)
        return self.servers.get(p.adapter, name, cfg.server)

    async def _serve(self, r: Resource) -> None:
        assert self._running is not None
        if r.kind == "cli":
            r.sub = await direct.subscribe(self._running, r)
            return
        assert r.cfg.capacity is not None
        # The edge makes the provider's consumer (at its start, and in a refresh that adds it): a
        # node's own NATS account reaches only that consumer's pulls and acks. Until it exists the
        # fetch loops find nothing and keep asking.
        # One fetch loop per slot, each pulling on an inbox of its own (see fetch.fetch_loop).
        r.workers = fetch.start_workers(self._running, r, range(r.cfg.capacity))

    async def _retire(self, r: Resource) -> None:
        """Stop taking work for a resource the catalog no longer has; what runs, finishes."""
        r.retired = True
        if r.sub is not None:
            try:
                await r.sub.unsubscribe()
            except nats.errors.Error as exc:  # closed or reconnecting: the subscription is gone either way
                log.debug("node %s: unsubscribing %s: %s", self.node_id, r.cfg.id, exc)
        log.info("node %s: %s left the catalog (finishing %d running)", self.node_id, r.cfg.id, r.in_flight)

    def cut_short(self) -> int:
        """Cancel every running request now (a second Ctrl-C during `stop`); how many there were."""
        runs = list(self._running.by_id.values()) if self._running is not None else []
        for run in runs:
            if run.task is not None:
                run.task.cancel()
        return len(runs)

    async def stop(self, grace_s: float = 30.0) -> None:
        """Stop taking work, let running items finish up to `grace_s`, fail the rest, leave."""
        if self._running is not None:
            self._running.stopping = True
            if self.lease.state == "replaced":
                # Another instance serves this id now: what runs here would run beside its work.
                await self._running.finish(0)
        workers = [w for r in self.resources.values() for w in r.workers]
        if workers:
            # Fetches are never cancelled (a cancelled pull request can swallow a message): they
            # time out within FETCH_TIMEOUT_S and the loops end by themselves.
            await asyncio.wait(workers, timeout=fetch.FETCH_TIMEOUT_S * 3)
        if self._running is not None:
            await self._running.finish(grace_s)
        for t in list(self._tasks):
            t.cancel()
        await self.servers.close()  # every server's process group ends with the node
        if self.nc is not None and self.nc.is_connected and self._presence is not None and self.lease.state == "live":
            try:
                await self._presence.heartbeat(leaving=True)
            except (nats.errors.Error, OSError) as exc:
                # The edge then declares the node lost after missed heartbeats instead of at once.
                log.debug("node %s: last heartbeat not sent: %s", self.node_id, exc)
        if self.nc is not None:
            # Not drain(): it waits out every idle pull request. All work has ended; flush and go.
            try:
                await connection.flush(self.nc, 2)
            except (nats.errors.Error, OSError) as exc:
                log.debug("node %s: final flush: %s", self.node_id, exc)
            await connection.close(self.nc)
        for a in [*self._adapters.values(), *self._old_adapters]:
            await a.close()
        await asyncio.to_thread(self.tracing.shutdown)  # the last items' spans; bounded, in a thread

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        t = asyncio.create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t
