"""The node's spans of one work item, under the edge's try whose context came with the work (iop/tracing).

    iop.attempt {provider}              (edge) the try, whose context the message headers carry
      iop.node.work                     taking the work and running it here (CONSUMER)
        chat {model}                    the upstream call (CLIENT): first byte, tokens, status;
                                        the request carries its `traceparent` upstream
        iop.cli {resource}              or the CLI process: exit code

Only for an item whose sampled context came with it; metadata only (the prompt and the answer
stay out, as in the ledger).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from iop import config, wire
from iop import tracing as tr
from iop.node.adapters.base import Outcome
from iop.node.resource import Resource
from iop.tracing import Span


def work(
    tracing: tr.Tracing,
    headers: Mapping[str, str],
    r: Resource,
    item: wire.WorkItem,
    node: str,
    delivered: int,
    stored_ms: float | None,
) -> Span | None:
    """The span of taking and running `item`, continuing its try's trace; None when it came untraced.

    `stored_ms`: how long the work waited in the work stream before this node took it."""
    span = tracing.continued(
        headers,
        "iop.node.work",
        tr.CONSUMER,
        {
            "iop.node": node,
            "iop.provider": r.cfg.id,
            "iop.request_id": item.request_id,
            "iop.kind": r.kind,
            "messaging.system": "nats",
            "messaging.operation.type": "process",
            "iop.delivered": delivered,
        },
    )
    if span is not None and stored_ms is not None:
        span.set_attribute("iop.stream_wait_ms", round(stored_ms, 3))
    return span


def call(tracing: tr.Tracing, parent: Span, r: Resource, adapter: config.Adapter | None, item: wire.WorkItem) -> Span:
    """The upstream call (GenAI client span) or the CLI process, under the node's work span."""
    attributes: dict[str, Any] = {"iop.provider": r.cfg.id}
    if r.kind == "cli":
        name = f"iop.cli {r.cfg.id}"
    else:
        model = r.cfg.model or item.alias
        name = f"chat {model}"
        attributes |= {
            "gen_ai.operation.name": "embeddings" if item.api == "embeddings" else "chat",
            "gen_ai.request.model": model,
            "iop.api": item.api,
            "iop.stream": item.stream,
        }
        if isinstance(adapter, config.OpenAIAdapter):
            attributes["gen_ai.provider.name"] = "openai"  # the protocol it speaks: OpenAI-compatible
            attributes["server.address"] = _host(adapter.base_url)
    if tracing.content:
        attributes["gen_ai.input.messages"] = tr.content(item.body)  # tracing.content: debugging only
    return tracing.child(parent, name, tr.INTERNAL if r.kind == "cli" else tr.CLIENT, attributes)


def ended(
    work: Span,
    call: Span | None,
    outcome: Outcome,
    usage: wire.Usage | None,
    error: str,
    first_byte_ms: float,
) -> None:
    """What the run learnt, on both spans, and both end."""
    if call is not None:
        attributes: dict[str, Any] = {}
        if outcome.upstream_status:
            attributes["http.response.status_code"] = outcome.upstream_status
        if outcome.exit_code is not None:
            attributes["process.exit.code"] = outcome.exit_code
        if first_byte_ms:
            attributes["iop.ttfb_ms"] = first_byte_ms
        used = usage or outcome.usage
        if used is not None:
            attributes["gen_ai.usage.input_tokens"] = used.input_tokens
            attributes["gen_ai.usage.output_tokens"] = used.output_tokens
        call.set_attributes(attributes)
        if error:
            call.fail(error)
        call.end()
    work.set_attribute("iop.outcome", error or "ok")
    if error:
        work.fail(error)
    work.end()


def _host(url: str) -> str:
    rest = url.split("://", 1)[-1]
    return rest.split("/", 1)[0].rsplit("@", 1)[-1]
