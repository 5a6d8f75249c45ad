"""OpenTelemetry traces of requests, for the edge and the node: the one module that touches the SDK.

Off unless an OTLP/HTTP endpoint is configured (the deployment's `tracing.endpoint` or the usual
`OTEL_EXPORTER_OTLP_*` variables); then `Tracing.on` is true and the SDK is imported. Off, nothing
of OpenTelemetry is imported or made: every caller tests `on` (or a span it holds) first.

Spans are finished into a bounded queue a background thread exports in batches (the SDK's batch
processor and OTLP exporter), so a request never waits on the collector: when the queue is full
or an export fails, the spans are dropped and counted (`dropped`, `iop_trace_spans_dropped_total`).

The trace context crosses NATS and reaches the upstream as W3C `traceparent` / `tracestate`
headers. The edge decides whether a request is sampled; a node only continues a trace whose
sampled context came with the work, and never starts one of its own.
"""

from __future__ import annotations

import logging
import os
import random
import re
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from iop.tracingconf import TracingSettings

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer

    from iop.tracing.export import Counting

log = logging.getLogger("iop.tracing")

CONTENT_LIMIT = 8192
"""Characters of a body a span may hold with `tracing.content` (debugging only)."""
DROP_LOG_INTERVAL_S = 10.0
TRACESTATE_LIMIT = 512
"""Longest `tracestate` passed on (W3C's advice), so the context always fits a NATS message's header room."""
_TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")


def endpoint_of(settings: TracingSettings, env: Mapping[str, str]) -> str:
    """The OTLP/HTTP traces URL, "" for none: the signal's variable, the general one, then the file."""
    url = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
    if url:
        return url
    base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
    if base:
        return base.rstrip("/") + "/v1/traces"  # the general variable names the collector, not the path
    return settings.endpoint or ""


def ratio_of(settings: TracingSettings, env: Mapping[str, str]) -> float:
    raw = env.get("OTEL_TRACES_SAMPLER_ARG", "").strip()
    if raw:
        try:
            value = float(raw)
        except ValueError:
            value = -1.0
        if 0.0 <= value <= 1.0:
            return value
        log.warning("OTEL_TRACES_SAMPLER_ARG=%r is not a ratio from 0 to 1; using %g", raw, settings.sample_ratio)
    return settings.sample_ratio


class Tracing:
    """One process part's tracer (the edge's, a node's), with its export and its drop count."""

    def __init__(
        self, settings: TracingSettings, service: str, instance: str = "", env: Mapping[str, str] | None = None
    ) -> None:
        env = os.environ if env is None else env
        self.endpoint = endpoint_of(settings, env)
        self.on = bool(self.endpoint)
        self.content = settings.content
        """Bodies in spans (debugging; documented risk): off by default, metadata only."""
        self.ratio = ratio_of(settings, env)
        self.service = env.get("OTEL_SERVICE_NAME", "").strip() or settings.service_name or service
        self._lock = threading.Lock()
        self.pending = 0
        """Spans handed to the exporter's queue and not yet exported or dropped."""
        self.dropped = 0
        """Spans lost: the queue was full or their export failed (collector down, refused)."""
        self.exported = 0
        self._limit = settings.max_queue_spans
        self._logged_drops = 0
        self._logged_at = 0.0
        self._provider: TracerProvider | None = None
        self._exporter: Counting | None = None
        self._api: Any = None
        self._propagator: Any = None
        self.tracer: Tracer | None = None
        if self.on:
            self._build(settings, instance)

    def _build(self, settings: TracingSettings, instance: str) -> None:
        import opentelemetry.trace
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        import iop
        from iop.tracing.export import Bounded, Counting

        # The SDK logs every failed export and every dropped span; iop counts them and says so
        # itself, once per interval (`_note_drops`), so a collector that is down does not flood the log.
        for name in ("opentelemetry.exporter", "opentelemetry.sdk._shared_internal", "opentelemetry.sdk.trace"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
        attributes: dict[str, str] = {"service.name": self.service, "service.version": iop.__version__}
        if instance:
            attributes["service.instance.id"] = instance
        provider = TracerProvider(
            # The ratio is drawn in `server_span`, before the SDK is called at all: an unsampled
            # request then costs a random number, not a span. What reaches the SDK is sampled,
            # or continues a context (a client's, a work item's) whose flag decides.
            sampler=ParentBased(ALWAYS_ON),
            resource=Resource(attributes),
            shutdown_on_exit=False,
        )
        self._exporter = Counting(OTLPSpanExporter(endpoint=self.endpoint, timeout=settings.export_timeout_s), self)
        batch = BatchSpanProcessor(
            self._exporter,
            # Room beyond the bound `_Bounded` keeps: the SDK's own queue never drops uncounted.
            max_queue_size=self._limit + 1,
            schedule_delay_millis=settings.export_interval_ms,
            max_export_batch_size=min(512, self._limit),
        )
        provider.add_span_processor(Bounded(batch, self))
        self._provider = provider
        self.tracer = provider.get_tracer("iop", iop.__version__)
        self._api = opentelemetry.trace
        self._propagator = TraceContextTextMapPropagator()

    # --- spans ------------------------------------------------------------------------------------

    def server_span(self, name: str, headers: Sequence[tuple[bytes, bytes]], attributes: dict[str, Any]) -> Span | None:
        """The span of a request arriving over HTTP, continuing the client's trace context if it sent one.

        None when the request is not sampled: nothing below it makes spans or carries a context.
        """
        assert self.tracer is not None
        carrier: dict[str, str] = {}
        for key, value in headers:
            if key == b"traceparent" or key == b"tracestate":
                carrier[key.decode()] = value.decode("latin-1")
        match = _TRACEPARENT.match(carrier.get("traceparent", ""))
        if match is not None:
            if not int(match[3], 16) & 1:
                return None  # the client's context is not sampled: parent-based, nothing is recorded
            context = self._propagator.extract(carrier)
        else:
            # A new trace (no context, or one W3C says to ignore): sampled at the configured ratio.
            if self.ratio < 1.0 and random.random() >= self.ratio:
                return None
            context = None
        span = self.tracer.start_span(name, context, self._api.SpanKind.SERVER, attributes)
        return span if span.is_recording() else None

    def child(self, parent: Span, name: str, kind: str = "internal", attributes: dict[str, Any] | None = None) -> Span:
        """A span under `parent` (which this tracer made, or a context from `continued`)."""
        assert self.tracer is not None
        api = self._api
        return self.tracer.start_span(name, api.set_span_in_context(parent), api.SpanKind[kind.upper()], attributes)

    def continued(
        self, headers: Mapping[str, str] | None, name: str, kind: str, attributes: dict[str, Any]
    ) -> Span | None:
        """A span continuing the sampled trace whose context came in `headers` (a work item's); else None."""
        if not headers:
            return None
        parent = headers.get("traceparent", "")
        match = _TRACEPARENT.match(parent)
        if match is None or not int(match[3], 16) & 1:
            return None
        assert self.tracer is not None
        carrier = {"traceparent": parent, "tracestate": headers.get("tracestate", "")}
        return self.tracer.start_span(
            name, self._propagator.extract(carrier), self._api.SpanKind[kind.upper()], attributes
        )

    # --- export -----------------------------------------------------------------------------------

    def admitted(self) -> bool:
        """Whether one more finished span fits the export queue; counts it as dropped if not."""
        with self._lock:
            if self.pending >= self._limit:
                self.dropped += 1
                return False
            self.pending += 1
            return True

    def exported_batch(self, count: int, ok: bool) -> None:
        with self._lock:
            self.pending -= count
            if ok:
                self.exported += count
            else:
                self.dropped += count
        self._note_drops()

    def _note_drops(self) -> None:
        now = time.monotonic()
        if self.dropped > self._logged_drops and now - self._logged_at >= DROP_LOG_INTERVAL_S:
            log.warning(
                "trace export to %s failing: %d spans dropped so far (iop_trace_spans_dropped_total)",
                self.endpoint,
                self.dropped,
            )
            self._logged_drops, self._logged_at = self.dropped, now

    def shutdown(self, timeout_s: float = 2.0) -> None:
        """Export what is queued for up to `timeout_s`, then stop; what is left is dropped."""
        provider, exporter = self._provider, self._exporter
        if provider is None or exporter is None:
            return
        self._provider = None
        done = threading.Thread(target=provider.shutdown, name="iop-trace-shutdown", daemon=True)
        done.start()
        done.join(timeout_s)
        if done.is_alive():
            exporter.abort()  # a collector that is down: stop the export's retries now
            done.join(timeout_s)


def traceparent(span: Span) -> str:
    ctx = span.get_span_context()
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def headers_of(span: Span) -> dict[str, str]:
    """The W3C trace context of `span` as message or HTTP headers."""
    out = {"traceparent": traceparent(span)}
    state = span.get_span_context().trace_state
    if state:
        header = state.to_header()
        if len(header) <= TRACESTATE_LIMIT:  # W3C lets a carrier drop what it cannot hold
            out["tracestate"] = header
    return out


def trace_id(span: Span | None) -> str:
    """The 32 hex digits of a span's trace, "" for none."""
    return f"{span.get_span_context().trace_id:032x}" if span is not None else ""


def content(text: bytes | str) -> str:
    """A body as a span attribute may hold it (`tracing.content`): text, cut at CONTENT_LIMIT."""
    if isinstance(text, bytes):
        text = text[: CONTENT_LIMIT * 4].decode("utf-8", "replace")
    return text[:CONTENT_LIMIT]
