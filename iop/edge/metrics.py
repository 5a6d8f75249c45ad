"""`GET /metrics`: Prometheus counters and histograms fed by request records, gauges read at scrape.

iop's own names carry the `iop_` prefix; beside them the OpenTelemetry GenAI histograms in their
Prometheus form (`gen_ai_client_operation_duration_seconds`, `gen_ai_client_token_usage`,
`gen_ai_server_time_to_first_token_seconds`) so standard GenAI dashboards work unchanged. Labels
stay low-cardinality: never a request id or a key.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_left
from collections.abc import Iterator
from typing import Any

from nats.aio.client import Client as NATS
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest
from prometheus_client.registry import Collector
from prometheus_client.samples import Exemplar
from prometheus_client.utils import floatToGoString

from iop.edge.junk import Junk
from iop.edge.ledger import LedgerWriter, RequestRecord
from iop.edge.registry import Registry
from iop.edge.scheduler import Scheduler
from iop.tracing import Tracing

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"
"""What a scraper that asks for it gets (Prometheus with exemplar storage): the trace exemplars too."""

_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
# The GenAI conventions' bucket boundaries, as they define them.
_GENAI_DURATION = tuple(0.01 * 2**i for i in range(14))  # 0.01 … 81.92
_GENAI_TOKENS = tuple(4**i for i in range(14))  # 1, 4, 16 … 67108864
_GENAI_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)


class _Count:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0


class _Hist:
    """A histogram as plain numbers: observing is one bisect and two additions."""

    __slots__ = ("bounds", "counts", "exemplars", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0
        self.exemplars: list[Exemplar | None] | None = None
        """Per bucket, the last traced request's trace id (OpenMetrics exemplars); None until one."""

    def observe(self, v: float) -> None:
        self.counts[bisect_left(self.bounds, v)] += 1
        self.sum += v

    def observe_traced(self, v: float, trace_id: str) -> None:
        """`observe`, and the request's trace as its bucket's exemplar: from a slow bucket to its trace."""
        i = bisect_left(self.bounds, v)
        self.counts[i] += 1
        self.sum += v
        if self.exemplars is None:
            self.exemplars = [None] * len(self.counts)
        self.exemplars[i] = Exemplar({"trace_id": trace_id}, v, time.time())

    def buckets(self) -> list[Any]:
        out: list[Any] = []
        total = 0
        for i, (bound, n) in enumerate(zip((*self.bounds, math.inf), self.counts, strict=True)):
            total += n
            le = "+Inf" if bound == math.inf else floatToGoString(bound)  # type: ignore[no-untyped-call]
            exemplar = self.exemplars[i] if self.exemplars is not None else None
            out.append((le, float(total), exemplar) if exemplar is not None else (le, float(total)))
        return out


class _Family:
    """One metric's series by label values."""

    def __init__(self, name: str, doc: str, labels: tuple[str, ...], bounds: tuple[float, ...] | None = None):
        self.name, self.doc, self.labels, self.bounds = name, doc, labels, bounds
        self.series: dict[tuple[str, ...], _Count | _Hist] = {}

    def get(self, values: tuple[str, ...]) -> Any:
        s = self.series.get(values)
        if s is None:
            s = self.series[values] = _Hist(self.bounds) if self.bounds is not None else _Count()
        return s

    def collect(self) -> Metric:
        if self.bounds is None:
            fam = CounterMetricFamily(self.name, self.doc, labels=self.labels)
            for values, c in self.series.items():
                assert isinstance(c, _Count)
                fam.add_metric(values, c.value)
            return fam
        hist = HistogramMetricFamily(self.name, self.doc, labels=self.labels)
        for values, h in self.series.items():
            assert isinstance(h, _Hist)
            hist.add_metric(values, h.buckets(), h.sum)
        return hist


class _Series:
    """Every series one kind of request touches, found with one dict lookup per request."""

    __slots__ = ("duration", "genai_duration", "genai_ttft", "queue", "requests", "tokens", "ttfb")

    def __init__(self, m: Metrics, alias: str, route: str, node: str, provider: str, status: str, error: str):
        self.requests: _Count = m.requests.get((alias, route, node, provider, status))
        self.duration: _Hist = m.duration.get((alias, route))
        self.queue: _Hist = m.queue_wait.get((alias,))
        self.ttfb: _Hist = m.ttfb.get((alias, route))
        self.genai_duration: _Hist = m.genai_duration.get(("chat", provider, alias, error))
        self.genai_ttft: _Hist = m.genai_ttft.get(("chat", alias))
        # Both APIs are the conventions' "chat" operation.
        self.tokens = {
            kind: (m.tokens.get((alias, provider, kind)), m.genai_tokens.get(("chat", provider, alias, kind)))
            for kind in ("input", "output", "cached", "reasoning")
        }


class Metrics:
    """The edge's metrics. Requests update plain numbers (a few microseconds, no locks: one event
    loop writes them); prometheus-client turns them into the exposition format at scrape time."""

    def __init__(
        self,
        scheduler: Scheduler,
        registry: Registry,
        ledger: LedgerWriter | None,
        nc: NATS,
        started_at: float,
        tracing: Tracing | None = None,
        undecodable: tuple[Junk, ...] = (),
    ) -> None:
        """`undecodable`: the junk counts kept outside `registry` (the relay's)."""
        self.registry = CollectorRegistry(auto_describe=False)
        self.requests = _Family(
            "iop_requests", "Requests answered, by outcome.", ("alias", "route", "node", "provider", "status")
        )
        self.duration = _Family(
            "iop_request_duration_seconds", "From arrival to the last byte.", ("alias", "route"), _SECONDS
        )
        self.queue_wait = _Family(
            "iop_queue_wait_seconds", "From arrival until a node started it (pool).", ("alias",), _SECONDS
        )
        self.ttfb = _Family(
            "iop_time_to_first_byte_seconds",
            "From arrival until the first answer byte left the edge.",
            ("alias", "route"),
            _SECONDS,
        )
        self.tokens = _Family("iop_tokens", "Tokens the upstreams reported.", ("alias", "provider", "kind"))
        self.genai_duration = _Family(
            "gen_ai_client_operation_duration_seconds",
            "GenAI semantic conventions: duration of the operation.",
            ("gen_ai_operation_name", "gen_ai_provider_name", "gen_ai_request_model", "error_type"),
            _GENAI_DURATION,
        )
        self.genai_tokens = _Family(
            "gen_ai_client_token_usage",
            "GenAI semantic conventions: tokens used per operation.",
            ("gen_ai_operation_name", "gen_ai_provider_name", "gen_ai_request_model", "gen_ai_token_type"),
            _GENAI_TOKENS,
        )
        self.genai_ttft = _Family(
            "gen_ai_server_time_to_first_token_seconds",
            "GenAI semantic conventions: time to the first token of a streamed answer.",
            ("gen_ai_operation_name", "gen_ai_request_model"),
            _GENAI_TTFT,
        )
        self.limit_refusals = _Family(
            "iop_limit_refusals", "Requests refused by their tenant's limit (rpm, tpm, budgets).", ("tenant", "limit")
        )
        self._families = (
            self.limit_refusals,
            self.requests,
            self.duration,
            self.queue_wait,
            self.ttfb,
            self.tokens,
            self.genai_duration,
            self.genai_tokens,
            self.genai_ttft,
        )
        self._series: dict[tuple[str, ...], _Series] = {}
        self.registry.register(_RecordsCollector(self))
        self.registry.register(_LiveCollector(scheduler, registry, ledger, nc, started_at, tracing, undecodable))

    def observe(self, rec: RequestRecord) -> None:
        """Count one finished request."""
        key = (rec.alias or "-", rec.route or "-", rec.node or "-", rec.provider or "-", str(rec.status), rec.error)
        s = self._series.get(key)
        if s is None:
            s = self._series[key] = _Series(self, *key)
        s.requests.value += 1
        seconds = rec.duration_ms / 1000.0
        traced = rec.trace_id
        if traced:
            s.duration.observe_traced(seconds, traced)
        else:
            s.duration.observe(seconds)
        s.genai_duration.observe(seconds)
        if rec.queue_ms is not None and rec.route == "pool":
            if traced:
                s.queue.observe_traced(rec.queue_ms / 1000.0, traced)
            else:
                s.queue.observe(rec.queue_ms / 1000.0)
        if rec.ttfb_ms is not None:
            if traced:
                s.ttfb.observe_traced(rec.ttfb_ms / 1000.0, traced)
            else:
                s.ttfb.observe(rec.ttfb_ms / 1000.0)
            if rec.stream and not rec.error:
                s.genai_ttft.observe(rec.ttfb_ms / 1000.0)
        if rec.input_tokens is not None:
            tokens = s.tokens
            for kind, n in (
                ("input", rec.input_tokens),
                ("output", rec.output_tokens),
                ("cached", rec.cached_tokens),
                ("reasoning", rec.reasoning_tokens),
            ):
                if n is not None:
                    count, hist = tokens[kind]
                    count.value += n
                    if kind in ("input", "output"):
                        hist.observe(n)

    def refused(self, tenant: str, limit: str) -> None:
        """One request refused by `limit` of `tenant` (tenants are the deployment's: few)."""
        self.limit_refusals.get((tenant or "-", limit)).value += 1

    def render(self, openmetrics: bool = False) -> bytes:
        """The exposition; OpenMetrics (which carries the latency histograms' trace exemplars) when asked."""
        if openmetrics:
            return openmetrics_latest(self.registry)  # type: ignore[no-untyped-call,no-any-return]
        return generate_latest(self.registry)


class _RecordsCollector(Collector):
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        for fam in self.metrics._families:
            if fam.series:
                yield fam.collect()


class _LiveCollector(Collector):
    """Gauges read from the scheduler and the registry at scrape time (nothing to keep in step)."""

    def __init__(
        self,
        scheduler: Scheduler,
        registry: Registry,
        ledger: LedgerWriter | None,
        nc: NATS,
        started_at: float,
        tracing: Tracing | None,
        undecodable: tuple[Junk, ...],
    ) -> None:
        self.scheduler = scheduler
        self.undecodable = (
            registry.undecodable_hellos,
            registry.undecodable_heartbeats,
            registry.share.undecodable,
            *undecodable,
        )
        self.tracing = tracing
        self.nodes = registry
        self.ledger = ledger
        self.nc = nc
        self.started_at = started_at

    def collect(self) -> Iterator[Metric]:
        scheduler, registry, ledger = self.scheduler, self.nodes, self.ledger
        capacity = GaugeMetricFamily("iop_provider_capacity", "Slots of a provider.", labels=["node", "provider"])
        in_flight = GaugeMetricFamily(
            "iop_provider_in_flight", "Requests this edge has dispatched to a provider.", labels=["node", "provider"]
        )
        elsewhere = GaugeMetricFamily(
            "iop_provider_elsewhere",
            "Slots of a provider other edges hold, as this edge knows.",
            labels=["node", "provider"],
        )
        over = CounterMetricFamily(
            "iop_provider_oversubscribed",
            "Requests the edges together sent past a provider's capacity (they wait in the broker).",
            labels=["node", "provider"],
        )
        drained = GaugeMetricFamily(
            "iop_provider_drained",
            "1 while a provider is out of its pools, by who drained it (operator, policy, checks, qualify).",
            labels=["node", "provider", "by"],
        )
        share = registry.share
        for slots in scheduler.providers.values():
            for why in slots.drains.values():
                drained.add_metric([slots.node, slots.id, why.split(":", 1)[0].replace("exclusive ", "")], 1.0)
            capacity.add_metric([slots.node, slots.id], slots.capacity)
            in_flight.add_metric([slots.node, slots.id], slots.in_flight)
            elsewhere.add_metric([slots.node, slots.id], slots.elsewhere)
            over.add_metric([slots.node, slots.id], share.oversubscribed.get(slots.id, 0))
        waiting = GaugeMetricFamily("iop_pool_waiting", "Requests waiting for a slot.", labels=["alias"])
        tenant_waiting = GaugeMetricFamily(
            "iop_tenant_waiting", "A tenant's requests waiting for a slot of a pool.", labels=["tenant", "pool"]
        )
        tenant_running = GaugeMetricFamily(
            "iop_tenant_running", "A tenant's requests holding a slot of a pool.", labels=["tenant", "pool"]
        )
        kept = CounterMetricFamily(
            "iop_pool_kept",
            "Slots kept a moment for a tenant that asks again at once, by outcome (taken, lapsed).",
            labels=["alias", "outcome"],
        )
        for alias, pool in scheduler.pools.items():
            waiting.add_metric([alias], scheduler.waiting(alias))
            for outcome, n in pool.kept_outcomes.items():
                kept.add_metric([alias, outcome], n)
            for tenant, _, w, r in pool.waiters.loads():
                tenant_waiting.add_metric([tenant, alias], w)
                tenant_running.add_metric([tenant, alias], r)
        lease_here = GaugeMetricFamily(
            "iop_tenant_lease_here",
            "Units of a tenant's max_concurrent on a pool this edge holds.",
            labels=["tenant", "pool"],
        )
        lease_all = GaugeMetricFamily(
            "iop_tenant_lease_all_edges",
            "Units of a tenant's max_concurrent on a pool all edges hold together (at most the bound).",
            labels=["tenant", "pool"],
        )
        for alias, tenant, _, here, everywhere in scheduler.leases.parts() if scheduler.leases is not None else ():
            lease_here.add_metric([tenant, alias], here)
            lease_all.add_metric([tenant, alias], everywhere)
        nodes = GaugeMetricFamily("iop_node_connected", "1 while the node's heartbeats arrive.", labels=["node"])
        for node_id in registry.nodes:
            nodes.add_metric([node_id], 1.0 if registry.connected(node_id) else 0.0)
        dropped = CounterMetricFamily("iop_ledger_dropped", "Ledger records lost (buffer full while NATS was down).")
        dropped.add_metric([], ledger.dropped if ledger is not None else 0)
        pending = GaugeMetricFamily("iop_ledger_pending", "Ledger records waiting to be written.")
        pending.add_metric([], ledger.pending if ledger is not None else 0)
        nats = GaugeMetricFamily("iop_nats_connected", "1 while the edge is connected to NATS.")
        nats.add_metric([], 1.0 if self.nc.is_connected else 0.0)
        up = GaugeMetricFamily("iop_edge_uptime_seconds", "Seconds since this edge started.")
        up.add_metric([], time.time() - self.started_at)
        spans = CounterMetricFamily(
            "iop_trace_spans_dropped", "Trace spans lost: export queue full or export failed (collector down)."
        )
        spans.add_metric([], self.tracing.dropped if self.tracing is not None else 0)
        junk = CounterMetricFamily(
            "iop_nats_undecodable",
            "Messages dropped on a subject the edge listens to because they are none of what is sent there.",
            labels=["kind"],
        )
        for j in self.undecodable:
            junk.add_metric([j.kind], j.count)
        yield from (capacity, in_flight, elsewhere, over, drained, waiting, tenant_waiting, tenant_running, nodes)
        yield from (lease_here, lease_all, kept)
        yield from (dropped, pending, nats, up, spans, junk)
        yield from _server_metrics(registry)


_SERVER_STATES = ("stopped", "starting", "ready", "draining", "failed")


def _server_metrics(registry: Registry) -> Iterator[Metric]:
    """The model servers nodes run themselves (an adapter's `server:` block), from their heartbeats."""
    state = GaugeMetricFamily(
        "iop_provider_server_state",
        "1 for the state a provider's model server is in (the node runs it), 0 for the others.",
        labels=["node", "provider", "state"],
    )
    cold = CounterMetricFamily(
        "iop_cold_starts", "Starts of a provider's model server for a request.", labels=["node", "provider"]
    )
    swaps = CounterMetricFamily(
        "iop_server_swaps",
        "Starts of a provider's model server that stopped another of its group first.",
        labels=["node", "provider"],
    )
    for node_id, st in registry.nodes.items():
        if not registry.connected(node_id):
            continue
        for live in st.live.values():
            s = live.server
            if s is None:
                continue
            for name in _SERVER_STATES:
                state.add_metric([node_id, live.id, name], 1.0 if s.state == name else 0.0)
            cold.add_metric([node_id, live.id], s.cold_starts)
            swaps.add_metric([node_id, live.id], s.swaps)
    yield from (state, cold, swaps)
