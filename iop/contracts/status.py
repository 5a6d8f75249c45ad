"""The `GET /status` document as msgspec Structs: the edge encodes them, every reader decodes them.

The edge builds it (iop/edge/status.py); `iop status`, `iop smoke` and the tests read it through
`decode_status`, never as untyped JSON. A field added later gets a default, so that a newer
reader still decodes an older edge's document.
"""

from __future__ import annotations

import msgspec

from iop.wire import Device, ServerLive


class EdgeInfo(msgspec.Struct, kw_only=True):
    """The edge answering: who it is and whether it reaches NATS."""

    id: str
    version: str
    uptime_s: float
    nats: str
    """The NATS URL the edge uses (the embedded server's own URL when embedded)."""
    nats_connected: bool
    drift: list[str] = msgspec.field(default_factory=list)
    """How the running deployment differs from the file the edge was started from (refreshes applied
    from another file); a restart or SIGHUP would undo these."""
    storage_error: str | None = None
    """Why the work stream cannot take pool requests now (every pool request fails with 503 bus_error)."""


class QualificationSummary(msgspec.Struct, kw_only=True):
    """The latest `iop qualify` result of a provider, as the edge keeps it (KV bucket `iop_qualify`)."""

    date: str
    """When the run finished, ISO 8601 UTC."""
    verdict: str
    """One line: the recommendation against the configured capacity, or why there is none."""
    recommended_capacity: int | None = None
    configured_capacity: int | None = None
    checks_passed: int = 0
    checks_failed: int = 0
    device: str | None = None
    """The node's machine as its hello described it, when known."""
    model: str | None = None


class ResourceStatus(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What every catalog entry shows, provider or CLI resource: its configuration and the node's counts."""

    id: str
    adapter: str
    type: str
    """Adapter type: openai or mock for a provider, cli for a CLI resource."""
    model: str | None
    """The model name sent upstream; None: the client's alias."""
    capacity: int | None
    """None for a CLI resource: it has no capacity."""
    unlimited: bool
    in_flight: int
    """Running on the node, from its last heartbeat (0 while the node is not connected)."""
    peak_in_flight: int
    """Most ever running at once on the node since the node started or the capacity last changed."""
    served: int
    failed: int
    refused: str | None = None
    """Why the node's own policy refuses to run it (`command not allowed`, ...); absent when it runs."""


class PoolProviderStatus(ResourceStatus, tag="pool", tag_field="kind"):
    """A provider with a capacity, serving pools: the node's live counts and this edge's view of it."""

    pools: list[str]
    """Pool aliases this provider serves."""
    dispatched_in_flight: int
    """Slots this edge holds there: sent and not yet ended."""
    queued: int
    """Sent by this edge and not started yet (waiting requests belong to the pool, not here)."""
    breaker: str
    """closed, open (out of rotation) or half_open (one trial request allowed)."""
    consecutive_failures: int
    breaker_open_for_s: float | None = None
    """Seconds until the breaker lets a trial through; only present while it is open."""
    qualifying: bool = False
    """Drained out of its pools by an exclusive `iop qualify` run (no user work until it ends)."""
    drained: str | None = None
    """Why it is out of its pools (`operator: ...`, `policy: error rate ...`, `checks: ...`,
    `exclusive qualify`); None while it takes pool requests (iop/edge/lifecycle.py)."""
    ttft_ms: float | None = None
    """The router's live TTFT of it (EWMA over recent streamed answers); None: not measured yet."""
    decode_tok_s: float | None = None
    """The router's live decode rate of it (EWMA, output tokens per second after the first)."""
    qualification: QualificationSummary | None = None
    """The latest `iop qualify` result, if one was recorded."""
    server: ServerLive | None = None
    """The model server its node runs for it (the adapter's `server:` block): state since when, cold
    starts, swaps, crashes; None when someone else runs the upstream, or the node is not connected."""


class CliResourceStatus(ResourceStatus, tag="cli", tag_field="kind"):
    """A CLI resource: unlimited, never queued, reached by at most one direct route."""

    route: str | None
    """The alias routed to it, if any."""


ProviderStatus = PoolProviderStatus | CliResourceStatus
"""One entry of a node's catalog, told apart by `kind` (pool or cli)."""


class NodeStatus(msgspec.Struct, kw_only=True):
    """A configured node, its presence as heartbeats show it, and every provider it hosts."""

    id: str
    connected: bool
    last_seen: float | None
    """Wall-clock time of its last heartbeat; None: never seen by this edge."""
    last_seen_s_ago: float | None
    instance: str | None
    version: str | None
    legacy_concurrency: int | None
    """The legacy `concurrency` of the file: metadata only, never used for admission."""
    providers: list[ProviderStatus]
    device: Device | None = None
    """The machine the node runs on, as it said in its hello; None: not heard from yet."""


class TenantLoad(msgspec.Struct, kw_only=True):
    """One tenant's requests in one pool at this edge (tenants with none are not listed)."""

    tenant: str
    """The tenant's name ("" without client keys)."""
    priority: str = "standard"
    waiting: int = 0
    running: int = 0
    """Holding a slot of the pool: granted at this edge, not yet ended."""


class PoolStatus(msgspec.Struct, kw_only=True):
    """A pool alias: its candidates' capacity and this edge's queue."""

    alias: str
    candidates: list[str]
    connected_candidates: int
    total_capacity: int
    connected_capacity: int
    usable_capacity: int
    """Connected and not out of rotation (breaker open)."""
    retry_after_s: float | None = None
    """Set while no provider can take requests (they get 503 `pool_unavailable` at once): seconds
    until one may, its breaker's next half-open try (1 when every node of the pool is gone)."""
    in_flight: int
    """Running on the nodes, from their heartbeats."""
    dispatched_in_flight: int
    waiting: int
    running: int
    """Started, counted at this edge from the nodes' Started messages."""
    peak_running: int
    """Most ever running at once since this edge started."""
    queue_wait_p50_ms: float | None = None
    """Median time the pool's recent admissions (up to 512) waited for a slot; None: none yet."""
    queue_wait_p95_ms: float | None = None
    affinity_wait_ms: float = 0.0
    """The pool's `affinity_wait_ms`: how long a session's request may wait for its last provider."""
    affinity_hits: int = 0
    """Requests this edge sent to the provider their session used last (prefix-cache affinity)."""
    affinity_misses: int = 0
    """Requests of a session this edge remembered that went to another provider (that one was busy,
    out of rotation or gone)."""
    endpoints: list[str] = msgspec.field(default_factory=list)
    """What every provider of the pool answers (chat, responses, messages, embeddings, completions)."""
    tenants: list[TenantLoad] = msgspec.field(default_factory=list)
    """Per tenant with requests here: waiting and holding slots, most waiting first."""


class RouteStatus(msgspec.Struct, kw_only=True):
    """A direct route: an alias bound to one CLI resource."""

    alias: str
    node: str
    resource: str
    connected: bool
    endpoints: list[str] = msgspec.field(default_factory=list)
    """What the CLI resource answers."""


class TenantLimits(msgspec.Struct, kw_only=True):
    """A limited tenant's limits and its use as this edge last read it from the shared bucket."""

    tenant: str
    rpm: int | None = None
    tpm: int | None = None
    tokens_per_day: int | None = None
    tokens_per_month: int | None = None
    requests_in_window: int = 0
    """Admissions the last 60 s (and the current second) hold."""
    tokens_in_window: int = 0
    tokens_today: int = 0
    tokens_this_month: int = 0
    seen: bool = False
    """This edge has read or written the tenant's use (else the counts are not known here)."""


class Status(msgspec.Struct, kw_only=True):
    """The whole document: every node once, every provider once under its node, then pools and routes."""

    edge: EdgeInfo
    nodes: list[NodeStatus]
    pools: list[PoolStatus]
    routes: list[RouteStatus]
    tenants: list[TenantLimits] = msgspec.field(default_factory=list)
    """The tenants with rpm, tpm or a budget in the deployment file (iop/edge/limits.py)."""

    def pool(self, alias: str) -> PoolStatus | None:
        return next((p for p in self.pools if p.alias == alias), None)

    def route(self, alias: str) -> RouteStatus | None:
        return next((r for r in self.routes if r.alias == alias), None)

    def providers(self) -> dict[str, tuple[NodeStatus, ProviderStatus]]:
        """Every provider and CLI resource by id, with its node."""
        return {p.id: (n, p) for n in self.nodes for p in n.providers}

    def connected_nodes(self) -> set[str]:
        return {n.id for n in self.nodes if n.connected}


encode_status = msgspec.json.Encoder().encode
_decoder = msgspec.json.Decoder(Status)


def decode_status(data: bytes | str) -> Status:
    """Parse a /status body; raises msgspec.DecodeError (or ValidationError) naming the path."""
    return _decoder.decode(data)


# --- GET /status?view=summary: totals and counts, only what is not healthy listed one by one ------


class StateCounts(msgspec.Struct, kw_only=True):
    """How many catalog entries are in each state. Healthy: `ready` and `full`; the rest need a look."""

    ready: int = 0
    """Connected, in rotation, at least one slot free (a CLI resource: connected and allowed to run)."""
    full: int = 0
    """Connected, in rotation, every slot taken (by this edge or others)."""
    breaker_open: int = 0
    """Out of rotation after failures until its cooldown ends."""
    half_open: int = 0
    """Cooldown over: the next request is its trial."""
    qualifying: int = 0
    """Drained out of its pools by an exclusive `iop qualify` run."""
    refused: int = 0
    """The node's own policy refuses to run it (`command not allowed`, ...)."""
    disconnected: int = 0
    """Its node is gone, or the node does not run it."""
    drained: int = 0
    """Out of its pools by an operator, its lifecycle policy or a failed qualification."""


class PoolSummary(msgspec.Struct, kw_only=True):
    """A pool alias in totals: its providers by state, capacities, this edge's queue."""

    alias: str
    providers: int
    states: StateCounts
    total_capacity: int
    usable_capacity: int
    """Connected, in rotation and allowed to run (not out of rotation, not qualifying)."""
    retry_after_s: float | None = None
    """Set while no provider can take requests (503 `pool_unavailable` at once), as in the full view."""
    in_flight: int
    """Running on the nodes, from their heartbeats (every edge's requests)."""
    dispatched_in_flight: int
    """Slots this edge holds in the pool."""
    waiting: int
    running: int
    queue_wait_p50_ms: float | None = None
    queue_wait_p95_ms: float | None = None


class ProviderAttention(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A catalog entry that is not healthy, listed on its own with what explains its state."""

    id: str
    kind: str
    """pool or cli, as `kind` in the full view."""
    state: str
    """One of the StateCounts fields other than ready and full."""
    pools: list[str] = msgspec.field(default_factory=list)
    route: str | None = None
    capacity: int | None = None
    dispatched_in_flight: int = 0
    consecutive_failures: int = 0
    breaker_open_for_s: float | None = None
    refused: str | None = None
    drained: str | None = None
    """Why it is out of its pools (state `drained`)."""


class NodeAttention(msgspec.Struct, kw_only=True):
    """A node that is gone or hosts an entry that is not healthy: its totals and those entries.

    A node that is gone lists no entries: every one of them is disconnected with it."""

    id: str
    connected: bool
    last_seen_s_ago: float | None
    providers: int
    """Catalog entries it hosts (providers and CLI resources)."""
    capacity: int
    """Sum of its providers' capacities."""
    in_flight: int
    """Running there, from its last heartbeat (0 while it is gone)."""
    unhealthy: list[ProviderAttention] = msgspec.field(default_factory=list)


class StatusSummary(msgspec.Struct, kw_only=True):
    """`GET /status?view=summary`: what an operator or a monitor needs at a glance, in a document whose
    size does not grow with the healthy part of the catalog (pools are listed; healthy nodes and
    providers are only counted)."""

    view: str = "summary"
    built_at: float
    """Wall-clock time the edge built it; it serves the same document for up to 0.25 s."""
    edge: EdgeInfo
    nodes: int
    nodes_connected: int
    providers: StateCounts
    """Every provider (pool entry) of the catalog by state."""
    cli_resources: StateCounts
    routes: int
    routes_connected: int
    total_capacity: int
    usable_capacity: int
    in_flight: int
    """Running on the nodes (providers and CLI resources), from their heartbeats."""
    waiting: int
    """Requests waiting in this edge's pool queues."""
    pools: list[PoolSummary]
    attention: list[NodeAttention]
    """Only nodes that are gone or host something not healthy (empty: all is well)."""


encode_summary = msgspec.json.Encoder().encode
_summary_decoder = msgspec.json.Decoder(StatusSummary)


def decode_summary(data: bytes | str) -> StatusSummary:
    """Parse a /status?view=summary body; raises msgspec.DecodeError (or ValidationError) naming the path."""
    return _summary_decoder.decode(data)
