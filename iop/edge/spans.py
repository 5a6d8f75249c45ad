"""The edge's spans of one request: what each part of its flow adds to its trace (iop/tracing).

Every function here is called only for a sampled request (`Trace.span` set); an unsampled one, or
any with tracing off, costs its callers one attribute test. Attributes are metadata only (names,
ids, counts, outcomes): bodies go in only with `tracing.content`, never keys.

    POST /v1/chat/completions               the request (SERVER), its outcome when it ends
      iop.admission                         the key, the body, the model asked for
      iop.limits                            the tenant's limits, when it has any
      iop.queue                             the wait for a slot in the pool: position, outcome
      iop.route                             the provider chosen, the candidates and why
      iop.attempt {provider}                one try (PRODUCER): its context goes to the node
        (node) iop.node.work ...            see iop/node/running.py
        iop.answer                          the node's answer relayed to the client
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from iop import tracing as tr
from iop.edge.ledger import RequestRecord
from iop.edge.observe import Trace
from iop.edge.slots import PoolQueue, ProviderSlots

if TYPE_CHECKING:
    from opentelemetry.trace import Span
    from starlette.types import Scope

_OPERATION = {"chat": "chat", "responses": "chat", "messages": "chat", "embeddings": "embeddings"}


def request(tracing: tr.Tracing, trace: Trace, scope: Scope) -> None:
    """Start the request's span (continuing the client's `traceparent`); unsampled leaves `trace.span` None."""
    path = scope["path"]
    attributes: dict[str, Any] = {
        "http.request.method": scope["method"],
        "url.path": path,
        "http.route": path,
        "iop.request_id": trace.id,
        "iop.api": trace.api,
    }
    server = scope.get("server")
    if server:
        attributes["server.address"], attributes["server.port"] = server[0], server[1] or 0
    span = tracing.server_span(f"{scope['method']} {path}", scope["headers"], attributes)
    if span is not None:
        trace.span, trace.tracing = span, tracing


def admission(trace: Trace) -> Span:
    """The key check, the body's read and the few fields the edge reads (tenants and limits add theirs)."""
    assert trace.span is not None and trace.tracing is not None
    return trace.tracing.child(trace.span, "iop.admission")


def admitted(span: Span, trace: Trace, model: str, body: bytes) -> None:
    span.set_attributes(
        {
            "iop.key_name": trace.key,
            "iop.tenant": trace.tenant,
            "gen_ai.request.model": model,
            "iop.stream": trace.stream,
        }
    )
    span.set_attribute("http.request.body.size", len(body))
    if trace.tracing is not None and trace.tracing.content and trace.span is not None:
        trace.span.set_attribute("gen_ai.input.messages", tr.content(body))  # tracing.content: debugging only
    span.end()


def limits(trace: Trace) -> Span:
    """The tenant's limits checked (rate, tokens, concurrency): refused ends it with the limit's code."""
    assert trace.span is not None and trace.tracing is not None
    return trace.tracing.child(trace.span, "iop.limits", attributes={"iop.tenant": trace.tenant})


def refused(span: Span, code: str) -> None:
    span.set_attribute("iop.admission.outcome", code)
    _failed(span, code, server=False)
    span.end()


def queue(trace: Trace, pool: PoolQueue | None, alias: str, retry: int) -> Span:
    assert trace.span is not None and trace.tracing is not None
    waiting = len(pool.waiters) if pool is not None else 0
    return trace.tracing.child(
        trace.span,
        "iop.queue",
        attributes={
            "iop.pool": alias,
            "iop.queue.position": waiting,
            "iop.queue.retry": retry,
            "iop.tenant": trace.tenant,  # fair queueing orders the waiters by tenant
        },
    )


def queue_ended(span: Span, outcome: str) -> None:
    span.set_attribute("iop.queue.outcome", outcome)
    if outcome != "granted":
        _failed(span, outcome)
    span.end()


def route(
    trace: Trace, pool: PoolQueue, slot: ProviderSlots, prefer: str | None, tried: frozenset[str], affinity: bool
) -> None:
    """The routing decision as one instant span: who could have served, who was chosen, and why."""
    assert trace.span is not None and trace.tracing is not None
    candidates = [p for p in pool.providers if p.id not in tried]
    if affinity:
        why = "affinity"  # the session's provider of last time, for its prefix cache
    elif tried:
        why = "failover"
    else:
        why = trace.route_reason or "most_free_slots"  # the quality router's reason, when it chose
    span = trace.tracing.child(
        trace.span,
        "iop.route",
        attributes={
            "iop.pool": pool.alias,
            "iop.route.candidates": [p.id for p in candidates],
            "iop.route.free_slots": [max(0, p.capacity - p.in_flight - p.elsewhere) for p in candidates],
            "iop.route.chosen": slot.id,
            "iop.route.reason": why,
            "iop.route.preferred": prefer or "",
            "iop.route.excluded": sorted(tried),
        },
    )
    span.end()


def attempt(trace: Trace, provider: str, node: str, route: str) -> Span:
    assert trace.span is not None and trace.tracing is not None
    return trace.tracing.child(
        trace.span,
        f"iop.attempt {provider}",
        "producer",
        {
            "iop.provider": provider,
            "iop.node": node,
            "iop.attempt": trace.attempts,
            "iop.route": route,
            "messaging.system": "nats",
        },
    )


def attempt_ended(span: Span, exc: BaseException | None, retried: bool) -> None:
    if exc is not None:
        code = getattr(exc, "code", None) or ("cancelled" if not isinstance(exc, Exception) else type(exc).__name__)
        _failed(span, str(code))
    span.set_attribute("iop.failover", retried)
    span.end()


def answer(trace: Trace, parent: Span, stream: bool) -> Span:
    assert trace.tracing is not None
    return trace.tracing.child(parent, "iop.answer", attributes={"iop.stream": stream})


def answer_ended(span: Span, trace: Trace, error: str) -> None:
    span.set_attribute("iop.bytes_out", trace.bytes_out)
    if error:
        _failed(span, error)
    span.end()


def finish(trace: Trace, rec: RequestRecord) -> None:
    """The request's outcome on its span, then the span ends: the trace's root is complete."""
    span = trace.span
    assert span is not None
    attributes: dict[str, Any] = {
        "http.response.status_code": rec.status,
        "gen_ai.operation.name": _OPERATION.get(rec.api, rec.api or "chat"),
        "iop.route": rec.route,
        "iop.attempts": rec.attempts,
        "iop.cancelled": rec.cancelled,
    }
    if rec.alias:
        attributes["gen_ai.request.model"] = rec.alias
    if rec.model:
        attributes["gen_ai.response.model"] = rec.model
    if rec.provider:
        attributes["iop.provider"], attributes["iop.node"] = rec.provider, rec.node
    if rec.input_tokens is not None:
        attributes["gen_ai.usage.input_tokens"] = rec.input_tokens
    if rec.output_tokens is not None:
        attributes["gen_ai.usage.output_tokens"] = rec.output_tokens
    if rec.queue_ms is not None:
        attributes["iop.queue_ms"] = rec.queue_ms
    if rec.ttfb_ms is not None:
        attributes["iop.ttfb_ms"] = rec.ttfb_ms
    span.set_attributes(attributes)
    if rec.error:
        _failed(span, rec.error, server=rec.status >= 500 or rec.status == 0)
    span.end()


def _failed(span: Span, code: str, server: bool = True) -> None:
    from opentelemetry.trace import StatusCode

    span.set_attribute("error.type", code)
    if server:
        span.set_status(StatusCode.ERROR, code)
