"""Reading the ledger back: the ordered read and the usage table (the query is iop/contracts/usage.py).

`read_records` reads IOP_LEDGER with an ordered consumer from the first message at or after
`since` to the last one present when the read began.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import io
import logging
import operator
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import msgspec
import nats.js.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js import api as js_api

from iop.contracts.usage import COLUMNS, Query
from iop.edge.ledger import LEDGER_STREAM, LEDGER_SUBJECTS, RequestRecord, decode_batch, ledger_subject, token_of
from iop.percentile import nearest_rank

log = logging.getLogger("iop.edge")

_ATTR = {
    "model": "alias",
    "provider": "provider",
    "node": "node",
    "key": "key",
    "tenant": "tenant",
    "api": "api",
    "route": "route",
}
_ATTR["status"] = "status"
_PERIOD_S = {"day": 86400, "hour": 3600}
"""Time keys group by whole periods of Unix time (UTC), named only when the table is made."""


def _period_name(key: str, n: int) -> str:
    return time.strftime("%Y-%m-%d" if key == "day" else "%Y-%m-%dT%H", time.gmtime(n * _PERIOD_S[key]))


@dataclass
class _Group:
    requests: int = 0
    errors: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0
    durations: list[float] = field(default_factory=list)
    queues: list[float] = field(default_factory=list)


class Aggregate:
    """Groups records by the query's keys as they are read; `rows()` gives the table."""

    def __init__(self, query: Query) -> None:
        self.query = query
        self.groups: dict[tuple[object, ...], _Group] = {}
        self.records = 0
        self._key = _grouping(query.by)

    def add(self, records: Iterable[RequestRecord]) -> None:
        since, until = self.query.since, self.query.until
        groups, key_of = self.groups, self._key
        for r in records:
            if not since <= r.start < until:
                continue
            self.records += 1
            k = key_of(r)
            g = groups.get(k)
            if g is None:
                g = groups[k] = _Group()
            g.requests += 1
            if r.error:
                g.errors += 1
            # Unknown counts (None) add nothing: a sum of what the upstreams reported.
            g.input_tokens += r.input_tokens or 0
            g.output_tokens += r.output_tokens or 0
            g.cached_tokens += r.cached_tokens or 0
            g.reasoning_tokens += r.reasoning_tokens or 0
            g.durations.append(r.duration_ms)
            if r.queue_ms is not None:
                g.queues.append(r.queue_ms)

    def rows(self) -> list[dict[str, Any]]:
        out = []
        for k in sorted(self.groups, key=lambda t: tuple(str(x) for x in t)):
            g = self.groups[k]
            row: dict[str, Any] = {
                name: _period_name(name, v) if name in _PERIOD_S else v  # type: ignore[arg-type]
                for name, v in zip(self.query.by, k, strict=True)
            }
            durations, queues = g.durations, g.queues
            row.update(
                requests=g.requests,
                errors=g.errors,
                input_tokens=g.input_tokens,
                output_tokens=g.output_tokens,
                cached_tokens=g.cached_tokens,
                reasoning_tokens=g.reasoning_tokens,
                duration_p50_ms=_pct(durations, 0.50),
                duration_p95_ms=_pct(durations, 0.95),
                queue_p50_ms=_pct(queues, 0.50),
                queue_p95_ms=_pct(queues, 0.95),
            )
            out.append(row)
        return out

    def table(self) -> dict[str, Any]:
        """The usage table: the range, the grouping, one row per group (the JSON `GET /usage` answers)."""
        q = self.query
        return {"since": _iso(q.since), "until": _iso(q.until), "by": list(q.by), "rows": self.rows()}


def _grouping(by: tuple[str, ...]) -> Callable[[RequestRecord], tuple[object, ...]]:
    """The group key of a record: one tuple, built with as little Python per record as possible."""
    if all(k in _ATTR for k in by):
        get = operator.attrgetter(*(_ATTR[k] for k in by))
        if len(by) == 1:
            return lambda r: (get(r),)
        return get
    parts: list[Callable[[RequestRecord], object]] = []
    for k in by:
        if k in _PERIOD_S:
            period = _PERIOD_S[k]
            parts.append(lambda r, p=period: int(r.start // p))  # type: ignore[misc]
        else:
            parts.append(operator.attrgetter(_ATTR[k]))
    return lambda r: tuple(p(r) for p in parts)


def _pct(values: list[float], q: float) -> float | None:
    p = nearest_rank(values, q)
    return None if p is None else round(p, 1)


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def _cell(value: object) -> object:
    """A CSV cell a spreadsheet shows as text: a name starting like a formula gets a leading `'`.

    Aliases and key names are free text; opened in a spreadsheet, `=HYPERLINK(...)` or `@SUM(...)`
    in a cell would run (OWASP's CSV injection). Numbers stay numbers.
    """
    if value is None:
        return ""
    if isinstance(value, str) and value.startswith(_FORMULA_START):
        return "'" + value
    return value


def to_csv(table: dict[str, Any]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    by = table["by"]
    w.writerow([*by, *COLUMNS])
    for row in table["rows"]:
        w.writerow([_cell(row[c]) for c in (*by, *COLUMNS)])
    return buf.getvalue()


IDLE_S = 2.0
"""A read that got nothing for this long ends: messages it expected were removed (retention) meanwhile."""


async def read_records(js: JetStreamContext, query: Query, sink: Callable[[list[RequestRecord]], None]) -> int:
    """Feed every ledger batch whose message is at or after `since` to `sink`; returns the message count.

    Records are filtered by their own start time in `sink`'s aggregate: a message is written after
    its records ended, so none of `since`'s records is in an earlier message. The read ends after
    the messages the consumer had pending when it began (later ones belong to the next read).
    """
    try:
        info = await js.stream_info(LEDGER_STREAM)
    except nats.js.errors.NotFoundError:
        return 0
    if not info.state.messages:
        return 0
    done = asyncio.Event()
    seen = 0
    skipped = 0
    target = -1

    async def on_msg(msg: Msg) -> None:
        nonlocal seen, skipped
        seen += 1
        try:
            sink(decode_batch(msg.data))
        except msgspec.DecodeError:
            skipped += 1  # said once per read below: one line per junk message was 200,000 lines
        if seen == target:
            done.set()

    sub = await js.subscribe(
        LEDGER_SUBJECTS,
        cb=on_msg,
        ordered_consumer=True,
        config=js_api.ConsumerConfig(
            deliver_policy=js_api.DeliverPolicy.BY_START_TIME, opt_start_time=datetime.fromtimestamp(query.since, UTC)
        ),
        pending_msgs_limit=1_000_000,
        pending_bytes_limit=1024 * 1024 * 1024,
    )
    try:
        ci = await sub.consumer_info()
        # Delivered so far plus still pending: every message the read owes, counted once here
        # rather than by parsing each message's metadata.
        target = (ci.delivered.consumer_seq if ci.delivered else 0) + (ci.num_pending or 0)
        if seen >= target:
            return seen
        last = -1
        while not done.is_set() and seen != last:
            last = seen
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(IDLE_S):
                    await done.wait()
    finally:
        await sub.unsubscribe()
        if skipped:
            log.warning("ledger: %d of %d messages read were not batches of records; skipped", skipped, seen)
    return seen


async def follow(
    js: JetStreamContext, alias: str | None, sink: Callable[[list[RequestRecord]], None], since: float | None = None
) -> Any:
    """Subscribe to records written from now on, or from `since` (`iop usage --tail`); returns the
    subscription."""

    async def on_msg(msg: Msg) -> None:
        try:
            sink(decode_batch(msg.data))
        except msgspec.DecodeError:
            pass

    subject = LEDGER_SUBJECTS
    if alias:
        info = await js.stream_info(LEDGER_STREAM)
        subject = ledger_subject(alias, token_of(info.config.subjects) or "")
    return await js.subscribe(
        subject,
        cb=on_msg,
        ordered_consumer=True,
        config=js_api.ConsumerConfig(deliver_policy=js_api.DeliverPolicy.NEW)
        if since is None
        else js_api.ConsumerConfig(
            deliver_policy=js_api.DeliverPolicy.BY_START_TIME, opt_start_time=datetime.fromtimestamp(since, UTC)
        ),
    )


_json = msgspec.json.Encoder()


def record_json(r: RequestRecord) -> bytes:
    """One record as a JSON object (the stored form is an array)."""
    return _json.encode(msgspec.structs.asdict(r))
