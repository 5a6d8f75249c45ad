"""The edge's queue, HTTP, ledger and stored-responses blocks (`edge.queue`, `edge.http`,
`edge.ledger`, `edge.responses`).

Kept apart from iop/config.py (which imports them) so that the edge's tuning stays in one module.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

Seconds = Annotated[float, Meta(gt=0)]


class _Strict(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class QueueSettings(_Strict):
    """The wait queue in front of each pool."""

    timeout_s: Annotated[Seconds, Meta(description="Longest a pool request waits for a free slot (then 503).")] = 60.0
    max_waiting: Annotated[int, Meta(ge=1, description="Requests that may wait per pool; one more gets 429.")] = 1000
    max_waiting_mb: Annotated[
        float,
        Meta(
            gt=0,
            description="Request bytes waiting requests may hold in the edge's memory, all pools together, "
            "in MiB; a request that would pass it gets 429.",
        ),
    ] = 256.0
    fair_queueing: Annotated[bool, Meta(description="Fair between tenants (see docs); off: oldest first.")] = True
    standby: Annotated[
        int, Meta(ge=0, le=64, description="Requests per provider waiting in the broker while its slots are busy.")
    ] = 1
    anticipate_ms: Annotated[
        float,
        Meta(
            ge=0,
            le=1000,
            description="How long a slot freed by a tenant that asks again at once is kept for its next "
            "request while others wait; 0: never.",
        ),
    ] = 10.0


class HttpSettings(_Strict):
    """Limits on client connections, enforced before a request reaches authentication."""

    max_head_kb: Annotated[
        int, Meta(ge=1, le=1024, description="Largest request head (line + headers), KiB; 431 above.")
    ] = 64
    max_headers: Annotated[int, Meta(ge=8, le=1000, description="Most headers in one request; 431 above.")] = 100
    head_timeout_s: Annotated[
        float, Meta(gt=0, le=600, description="Time a client has to send a request head, from connect; 408 after.")
    ] = 10.0
    body_idle_timeout_s: Annotated[
        float, Meta(gt=0, le=3600, description="Longest silence while a request body is being received; 408 after.")
    ] = 30.0
    keepalive_s: Annotated[
        int, Meta(ge=1, le=3600, description="An idle kept-alive connection is closed after this many seconds.")
    ] = 5
    max_connections: Annotated[
        int, Meta(ge=16, le=1_000_000, description="Open client connections; a newcomer past it gets 503.")
    ] = 4096


class LedgerSettings(_Strict):
    """The usage ledger: one record per request in the JetStream stream IOP_LEDGER."""

    enabled: Annotated[bool, Meta(description="Write a record of every request to the ledger.")] = True
    max_age: Annotated[
        Seconds, Meta(description="Seconds a record is kept (default 30 days); older ones are removed.")
    ] = 30 * 86400.0
    max_bytes: Annotated[
        int, Meta(ge=1024 * 1024, description="Most bytes the ledger holds (default 1 GiB); the oldest go first.")
    ] = 1024**3
    buffer_records: Annotated[
        int,
        Meta(
            ge=1,
            description="Records the edge keeps while NATS is unreachable; past it they are lost, counted "
            "(iop_ledger_dropped_total) and logged.",
        ),
    ] = 100_000


class ResponsesSettings(_Strict):
    """Stored responses (what `store: true` keeps, in the KV bucket iop_responses); what a key holds open."""

    enabled: Annotated[
        bool, Meta(description="Keep each response whose request has `store` true (the default); off: keep none.")
    ] = True
    max_age: Annotated[Seconds, Meta(description="Seconds a stored response is kept (default 30 days).")] = 2592000.0
    max_bytes: Annotated[int, Meta(ge=1 << 20, description="Most bytes stored responses take; oldest go first.")] = (
        1 << 30
    )
    max_sockets_per_key: Annotated[int, Meta(ge=1, description="WebSockets one client key holds open on an edge.")] = 64
    max_background_per_key: Annotated[int, Meta(ge=1, description="Background responses of one key on an edge.")] = 64
    cache_mb: Annotated[int, Meta(ge=0, description="MiB of stored turns (JSON) an edge holds in memory; 0: none")] = 64
