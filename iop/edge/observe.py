"""What the edge notes about each request while it runs (`Trace`) and does when it ends (`Observer`).

When a request ends its trace becomes one `RequestRecord`, which feeds three things at once: the
access log line, the Prometheus metrics and the ledger. All three run after the answer's last
byte was handed to the server, and none of them waits on NATS.
"""

from __future__ import annotations

import logging
import re
import secrets
import time
from typing import TYPE_CHECKING, Literal

from iop import logs, wire
from iop.edge.ledger import LedgerWriter, RequestRecord
from iop.edge.metrics import Metrics
from iop.tracing import trace_id

if TYPE_CHECKING:
    from iop.tracing import Span, Tracing

access_log = logging.getLogger("iop.access")

REQUEST_ID = re.compile(wire.REQUEST_ID_PATTERN)


def new_request_id() -> str:
    return "req_" + secrets.token_hex(12)


class Trace:
    """One request's facts as they become known; `record()` freezes them. Cheap: plain slots.

    The HTTP side notes what the client saw (status, first byte, bytes); the request's dispatch
    notes where it went (route, node, provider, attempts, queue wait, the node's report).
    Requests refused before any dispatch (400, 401, 404) have none of the latter.
    """

    __slots__ = (
        "affinity",
        "alias",
        "api",
        "arrived",
        "attempts",
        "bytes_in",
        "bytes_out",
        "cancelled",
        "cold_start_ms",
        "error",
        "first_byte",
        "id",
        "key",
        "method",
        "model",
        "node",
        "path",
        "provider",
        "queue_ms",
        "report",
        "route",
        "route_reason",
        "span",
        "start",
        "status",
        "stream",
        "tenant",
        "tracing",
    )

    def __init__(self, request_id: str, api: wire.Api | None) -> None:
        self.id = request_id
        self.start = time.time()
        self.arrived = time.monotonic()
        self.api = api or ""
        self.alias = ""
        self.stream = False
        self.key = ""
        self.tenant = ""
        self.model = ""
        self.bytes_in = 0
        self.bytes_out = 0
        self.status = 0
        self.error = ""
        self.cancelled = False
        self.first_byte = 0.0
        self.route: Literal["pool", "direct", ""] = ""
        self.node = ""
        self.provider = ""
        """The last try's provider (or a direct route's CLI resource)."""
        self.attempts = 0
        """Providers tried: 1 unless the request failed over."""
        self.queue_ms: float | None = None
        """From the dispatch until the node started the answering try (None: no node ever started it)."""
        self.cold_start_ms: float | None = None
        """Of the queue wait, how long the node waited for its model server to start (None: it was ready)."""
        self.report: wire.Done | wire.Failure | None = None
        """The node's last word on the last try: what only it knows (tokens, upstream status, exit code)."""
        self.affinity = False
        """The last try went to the provider its session used last (prefix-cache affinity)."""
        self.route_reason = ""
        """Why the last try's provider was chosen (iop/edge/routing.py)."""
        self.method = ""
        """Set (with `path`) for a request refused before its model was known: what the log shows instead."""
        self.path = ""
        self.span: Span | None = None
        """The request's span when it is traced and sampled (iop/edge/spans.py); None otherwise."""
        self.tracing: Tracing | None = None

    def refused_at(self, method: str, raw_path: bytes) -> None:
        """Note what was asked, for the access line of a request that names no model (yet)."""
        self.method = _printable(method.encode(), 16)
        self.path = _printable(raw_path, 200)

    def record(self, edge_id: str) -> RequestRecord:
        out = self.report
        usage = out.usage if out is not None else None
        return RequestRecord(
            id=self.id,
            start=self.start,
            alias=self.alias,
            route=self.route,
            api=self.api,
            stream=self.stream,
            status=self.status,
            error=self.error,
            edge=edge_id,
            node=self.node,
            provider=self.provider,
            model=self.model,
            attempts=self.attempts,
            queue_ms=self.queue_ms,
            cold_start_ms=self.cold_start_ms,
            ttfb_ms=round((self.first_byte - self.arrived) * 1000, 3) if self.first_byte else None,
            duration_ms=round((time.monotonic() - self.arrived) * 1000, 3),
            input_tokens=usage.input_tokens if usage is not None else None,
            output_tokens=usage.output_tokens if usage is not None else None,
            cached_tokens=usage.cached_tokens if usage is not None else None,
            reasoning_tokens=usage.reasoning_tokens if usage is not None else None,
            bytes_in=self.bytes_in,
            bytes_out=self.bytes_out,
            key=self.key,
            cancelled=self.cancelled,
            upstream_status=(out.upstream_status or None) if out is not None else None,
            exit_code=out.exit_code if out is not None else None,
            run_ms=(out.run_ms or None) if out is not None else None,
            node_ttfb_ms=(out.ttfb_ms or None) if out is not None else None,
            affinity=self.affinity,
            tenant=self.tenant,
            route_reason=self.route_reason,
            trace_id=trace_id(self.span) if self.span is not None else "",
        )


class Observer:
    """Turns each finished trace into a record: access log, metrics and (when enabled) the ledger."""

    def __init__(self, edge_id: str, metrics: Metrics, ledger: LedgerWriter | None) -> None:
        self.edge_id = edge_id
        self.metrics = metrics
        self.ledger = ledger
        self.records = 0

    def finish(self, trace: Trace) -> RequestRecord:
        rec = trace.record(self.edge_id)
        self.records += 1
        self.metrics.observe(rec)
        # A request refused for its key is logged and counted, but stays out of the ledger: anyone
        # could otherwise fill (and so rotate away) the operators' usage history without a key.
        if self.ledger is not None and rec.status != 401:
            self.ledger.add(rec)
        if access_log.isEnabledFor(logging.INFO):
            _log_access(rec, trace)
        return rec


def _log_access(rec: RequestRecord, trace: Trace) -> None:
    line = access_line(rec, trace.method, trace.path)
    sole = logs.sole_handler(access_log, logging.INFO)
    if sole is not None and not sole.shows_fields:  # `iop edge`, text: the line, no record, no fields
        sole.line(logging.INFO, access_log.name, line, {})
        return
    fields = access_fields(rec)
    if trace.method:
        fields["method"], fields["path"] = trace.method, trace.path
    if sole is not None:  # `iop edge --log-format json`
        sole.line(logging.INFO, access_log.name, line, fields)
    else:  # the record `access_log.info` makes, less its walk up the stack for the caller's line
        extra = {"fields": fields}
        access_log.handle(
            access_log.makeRecord(access_log.name, logging.INFO, __file__, 0, line, (), None, "_log_access", extra)
        )


_UNPRINTABLE = re.compile(rb"[^\x21-\x7e]")


def _printable(raw: bytes, limit: int) -> str:
    """A client's bytes as a log may show them: printable ASCII, the rest `\\xNN`, at most `limit` bytes.

    Never raw: a CR/LF would forge a log line, an escape sequence would drive the operator's terminal.
    """
    cut = raw[:limit]
    text = _UNPRINTABLE.sub(lambda m: b"\\x%02x" % m.group()[0], cut).decode("ascii")
    return text + ("..." if len(raw) > limit else "")


def _tokens(rec: RequestRecord) -> str:
    if rec.input_tokens is None and rec.output_tokens is None:
        return "-"
    return f"{rec.input_tokens if rec.input_tokens is not None else '-'}/{rec.output_tokens or 0}"


def access_line(rec: RequestRecord, method: str = "", path: str = "") -> str:
    """`request_id alias route node/provider status duration_ms queue_ms tokens` — never prompts or keys.

    A request refused before it named a model shows what it asked for instead of the alias:
    `req_… GET /v1/chat/completions -/- 405 …`.
    """
    asked = f"{method} {path}" if method else ""
    where = f"{rec.node or '-'}/{rec.provider or '-'}"
    queue = f"{rec.queue_ms:.1f}" if rec.queue_ms is not None else "-"
    extra = f" error={rec.error}" if rec.error else ""
    if rec.attempts > 1:
        extra += f" attempts={rec.attempts}"
    if rec.exit_code is not None:
        extra += f" exit={rec.exit_code}"
    if rec.trace_id:
        extra += f" trace={rec.trace_id}"
    return (
        f"{rec.id} {asked or rec.alias or '-'} {rec.route or '-'} {where} {rec.status} "
        f"{rec.duration_ms:.1f}ms queue={queue}ms tokens={_tokens(rec)}{extra}"
    )


def access_fields(rec: RequestRecord) -> dict[str, object]:
    """The same line as fields, for `--log-format json`."""
    return {
        "request_id": rec.id,
        "alias": rec.alias,
        "route": rec.route,
        "node": rec.node,
        "provider": rec.provider,
        "status": rec.status,
        "error": rec.error or None,
        "duration_ms": rec.duration_ms,
        "queue_ms": rec.queue_ms,
        "ttfb_ms": rec.ttfb_ms,
        "attempts": rec.attempts,
        "input_tokens": rec.input_tokens,
        "output_tokens": rec.output_tokens,
        "key": rec.key or None,
        "cancelled": rec.cancelled,
        "trace_id": rec.trace_id or None,
    }
