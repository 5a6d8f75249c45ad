"""`GET /usage`'s query (`since`, `until`, `by`) and its table's columns: what the edge answers and `iop usage` asks.

The parsing is pure, so the command checks its options with the same rules before asking the edge.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from datetime import UTC, datetime

from iop.errors import BadRequest

GROUP_KEYS = ("model", "provider", "node", "key", "tenant", "day", "hour", "api", "route", "status")
"""What `by` may name; `model` is the alias the client asked for."""
COLUMNS = (
    "requests",
    "errors",
    "input_tokens",
    "output_tokens",
    "cached_tokens",
    "reasoning_tokens",
    "duration_p50_ms",
    "duration_p95_ms",
    "queue_p50_ms",
    "queue_p95_ms",
)
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 7 * 86400.0}
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhdw])$")


@dataclass(frozen=True)
class Query:
    since: float
    until: float
    by: tuple[str, ...]


LATEST_TIME = 253402300799.0
"""The last second of the year 9999: a time the ledger's reader (and `datetime`) can still name."""


def parse_time(value: str, param: str, now: float) -> float:
    """`7d`, `24h`, `30m`, `90s`, `2w` (that long ago), an ISO 8601 time, or a Unix time.

    The result is a time from 1970 to 9999: `nan`, `inf`, `1e20` or `99999999999d` are refused here,
    naming the parameter, rather than failing later where a time becomes a date.
    """
    text = value.strip()
    if m := _DURATION.match(text):
        return _in_range(now - float(m.group(1)) * _UNITS[m.group(2)], param, value)
    try:
        return _in_range(float(text), param, value)
    except ValueError:
        pass
    try:
        when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise BadRequest(
            f"'{param}' must be a duration like 24h or 7d, an ISO 8601 time, or a Unix time; got {value!r}",
            param=param,
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return _in_range(when.timestamp(), param, value)


def _in_range(t: float, param: str, value: str) -> float:
    if not 0.0 <= t <= LATEST_TIME:  # also false for nan
        raise BadRequest(f"'{param}' must name a time between 1970 and 9999; got {value[:64]!r}", param=param)
    return t


def parse_query(since: str | None, until: str | None, by: str | None, now: float | None = None) -> Query:
    """The query from its text parameters; BadRequest names the parameter at fault."""
    now = time.time() if now is None else now
    start = parse_time(since, "since", now) if since else now - 86400.0
    end = parse_time(until, "until", now) if until else now
    if end < start:
        raise BadRequest("'until' is before 'since'", param="until")
    keys = tuple(k.strip() for k in (by or "model").split(",") if k.strip())
    for k in keys:
        if k not in GROUP_KEYS:
            raise BadRequest(f"'by' names an unknown group key {k!r}; known: {', '.join(GROUP_KEYS)}", param="by")
    return Query(start, end, keys)
