"""The edge's spans of one request: what each part of its flow adds to its trace (iop/tracing).

Every function here is called only for a sampled request (`Trace.span` set); an unsampled one, or
any with tracing off, costs its callers one attribute test. Attributes are metadata only (names,
ids, counts, outcomes): bodies go in only with `tracing.content`, never keys. A span is made only
where time is spent that the others do not show; the rest are attributes and events:

    POST /v1/chat/completions       the request (SERVER): the key's name, tenant, model, body size;
                                    its outcome when it ends; event iop.limits (a limited tenant)
      iop.queue                     the wait for a slot in the pool: position, outcome
      iop.attempt {provider}        one try (PRODUCER), its context goes to the node: the route
                                    (candidates, free slots, chosen, reason); event iop.answer when
                                    the relay to the client begins, its bytes and outcome at the end
        (node) iop.node.work ...    see iop/node/running.py
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from iop import tracing as tr
from iop.edge.ledger import RequestRecord
from iop.edge.observe import Trace
from iop.edge.slots import PoolQueue, ProviderSlots
from iop.tracing import Span

if TYPE_CHECKING:
    from starlette.types import Scope

_OPERATION = {"chat": "chat", "responses": "chat", "messages": "chat", "embeddings": "embeddings"}


def request(tracing: tr.Tracing, trace: Trace, scope: Scope) -> None:
    """Start the request's span (continuing the client's `traceparent`); unsampled leaves `trace.span` None."""
    context = tracing.sample(scope["headers"])
    if context is None:
        return
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
    trace.span, trace.tracing = tracing.server_span(f"{scope['method']} {path}", context, attributes), tracing


def admitted(trace: Trace, model: str, body: bytes) -> None:
    """The key checked and the body read: who asks, for which model, how much."""
    span, tracing = trace.span, trace.tracing
    assert span is not None and tracing is not None
    span.set_attributes(
        {
            "iop.key_name": trace.key,
            "iop.tenant": trace.tenant,
            "gen_ai.request.model": model,
            "iop.stream": trace.stream,
            "http.request.body.size": len(body),
        }
    )
    if tracing.content:
        span.set_attribute("gen_ai.input.messages", tr.content(body))  # tracing.content: debugging only


def refused(trace: Trace, code: str) -> None:
    """Refused at admission (the key, the body, the head) or by the tenant's limits."""
    assert trace.span is not None
    trace.span.set_attribute("iop.admission.outcome", code)


def limits(trace: Trace, code: str) -> None:
    """The tenant's limits checked (rate, tokens, concurrency): "" admitted, else the limit's code."""
    assert trace.span is not None
    trace.span.add_event("iop.limits", {"iop.tenant": trace.tenant, "iop.limits.outcome": code or "admitted"})
    if code:
        refused(trace, code)


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
        span.fail(outcome)
    span.end()


def route(
    pool: PoolQueue, slot: ProviderSlots, prefer: str | None, tried: frozenset[str], affinity: bool, reason: str
) -> dict[str, Any]:
    """The routing decision, as the try's attributes: who could have served, who was chosen, and why."""
    candidates = [p for p in pool.providers if p.id not in tried]
    if affinity:
        why = "affinity"  # the session's provider of last time, for its prefix cache
    elif tried:
        why = "failover"
    else:
        why = reason or "most_free_slots"  # the quality router's reason, when it chose
    return {
        "iop.pool": pool.alias,
        "iop.route.candidates": [p.id for p in candidates],
        "iop.route.free_slots": [max(0, p.capacity - p.in_flight - p.elsewhere) for p in candidates],
        "iop.route.chosen": slot.id,
        "iop.route.reason": why,
        "iop.route.preferred": prefer or "",
        "iop.route.excluded": sorted(tried),
    }


def attempt(trace: Trace, provider: str, node: str, route: str, routed: dict[str, Any] | None) -> Span:
    assert trace.span is not None and trace.tracing is not None
    attributes: dict[str, Any] = {
        "iop.provider": provider,
        "iop.node": node,
        "iop.attempt": trace.attempts,
        "iop.route": route,
        "messaging.system": "nats",
    }
    if routed is not None:
        attributes.update(routed)
    return trace.tracing.child(trace.span, f"iop.attempt {provider}", tr.PRODUCER, attributes)


def attempt_ended(span: Span, exc: BaseException | None, retried: bool) -> None:
    if exc is not None:
        code = getattr(exc, "code", None) or ("cancelled" if not isinstance(exc, Exception) else type(exc).__name__)
        span.fail(str(code))
    span.set_attribute("iop.failover", retried)
    span.end()


def answer(attempt: Span, stream: bool) -> None:
    """The relay of the node's answer to the client begins."""
    attempt.add_event("iop.answer", {"iop.stream": stream})


def answer_ended(attempt: Span, trace: Trace, error: str) -> None:
    attempt.set_attribute("iop.bytes_out", trace.bytes_out)
    if error:
        attempt.set_attribute("iop.answer.outcome", error)
        attempt.fail(error)


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
        span.fail(rec.error, server=rec.status >= 500 or rec.status == 0)
    span.end()
