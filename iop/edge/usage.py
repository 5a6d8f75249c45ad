"""`GET /usage` (the usage table over a time range) and `GET /usage/tail` (records as they are written)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from nats.js.client import JetStreamContext
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Scope

from iop.contracts.usage import parse_query, parse_time
from iop.edge.keys import EdgeKeys
from iop.edge.ledger import RequestRecord
from iop.edge.tail import TailFeed
from iop.edge.usage_query import Aggregate, read_records, record_json, to_csv
from iop.errors import BadRequest, Unavailable

Endpoint = Callable[[Request], Awaitable[Response]]
Sink = Callable[[list[RequestRecord]], None]


def _reader(keys: EdgeKeys, scope: Scope) -> str | None:
    """Whose records the caller may read: None for everyone's (an admin key, or an edge without
    client keys), else the name of its own client key (Unauthorized without one).

    The ledger names every client's keys, models and traffic: a client sees only its own. Unlike
    /admin/*, being on the edge's machine is no admin key here: with client keys on, a caller
    without a key reads nothing.
    """
    if keys.holds_admin_key(scope):
        return None
    key = keys.client(scope)
    return key.name if key is not None else None


def _only(who: str | None, sink: Sink) -> Sink:
    if who is None:
        return sink
    return lambda records: sink([r for r in records if r.key == who])


def usage_endpoint(keys: EdgeKeys, js: JetStreamContext, *, ledger_on: bool) -> Endpoint:
    """`ledger_on`: this edge writes the ledger (else both endpoints answer 503)."""

    async def usage(request: Request) -> Response:
        who = _reader(keys, request.scope)
        q = request.query_params
        fmt = q.get("format", "json")
        if fmt not in ("json", "csv"):
            raise BadRequest(f"'format' must be json or csv; got {fmt!r}", param="format")
        query = parse_query(q.get("since"), q.get("until"), q.get("by"))
        if not ledger_on:
            raise Unavailable("the ledger is off on this edge (edge.ledger.enabled: false)", code="ledger_disabled")
        agg = Aggregate(query)
        await read_records(js, query, _only(who, agg.add))
        table = agg.table()
        table["records"] = agg.records
        if fmt == "csv":
            return Response(to_csv(table), media_type="text/csv")
        return JSONResponse(table)

    return usage


def usage_tail_endpoint(keys: EdgeKeys, js: JetStreamContext, closing: asyncio.Event, *, ledger_on: bool) -> Endpoint:
    """`closing` is set when the edge starts to stop: every open tail ends at once."""
    feed = TailFeed(js)

    async def tail(request: Request) -> Response:
        who = _reader(keys, request.scope)
        if not ledger_on:
            raise Unavailable("the ledger is off on this edge (edge.ledger.enabled: false)", code="ledger_disabled")
        alias = request.query_params.get("model") or None
        since_text = request.query_params.get("since")
        since = parse_time(since_text, "since", time.time()) if since_text else None
        follower = await feed.join(who, alias, since)

        async def lines() -> AsyncIterator[bytes]:
            stopping = asyncio.ensure_future(closing.wait())
            try:
                yield b""  # the headers go out at once: the client knows it is following
                while True:
                    get = asyncio.ensure_future(follower.queue.get())
                    await asyncio.wait((get, stopping), return_when=asyncio.FIRST_COMPLETED)
                    if not get.done():
                        # The edge is stopping: end the stream, or its graceful shutdown waits for
                        # every follower (a status page holds one) until the grace period is over.
                        get.cancel()
                        return
                    yield record_json(get.result()) + b"\n"
            finally:
                stopping.cancel()
                await feed.leave(follower)

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    return tail
