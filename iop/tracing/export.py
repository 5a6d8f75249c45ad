"""The SDK's export pipeline with iop's bound and counts around it; imported only when tracing is on."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

log = logging.getLogger("iop.tracing")


class Tracing(Protocol):
    """What the pipeline tells its owner (iop.tracing.Tracing): spans let in, spans sent or lost."""

    def admitted(self) -> bool: ...
    def exported_batch(self, count: int, ok: bool) -> None: ...


class Counting(SpanExporter):
    """The OTLP exporter, with what it sent or failed to send counted on the Tracing."""

    def __init__(self, inner: SpanExporter, tracing: Tracing) -> None:
        self.inner = inner
        self.tracing = tracing
        self._closed = False

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            result = self.inner.export(spans)
        except Exception:  # the export thread's boundary: a bug below must cost spans, not the thread
            log.exception("trace export failed")
            result = SpanExportResult.FAILURE
        self.tracing.exported_batch(len(spans), result is SpanExportResult.SUCCESS)
        return result

    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            self.inner.shutdown()

    def abort(self) -> None:
        """Stop an export's retries now (a collector that is down at shutdown): its spans are dropped."""
        self.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


class Bounded(SpanProcessor):
    """The SDK's batch processor behind iop's bound: a span past `max_queue_spans` is dropped and counted.

    The SDK's own queue drops silently (and logs each span); this one counts, so the drops show in
    `iop_trace_spans_dropped_total`.
    """

    def __init__(self, batch: BatchSpanProcessor, tracing: Tracing) -> None:
        self.batch = batch
        self.tracing = tracing

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        ctx = span.context
        if ctx is not None and ctx.trace_flags.sampled and self.tracing.admitted():
            self.batch.on_end(span)

    def shutdown(self) -> None:
        self.batch.shutdown()  # type: ignore[no-untyped-call]

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.batch.force_flush(timeout_millis)
