"""The deployment's `tracing:` section: where the edge and the nodes export their spans, and how many.

Kept apart from iop/config.py (which imports it) so that one concept stays in one module.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

Seconds = Annotated[float, Meta(gt=0)]


class TracingSettings(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """OpenTelemetry traces of every request (edge and nodes), exported over OTLP/HTTP; off without an endpoint."""

    endpoint: Annotated[
        Annotated[str, Meta(pattern=r"^https?://\S+$")] | None,
        Meta(
            description="OTLP/HTTP traces URL (`http://collector:4318/v1/traces`). Unset: tracing is off unless "
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT is set (either wins over this).",
        ),
    ] = None
    sample_ratio: Annotated[
        float,
        Meta(
            ge=0,
            le=1,
            description="Share of new traces recorded (parent-based: a client's sampled traceparent is followed). "
            "OTEL_TRACES_SAMPLER_ARG wins over it.",
        ),
    ] = 1.0
    service_name: Annotated[
        Annotated[str, Meta(min_length=1)] | None,
        Meta(description="service.name of the spans (default iop-edge, iop-node); OTEL_SERVICE_NAME wins."),
    ] = None
    max_queue_spans: Annotated[
        int,
        Meta(ge=16, le=1_000_000, description="Spans held for export; past it they are dropped and counted."),
    ] = 2048
    export_interval_ms: Annotated[
        int, Meta(ge=1, le=60_000, description="Most milliseconds a finished span waits before its batch is sent.")
    ] = 1000
    export_timeout_s: Annotated[
        Seconds, Meta(description="Most seconds one export (with its retries) takes before its spans are dropped.")
    ] = 5.0
    content: Annotated[
        bool,
        Meta(
            description="Debugging only: put the request body (up to 8 KiB) in the spans. They then hold "
            "prompts and tool arguments: anyone who reads the traces reads them."
        ),
    ] = False
