"""The edge's composition root: every part built once, each given its collaborators when it is made.

Only the app (iop/edge/app.py) and the process (iop/edge/process.py) import this module; every
other part of the edge sees only the few objects it was handed here, never `Edge`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import secrets
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from nats.aio.client import Client as NATS
from starlette.types import Scope

from iop import config, wire
from iop.contracts.refresh import RefreshResult
from iop.edge import http as edge_http
from iop.edge.api import ApiEndpoint
from iop.edge.bodies import BURST_MIB as BODY_BURST_MIB
from iop.edge.bodies import ReceivingBodies
from iop.edge.current import CurrentDeployment
from iop.edge.keys import EdgeKeys
from iop.edge.leases import TenantLeases
from iop.edge.ledger import LedgerWriter, ensure_ledger_stream
from iop.edge.lifecycle import Lifecycle
from iop.edge.limits import Limiter
from iop.edge.managed import ManagedKeys
from iop.edge.memory import BurstTrim
from iop.edge.metrics import Metrics
from iop.edge.observe import Observer
from iop.edge.qualification import QualifyDesk
from iop.edge.refresh import Refresher, publish_catalog
from iop.edge.registry import Registry
from iop.edge.relay import Relay
from iop.edge.routing import PoolRules
from iop.edge.scheduler import Scheduler
from iop.edge.status import StatusSources
from iop.edge.storage import WorkStream
from iop.edge.summary import SummaryCache
from iop.edge.tenants import Tenants
from iop.edge.ui import StatusFeed
from iop.nats import connection, streams
from iop.openai.compaction import Sealer
from iop.responses.caps import ResponseCaps
from iop.responses.expand import Responses
from iop.responses.store import ResponseStore, owner_of
from iop.responses.takeover import Takeover, new_runner
from iop.tracing import Tracing


class Edge:
    """One edge: its parts, built from a validated deployment and a NATS connection, started and stopped in order."""

    def __init__(
        self,
        deployment: config.Deployment,
        nc: NATS,
        *,
        edge_id: str | None = None,
        nats_url: str = "",
        keys: EdgeKeys | None = None,
        deployment_file: Path | None = None,
        authorize_nodes: Callable[[list[config.Node]], Awaitable[None]] | None = None,
        sealer: Sealer | None = None,
    ) -> None:
        """`deployment_file`: what SIGHUP reads again and drift is measured against; `authorize_nodes`:
        gives node users to the embedded nats-server when a refresh changes the nodes; `sealer`: seals
        iop's compaction items (a key of this process when not given)."""
        settings = deployment.edge
        self.edge_id = edge_id or secrets.token_hex(4)
        self.nats_url = nats_url
        self.nc = nc
        self.js = nc.jetstream()
        self.started_at = time.time()
        self.current = CurrentDeployment(deployment)
        """What every part reads the running deployment from; a refresh changes it in place."""
        self.nats_down = ""
        """Why the edge's own (embedded) NATS is down right now; empty while it runs."""
        self.fatal = ""
        """Set when the edge must stop with an error (its embedded NATS cannot be kept alive)."""
        h = settings.http
        self.http_limits = edge_http.HttpLimits(
            max_head_bytes=h.max_head_kb * 1024,
            max_headers=h.max_headers,
            head_timeout_s=h.head_timeout_s,
            body_idle_timeout_s=h.body_idle_timeout_s,
            max_connections=edge_http.connection_cap(h.max_connections),
        )
        # Every stream and bucket made in this edge's tasks (ledger, qualification) gets this many copies.
        streams.default_replicas.set(settings.nats.replicas)
        self.keys = keys if keys is not None else EdgeKeys.from_settings(settings)
        self.metrics_public = settings.metrics_public
        """Read once, like the keys: a refresh reports a change as needing a restart."""
        self.closing = asyncio.Event()
        """Set when the edge starts to stop: open streams (status pages, usage tails) end at once."""

        q = settings.queue
        self.scheduler = Scheduler(
            q.max_waiting, int(q.max_waiting_mb * 1024 * 1024), q.fair_queueing, q.standby, q.anticipate_ms / 1000
        )
        catalog = self.current.catalog
        for pid, ref in catalog.providers.items():
            if ref.provider.capacity is not None:
                self.scheduler.add_provider(pid, ref.node.id, ref.provider.capacity)
        rules = PoolRules.of(deployment)
        for alias, members in catalog.pools.items():
            self.scheduler.add_pool(alias, members)
            self.scheduler.pools[alias].rules = rules[alias]
        self.work_stream = WorkStream(self.js, self.current.capacities)
        self.relay = Relay(nc, self.js, self.edge_id, self.work_stream)
        self.registry = Registry(
            deployment,
            self.scheduler,
            self.edge_id,
            self.relay.node_lost,
            on_reconnected=self.relay.recovery.bus_reconnected,
            on_tick=self.relay.recovery.sweep,
        )
        self.refresher = Refresher(
            self.current, self.scheduler, self.registry, nc, self.js, authorize_nodes=authorize_nodes
        )
        if deployment_file is not None:
            self.refresher.started_from(deployment_file, deployment)
        self.ledger = (
            LedgerWriter(nc, self.js, self.edge_id, buffer_records=settings.ledger.buffer_records)
            if settings.ledger.enabled
            else None
        )
        self.tracing = Tracing(deployment.tracing, "iop-edge", self.edge_id)
        """Read once, like the keys: a refresh reports a change as needing a restart."""
        self.metrics = Metrics(
            self.scheduler,
            self.registry,
            self.ledger,
            nc,
            self.started_at,
            self.tracing,
            undecodable=(self.relay.undecodable,),
        )
        self.observer = Observer(self.edge_id, self.metrics, self.ledger)
        self.managed_keys = ManagedKeys()
        """Keys made by `iop keys`, from the KV bucket iop_keys; checked after the environment's."""
        # A copy: the EdgeKeys given may serve other edges (tests run several in one process).
        self.keys = dataclasses.replace(self.keys, lookups=[*self.keys.lookups, self.managed_keys.lookup])
        self.limits = Limiter()
        """Tenants' rpm, tpm and budgets, shared with the other edges in the KV bucket iop_limits."""
        self.limits.on_refusal = self.metrics.refused
        self.leases = TenantLeases(self.edge_id)
        """Tenants' max_concurrent, each edge's share of it held in the KV bucket iop_leases."""
        self.scheduler.leases = self.leases
        self.leases.on_bound = self.scheduler.lease_bound
        self.scheduler.router.server_of = self._server_of
        self.lifecycle = Lifecycle(self.scheduler, lambda: self.current.catalog, self.js, self.edge_id)
        """Drains by policy, by an operator, by a failed qualification; shared with the other edges."""
        self.qualify = QualifyDesk(self)
        self.sealer = sealer if sealer is not None else Sealer.random()
        """Seals iop's compaction items; `run_edge` derives it from the deployment's secret (docs/security.md)."""
        self.responses = Responses(None, ResponseCaps(lambda: self.current.deployment.edge.responses), self.sealer)
        self.metrics.registry.register(self.responses.caps)
        """Stored responses (iop/responses); its store opens at start when `edge.responses` is on."""
        self.status_sources = StatusSources(
            edge_id=self.edge_id,
            nats_url=nats_url,
            started_at=self.started_at,
            current=self.current,
            registry=self.registry,
            scheduler=self.scheduler,
            nc=nc,
            work_stream=self.work_stream,
            refresher=self.refresher,
            qualifications=self.qualify.summaries,
            limits=self.limits,
        )
        self.status_feed = StatusFeed(self.status_sources)
        """`/status/events`: the live status the `/ui` page reads."""
        self.summary = SummaryCache(self.status_sources)
        """`/status?view=summary`: built at most once per 0.25 s, whatever the number of readers."""
        self.burst_trim = BurstTrim(self.waiting_requests, self.scheduler.queued_high)
        """Hands the memory of a drained burst of waiting requests back to the OS (iop/edge/memory.py)."""
        self.bodies = ReceivingBodies(self.scheduler)
        """Request bodies being received, bounded with the waiting ones by edge.queue.max_waiting_mb."""
        self.body_trim = BurstTrim(self.bodies.mib, self.bodies.high, burst=BODY_BURST_MIB)
        """Hands the memory of a drained burst of large bodies back (counted in MiB, not requests)."""

    # What a request reads (api.py's `Serving`, qualification.py's `Qualified`): from `current`, so a refresh applies.

    @property
    def deployment(self) -> config.Deployment:
        return self.current.deployment

    @property
    def catalog(self) -> config.Catalog:
        return self.current.catalog

    @property
    def queue_timeout_s(self) -> float:
        return self.current.queue_timeout_s

    @property
    def max_body_bytes(self) -> int:
        return self.current.max_body_bytes

    @property
    def tenants(self) -> Tenants:
        return self.current.tenants

    def identify(self, scope: Scope) -> tuple[str, str]:
        """The client key's name and its tenant ("", "" when the edge has no keys); raises Unauthorized."""
        key = self.keys.client(scope)
        if key is None:
            return "", ""
        return key.name, key.tenant if key.tenant is not None else self.current.tenants.tenant_of_key(key.name)

    def authorize(self, scope: Scope) -> str:
        """Check the client key; returns its name for the ledger ("" when the edge has no keys)."""
        key = self.keys.client(scope)
        return key.name if key is not None else ""

    def owner(self, scope: Scope) -> str:
        """Whose stored responses this request reaches (iop/responses/store.py)."""
        key = self.keys.client(scope)
        return owner_of(key.secret if key is not None else None)

    def accepts(self, owner: str, key_id: str) -> bool:
        """The key whose stored responses are `owner`'s (managed: `key_id`) is one this edge still
        accepts: not revoked, expired, or gone from the environment's keys since."""
        if not self.keys.clients:
            return True  # client auth is off: anyone may
        if key_id:
            return self.managed_keys.holds(key_id)
        return any(owner_of(key.secret) == owner for key in self.keys.clients)

    def is_admin(self, scope: Scope) -> bool:
        return self.keys.holds_admin_key(scope)

    def admin(self, scope: Scope) -> str:
        return self.keys.admin(scope)

    async def refresh_to(self, new: config.Deployment) -> RefreshResult:
        return await self.refresher.apply(new)

    async def start(self) -> None:
        settings = self.current.deployment.edge
        dep = self.current.deployment
        # Each JetStream step waits (bounded) for what it needs: edges started together find
        # streams without a leader yet, or half made by another edge (streams.when_available).
        available = streams.when_available
        if self.ledger is not None:
            ledger = settings.ledger
            self.ledger.token = await available(
                "the ledger stream", lambda: ensure_ledger_stream(self.js, ledger.max_age, ledger.max_bytes)
            )
            self.ledger.start()
        await available("the limits bucket", lambda: self.limits.open(self.js, settings.nats.replicas, self.nc))
        await available("the leases bucket", lambda: self.leases.open(self.js, settings.nats.replicas))
        await available("the keys bucket", lambda: self.managed_keys.open(self.js, settings.nats.replicas))
        await available("the work stream", lambda: streams.ensure_work_stream(self.js, replicas=settings.nats.replicas))
        if settings.responses.enabled:
            replicas = settings.nats.replicas
            self.responses.store = await available(
                "the stored-responses bucket",
                lambda: ResponseStore.open(self.nc, settings.responses, replicas=replicas),
            )
            # Background responses of edges that are gone run here again (iop/responses/takeover.py).
            self.responses.runner = new_runner(self.edge_id)
            resume = ApiEndpoint(self, "responses").resume
            self.responses.takeover = Takeover(self.responses.store, self.responses.runner, resume, self.responses.lost)
            self.responses.takeover.start()
        for pid, capacity in self.current.capacities().items():
            await available(f"provider {pid}'s consumer", functools.partial(self._consumer, pid, capacity))
        await available("the catalog bucket", lambda: publish_catalog(self.nc, self.js, dep))
        await self.relay.start()
        await self.registry.start(self.nc)
        # Serving starts once the server has the reply and presence subscriptions.
        await connection.flush(self.nc)
        await available("the drains bucket", self.lifecycle.start)
        await available("the qualification bucket", self.qualify.start)
        self.burst_trim.start()
        self.body_trim.start()

    async def _consumer(self, provider: str, capacity: int) -> None:
        await streams.ensure_provider_consumer(self.js, provider, capacity)

    def _server_of(self, provider: str) -> wire.ServerLive | None:
        """The model server `provider`'s node runs for it, as its last heartbeat said (the router's cold start)."""
        ref = self.current.catalog.providers.get(provider)
        st = self.registry.nodes.get(ref.node.id) if ref is not None else None
        live = st.live.get(provider) if st is not None and st.connected else None
        return live.server if live is not None else None

    def waiting_requests(self) -> int:
        """Requests waiting in this edge's pool queues now."""
        return sum(len(pool.waiters) for pool in self.scheduler.pools.values())

    def readiness(self) -> list[str]:
        """Why this edge should not get traffic now; empty when ready."""
        reasons = []
        if not self.nc.is_connected or self.nats_down:
            reasons.append(self.nats_down or "not connected to NATS")
        if self.work_stream.error:
            reasons.append(self.work_stream.error)
        mono = time.monotonic()
        for alias, pool in self.scheduler.pools.items():
            if not any(p.connected and p.breaker(mono) != "open" for p in pool.providers):
                reasons.append(f"pool '{alias}' has no usable provider")
        return reasons

    def end_streams(self) -> None:
        """The edge starts to stop: open streams (status pages, usage tails) end now, or they would
        hold the graceful shutdown until its grace period is over."""
        self.closing.set()
        self.status_feed.close()

    async def stop(self) -> None:
        # The last requests' spans go out while the rest stops; a collector that is down costs the
        # export's timeout at most, in a thread.
        flushed = asyncio.create_task(asyncio.to_thread(self.tracing.shutdown))
        self.burst_trim.stop()
        self.body_trim.stop()
        await self.responses.stop()
        await self.qualify.stop()
        await self.lifecycle.stop()
        await self.registry.stop()
        await self.limits.drain()
        await self.leases.stop()
        await self.managed_keys.stop()
        if self.ledger is not None:
            await self.ledger.stop()
        await flushed
