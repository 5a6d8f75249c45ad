"""A small OTLP/HTTP trace receiver for the tests: the collector's `/v1/traces`, decoding the real protobuf.

What iop exports is read with OpenTelemetry's own protobuf messages (opentelemetry-proto), so a
span that a real collector could not read fails here too.
"""

from __future__ import annotations

import asyncio
import gzip
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from tests.fakes import serve_asgi

SERVER, CLIENT, PRODUCER, CONSUMER, INTERNAL = 2, 3, 4, 5, 1
"""OTLP's Span.SpanKind numbers."""


@dataclass
class SeenSpan:
    name: str
    service: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: int
    attributes: dict[str, Any]
    status: int
    """OTLP's Status.StatusCode: 0 unset, 1 ok, 2 error."""
    start_ns: int
    end_ns: int
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    """(name, attributes) of the span's events, in order."""


@dataclass
class Collector:
    spans: list[SeenSpan] = field(default_factory=list)
    posts: int = 0
    raw: list[bytes] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    """Each post's HTTP headers (lower-case names), in order."""
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    url: str = ""

    def trace(self, trace_id: str) -> list[SeenSpan]:
        """The trace's spans, each once: an exporter may send a batch again when it cannot tell that
        the first send arrived (OTLP export is at least once), as a trace backend keys spans by id."""
        seen: dict[str, SeenSpan] = {}
        for s in self.spans:
            if s.trace_id == trace_id:
                seen.setdefault(s.span_id, s)
        return list(seen.values())

    def named(self, trace_id: str, prefix: str) -> list[SeenSpan]:
        return [s for s in self.trace(trace_id) if s.name.startswith(prefix)]

    async def wait_for(self, predicate: Callable[[Collector], bool], timeout_s: float = 10.0) -> None:
        async with asyncio.timeout(timeout_s), self.changed:
            await self.changed.wait_for(lambda: predicate(self))

    async def _traces(self, request: Request) -> Response:
        body = await request.body()
        self.headers.append(dict(request.headers))
        if request.headers.get("content-encoding") == "gzip":
            body = gzip.decompress(body)
        export = ExportTraceServiceRequest()
        export.ParseFromString(body)
        self.raw.append(body)
        for resource in export.resource_spans:
            service = next((a.value.string_value for a in resource.resource.attributes if a.key == "service.name"), "")
            for scope in resource.scope_spans:
                for s in scope.spans:
                    self.spans.append(
                        SeenSpan(
                            name=s.name,
                            service=service,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_id=s.parent_span_id.hex(),
                            kind=s.kind,
                            attributes={a.key: _value(a.value) for a in s.attributes},
                            status=s.status.code,
                            start_ns=s.start_time_unix_nano,
                            end_ns=s.end_time_unix_nano,
                            events=[(e.name, {a.key: _value(a.value) for a in e.attributes}) for e in s.events],
                        )
                    )
        self.posts += 1
        async with self.changed:
            self.changed.notify_all()
        return Response(ExportTraceServiceResponse().SerializeToString(), media_type="application/x-protobuf")

    def app(self) -> Starlette:
        return Starlette(routes=[Route("/v1/traces", self._traces, methods=["POST"])])


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


@asynccontextmanager
async def otlp_collector() -> AsyncIterator[Collector]:
    collector = Collector()
    async with serve_asgi(collector.app()) as url:
        collector.url = url + "/v1/traces"
        yield collector
