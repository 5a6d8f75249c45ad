"""OpenTelemetry traces of requests, for the edge and the node: spans made and exported by iop itself.

Off unless an OTLP/HTTP endpoint is configured (the deployment's `tracing.endpoint` or the usual
`OTEL_EXPORTER_OTLP_*` variables); then `Tracing.on` is true. Every caller tests `on` (or a span
it holds) first, and an unsampled request makes nothing: `sample` walks its headers and draws one
random number.

A span is a small object (`Span`): its ids, times, attributes and events, ended into a bounded
buffer that a background thread encodes as OTLP protobuf and sends in batches
(iop/tracing/export.py), so a request never waits on the collector. When the buffer is full or an
export fails, the spans are dropped and counted (`dropped`, `iop_trace_spans_dropped_total`).
The OpenTelemetry SDK is not used: its spans cost 100-130 µs of CPU each here, these a few.

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
from typing import Any, Final

from iop.tracing import otlp
from iop.tracing.export import BATCH_SPANS, Exporter
from iop.tracingconf import TracingSettings

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


INTERNAL, SERVER, CLIENT, PRODUCER, CONSUMER = 1, 2, 3, 4, 5
"""OTLP's span kinds."""

Context = tuple[int, int, str]
"""A sampled trace to continue: trace id, parent span id (0: a new trace), tracestate."""
NEW: Final[Context] = (0, 0, "")


class Span:
    """One span of a trace: what an exporter needs, filled in by the flow it times (iop/edge/spans.py)."""

    __slots__ = (
        "attributes",
        "end_ns",
        "error",
        "events",
        "kind",
        "name",
        "parent_id",
        "span_id",
        "start_ns",
        "trace_id",
        "trace_state",
        "tracing",
    )

    def __init__(
        self, tracing: Tracing, name: str, kind: int, context: Context, attributes: dict[str, Any] | None
    ) -> None:
        self.tracing = tracing
        self.name = name
        self.kind = kind
        self.trace_id = context[0] or random.getrandbits(128) or 1
        self.parent_id = context[1]
        self.trace_state = context[2]
        self.span_id = random.getrandbits(64) or 1
        self.attributes: dict[str, Any] = attributes if attributes is not None else {}
        self.events: list[tuple[int, str, dict[str, Any] | None]] | None = None
        self.error = ""
        """The status: "" unset, else ERROR with this description."""
        self.start_ns = time.time_ns()
        self.end_ns = 0

    def set_attribute(self, key: str, value: Any) -> None:
        self.attributes[key] = value

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        self.attributes.update(attributes)

    def add_event(self, name: str, attributes: dict[str, Any] | None = None) -> None:
        if self.events is None:
            self.events = []
        self.events.append((time.time_ns(), name, attributes))

    def fail(self, code: str, server: bool = True) -> None:
        """`error.type`; with `server`, also the ERROR status (a client's mistake is not the server's)."""
        self.attributes["error.type"] = code
        if server:
            self.error = code

    def end(self) -> None:
        if not self.end_ns:
            self.end_ns = time.time_ns()
            self.tracing.finished(self)

    @property
    def context(self) -> Context:
        """The context a child continues (across NATS: `headers_of`)."""
        return (self.trace_id, self.span_id, self.trace_state)


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
        self.dropped = 0
        """Spans lost: the buffer was full or their export failed (collector down, refused)."""
        self.exported = 0
        self._limit = settings.max_queue_spans
        self._logged_drops = 0
        self._logged_at = 0.0
        self._exporter: Exporter | None = None
        if self.on:
            import iop

            resource: dict[str, Any] = {
                "service.name": self.service,
                "service.version": iop.__version__,
                "telemetry.sdk.name": "iop",
                "telemetry.sdk.language": "python",
            }
            if instance:
                resource["service.instance.id"] = instance
            prefix = otlp.resource_prefix(resource, "iop", iop.__version__)
            self._exporter = Exporter(
                self.endpoint, env, prefix, self, settings.export_timeout_s, settings.export_interval_ms
            )

    # --- spans ------------------------------------------------------------------------------------

    def sample(self, headers: Sequence[tuple[bytes, bytes]]) -> Context | None:
        """Whether a request arriving over HTTP is traced: its client's sampled context, NEW, or None.

        Parent-based: a client's valid `traceparent` decides; without one, `sample_ratio` does.
        Unsampled, this allocates nothing but the random draw."""
        parent = state = None
        for key, value in headers:
            if key == b"traceparent":
                parent = value
            elif key == b"tracestate":
                state = value
        if parent is not None:
            context = _parsed(parent.decode("latin-1"), state.decode("latin-1") if state is not None else "")
            if context is not None:
                return context if context[0] else None
        ratio = self.ratio
        if ratio >= 1.0 or (ratio > 0.0 and random.random() < ratio):
            return NEW
        return None

    def server_span(self, name: str, context: Context, attributes: dict[str, Any]) -> Span:
        """The span of a request arriving over HTTP, under the context `sample` gave."""
        return Span(self, name, SERVER, context, attributes)

    def child(self, parent: Span, name: str, kind: int = INTERNAL, attributes: dict[str, Any] | None = None) -> Span:
        return Span(self, name, kind, parent.context, attributes)

    def continued(
        self, headers: Mapping[str, str] | None, name: str, kind: int, attributes: dict[str, Any]
    ) -> Span | None:
        """A span continuing the sampled trace whose context came in `headers` (a work item's); else None."""
        if not headers:
            return None
        parent = headers.get("traceparent")
        context = _parsed(parent, headers.get("tracestate", "")) if parent else None
        if context is None or not context[0]:
            return None
        return Span(self, name, kind, context, attributes)

    # --- export -----------------------------------------------------------------------------------

    def finished(self, span: Span) -> None:
        """A span ended: into the export buffer, or counted as dropped when the buffer is full."""
        exporter = self._exporter
        if exporter is None or len(exporter.buffer) + exporter.sending >= self._limit:
            with self._lock:
                self.dropped += 1
            return
        buffer = exporter.buffer
        buffer.append(span)
        if len(buffer) == BATCH_SPANS:
            exporter.wake()

    @property
    def pending(self) -> int:
        """Spans handed to the export and not yet exported or dropped."""
        exporter = self._exporter
        return len(exporter.buffer) + exporter.sending if exporter is not None else 0

    def exported_batch(self, count: int, ok: bool) -> None:
        with self._lock:
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
        """Export what is buffered for up to `timeout_s`, then stop; what is left is dropped."""
        exporter, self._exporter = self._exporter, None
        if exporter is None:
            return
        exporter.shutdown(timeout_s)
        left = len(exporter.buffer)
        if left:
            exporter.buffer.clear()
            self.exported_batch(left, False)


def _parsed(traceparent: str, tracestate: str) -> Context | None:
    """A W3C `traceparent`'s context: None when invalid (W3C: ignore it), trace id 0 when not sampled."""
    match = _TRACEPARENT.match(traceparent)
    if match is None:
        return None
    trace, parent = int(match[1], 16), int(match[2], 16)
    if not trace or not parent:
        return None
    if not int(match[3], 16) & 1:
        return (0, 0, "")
    state = tracestate.strip()
    if len(state) > TRACESTATE_LIMIT or not (state.isascii() and state.isprintable()):
        state = ""  # W3C lets a carrier drop what it cannot hold
    return (trace, parent, state)


def traceparent(span: Span) -> str:
    return f"00-{span.trace_id:032x}-{span.span_id:016x}-01"


def headers_of(span: Span) -> dict[str, str]:
    """The W3C trace context of `span` as message or HTTP headers."""
    out = {"traceparent": traceparent(span)}
    if span.trace_state:
        out["tracestate"] = span.trace_state
    return out


def trace_id(span: Span | None) -> str:
    """The 32 hex digits of a span's trace, "" for none."""
    return f"{span.trace_id:032x}" if span is not None else ""


def content(text: bytes | str) -> str:
    """A body as a span attribute may hold it (`tracing.content`): text, cut at CONTENT_LIMIT."""
    if isinstance(text, bytes):
        text = text[: CONTENT_LIMIT * 4].decode("utf-8", "replace")
    return text[:CONTENT_LIMIT]
