"""`iop status`: fetch an edge's /status and print it as tables."""

from __future__ import annotations

from typing import Any

import httpx

from iop.errors import IopError


def fetch_status(edge_url: str, api_key: str | None = None, timeout_s: float = 5.0) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(edge_url.rstrip("/") + "/status", headers=headers, timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise IopError(f"cannot reach the edge at {edge_url}: {type(exc).__name__}: {exc}") from exc
    if r.status_code != 200:
        raise IopError(f"{edge_url}/status answered {r.status_code}: {r.text[:200]}")
    data: dict[str, Any] = r.json()
    return data


def post_refresh(
    edge_url: str, text: str, dry_run: bool, api_key: str | None = None, timeout_s: float = 60.0
) -> tuple[int, dict[str, Any]]:
    """Send a deployment file to the edge's refresh endpoint; returns (status, JSON answer)."""
    headers = {"content-type": "application/yaml"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    url = edge_url.rstrip("/") + "/admin/refresh" + ("?dry_run=1" if dry_run else "")
    try:
        r = httpx.post(url, content=text.encode(), headers=headers, timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise IopError(f"cannot reach the edge at {edge_url}: {type(exc).__name__}: {exc}") from exc
    if r.status_code not in (200, 400, 500):
        raise IopError(f"{url} answered {r.status_code}: {r.text[:200]}")
    data: dict[str, Any] = r.json()
    return r.status_code, data


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def render_status(data: dict[str, Any]) -> str:
    edge = data.get("edge", {})
    out = [f"edge {edge.get('id')} v{edge.get('version')} up {edge.get('uptime_s', 0):.0f}s nats={edge.get('nats')}"]
    header = "NODE CONNECTED PROVIDER KIND TYPE CAPACITY IN-FLIGHT QUEUED PEAK SERVED FAILED"
    rows = [header.split()]
    for n in data.get("nodes", []):
        seen = n.get("last_seen_s_ago")
        conn = ("yes" if n["connected"] else "no") + (f" ({seen:.1f}s)" if seen is not None else "")
        if n.get("legacy_concurrency") is not None:
            conn += f" legacy-concurrency={n['legacy_concurrency']}"
        provs = n.get("providers") or [{}]
        for i, p in enumerate(provs):
            cap = "unlimited" if p.get("unlimited") else str(p.get("capacity", ""))
            if p.get("breaker") in ("open", "half_open"):
                cap += f" ({p['breaker'].replace('_', '-')})"
            rows.append(
                [
                    n["id"] if i == 0 else "",
                    conn if i == 0 else "",
                    p.get("id", "-"),
                    p.get("kind", ""),
                    p.get("type", ""),
                    cap,
                    str(p.get("in_flight", "")),
                    str(p.get("queued", "-")),
                    str(p.get("peak_in_flight", "")),
                    str(p.get("served", "")),
                    str(p.get("failed", "")),
                ]
            )
    out += ["", _table(rows)]
    pools = data.get("pools", [])
    if pools:
        prow = [["POOL", "CANDIDATES", "CONNECTED", "CAPACITY", "IN FLIGHT", "WAITING"]]
        for p in pools:
            prow.append(
                [
                    p["alias"],
                    str(len(p["candidates"])),
                    str(p["connected_candidates"]),
                    f"{p['connected_capacity']}/{p['total_capacity']}",
                    str(p["in_flight"]),
                    str(p["waiting"]),
                ]
            )
        out += ["", _table(prow)]
    routes = data.get("routes", [])
    if routes:
        rrow = [["ROUTE", "NODE", "RESOURCE", "CONNECTED"]]
        for r in routes:
            rrow.append([r["alias"], r["node"], r["resource"], "yes" if r["connected"] else "no"])
        out += ["", _table(rrow)]
    return "\n".join(out)
