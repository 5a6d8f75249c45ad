"""`iop usage`: the `/usage` table and the followed records as text."""

from __future__ import annotations

import time
from typing import Any


def to_table(table: dict[str, Any]) -> str:
    """The text table `iop usage` prints."""
    by = table["by"]
    head = [k.upper() for k in by] + ["REQUESTS", "ERRORS", "TOKENS-IN", "TOKENS-OUT", "CACHED", "P50-MS", "P95-MS"]
    head += ["QUEUE-P50", "QUEUE-P95"]
    rows = [head]

    def num(v: object) -> str:
        return "-" if v is None else f"{v:g}" if isinstance(v, float) else str(v)

    for r in table["rows"]:
        cells = [str(r[k]) if r[k] != "" else "-" for k in by]
        cells += [num(r[c]) for c in ("requests", "errors", "input_tokens", "output_tokens", "cached_tokens")]
        cells += [num(r[c]) for c in ("duration_p50_ms", "duration_p95_ms", "queue_p50_ms", "queue_p95_ms")]
        rows.append(cells)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = [f"usage {table['since']} .. {table['until']}"]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    if not table["rows"]:
        lines.append("(no requests in this range)")
    return "\n".join(lines)


def record_line(r: dict[str, Any]) -> str:
    """One followed record as a line: time, id, model, route, where, status, times, tokens."""
    when = time.strftime("%H:%M:%S", time.localtime(r["start"]))
    where = f"{r.get('node') or '-'}/{r.get('provider') or '-'}"
    tokens = "-" if r.get("input_tokens") is None else f"{r['input_tokens']}/{r.get('output_tokens') or 0}"
    queue = "-" if r.get("queue_ms") is None else f"{r['queue_ms']:.1f}"
    err = f" {r['error']}" if r.get("error") else ""
    key = f" key={r['key']}" if r.get("key") else ""
    trace = f" trace={r['trace_id']}" if r.get("trace_id") else ""
    return (
        f"{when} {r['id']} {r.get('alias') or '-'} {r.get('route') or '-'} {where} {r['status']}{err} "
        f"{r['duration_ms']:.1f}ms queue={queue}ms tokens={tokens}{key}{trace}"
    )
