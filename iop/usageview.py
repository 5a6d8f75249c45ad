"""`iop usage`: ask an edge's /usage for the usage table, or follow /usage/tail."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx

from iop.errors import IopError


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _error(url: str, r: httpx.Response) -> IopError:
    try:
        message = r.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = r.text[:200]
    return IopError(f"{url} answered {r.status_code}: {message}")


def fetch_usage(
    edge_url: str, params: dict[str, str], api_key: str | None = None, timeout_s: float = 120.0
) -> httpx.Response:
    """GET /usage with `params`; the answer (JSON or CSV) when it is 200, else IopError."""
    url = edge_url.rstrip("/") + "/usage"
    try:
        r = httpx.get(url, params=params, headers=_headers(api_key), timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise IopError(f"cannot reach the edge at {edge_url}: {type(exc).__name__}: {exc}") from exc
    if r.status_code != 200:
        raise _error(url, r)
    return r


def follow_usage(
    edge_url: str, model: str | None, since: str | None, api_key: str | None = None
) -> Iterator[dict[str, Any]]:
    """Records as the edge writes them (from `since` when given), until interrupted."""
    url = edge_url.rstrip("/") + "/usage/tail"
    params = {"model": model} if model else {}
    if since:
        params["since"] = since
    try:
        with httpx.stream(
            "GET", url, params=params, headers=_headers(api_key), timeout=httpx.Timeout(10.0, read=None)
        ) as r:
            if r.status_code != 200:
                r.read()
                raise _error(url, r)
            for line in r.iter_lines():
                if line:
                    yield json.loads(line)
    except httpx.HTTPError as exc:
        raise IopError(f"lost the edge at {edge_url}: {type(exc).__name__}: {exc}") from exc


def record_line(r: dict[str, Any]) -> str:
    """One followed record as a line: time, id, model, route, where, status, times, tokens."""
    import time

    when = time.strftime("%H:%M:%S", time.localtime(r["start"]))
    where = f"{r.get('node') or '-'}/{r.get('provider') or '-'}"
    tokens = "-" if r.get("input_tokens") is None else f"{r['input_tokens']}/{r.get('output_tokens') or 0}"
    queue = "-" if r.get("queue_ms") is None else f"{r['queue_ms']:.1f}"
    err = f" {r['error']}" if r.get("error") else ""
    key = f" key={r['key']}" if r.get("key") else ""
    return (
        f"{when} {r['id']} {r.get('alias') or '-'} {r.get('route') or '-'} {where} {r['status']}{err} "
        f"{r['duration_ms']:.1f}ms queue={queue}ms tokens={tokens}{key}"
    )
