"""Scenario: tenants' limits exact through three edges on one NATS (issue 26), 10,000 requests.

Three `iop edge` processes on one nats-server (the bench's own, work in memory: `--nats`), one
node, one bench upstream process answering in `service_ms` on two ports, one provider each
(capacity 16):

    pool mc   tenant conc, max_concurrent 4: the upstream counts every request arriving while 4
              of that port's are already in flight (`over_cap`) and the peak in flight
    pool rt   tenant rate, rpm 500; tenant toks, tpm 20,000 (max_tokens 24 each: the upstream's
              usage is 8 + 24 tokens, the edge's estimate at admission a little more)

Closed loops of keep-alive connections, each tenant's spread evenly over the three edges (conc 24,
rate 8, toks 8), until 10,000 requests are answered (conc 60 %, rate and toks 20 % each) or
`max_seconds`. A 429 is an answer. The run is shorter than a minute, so all of it lies within one
60-second window: `rate` must have exactly 500 admitted, `toks` at most 20,000 tokens used, and
`conc` never more than 4 at the upstream. Prints the counts; the verdict is `exact`.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import load
from bench.abtest import start_upstream
from bench.procs import Owned, Proc, free_port, http_json, iop_argv, loadavg, log, status_ready, wait_until
from bench.stack import openai_pool_node, start_stack

KEYS = {"conc": "sk-bench-conc", "rate": "sk-bench-rate", "toks": "sk-bench-toks"}
KEYS_ENV = "IOP_BENCH_LIMITS_KEYS"
MAX_CONCURRENT, RPM, TPM, MAX_TOKENS = 4, 500, 20_000, 24
USED_TOKENS = 8 + MAX_TOKENS
"""What the bench upstream's usage says of each `toks` answer."""
CONNS = {"conc": 24, "rate": 8, "toks": 8}
SHARE = {"conc": 0.6, "rate": 0.2, "toks": 0.2}


@dataclass
class LimitsOptions:
    requests: int = 10_000
    service_ms: float = 5.0
    max_seconds: float = 55.0
    """Under a minute: the rpm/tpm checks count the whole run as one window."""
    archive: Path | None = None


@dataclass
class _Got:
    statuses: dict[str, Counter[int]] = field(default_factory=lambda: {t: Counter() for t in KEYS})
    errors: Counter[str] = field(default_factory=Counter)
    wall_s: float = 0.0


def run_limits(owned: Owned, workdir: Path, opts: LimitsOptions) -> dict[str, Any]:
    port_mc, port_rt = free_port(), free_port()
    up = start_upstream(
        owned,
        "upstream-limits",
        [port_mc, port_rt],
        "--cap",
        f"{MAX_CONCURRENT},16",
        "--latency",
        f"fixed:{opts.service_ms:g}",
    )
    os.environ[KEYS_ENV] = ",".join(f"{name}:{key}" for name, key in KEYS.items())
    tenants = {
        "conc": {"max_concurrent": MAX_CONCURRENT},
        "rate": {"rpm": RPM},
        "toks": {"tpm": TPM},
    }
    headers = {"authorization": f"Bearer {KEYS['conc']}"}
    stack = start_stack(
        owned,
        workdir,
        "limits",
        models=[{"alias": "mc", "pool": ["pmc"]}, {"alias": "rt", "pool": ["prt"]}],
        nodes=[openai_pool_node("limits-node", [("pmc", port_mc, 16), ("prt", port_rt, 16)])],
        storage="memory",  # a nats-server of the bench's own, without the embedded one's credentials
        archive=opts.archive,
        edge_extra={"api_keys_env": KEYS_ENV, "tenants": tenants, "queue": {"timeout_s": 120, "max_waiting": 10_000}},
        ready_headers=headers,
    )
    more: list[Proc] = []
    try:
        nats_url = _nats_url(stack.config_path)  # the server start_stack started, which the edge reached by --nats
        ports = [int(stack.url.rsplit(":", 1)[1])]
        for i in range(2):
            port = free_port()
            argv = iop_argv(opts.archive, "edge", "--config", str(stack.config_path), "--listen", f"127.0.0.1:{port}")
            more.append(owned.start(f"limits-edge{i + 2}", [*argv, "--nats", nats_url]))
            ports.append(port)
        for port in ports[1:]:
            ready = status_ready(f"http://127.0.0.1:{port}", headers=headers)
            wait_until(f"limits: edge on {port} ready", ready, 90, more)
        http_json("POST", f"http://127.0.0.1:{port_mc}/stats/reset")
        load_before = loadavg()
        got = asyncio.run(_run(ports, opts))
        stats = http_json("GET", f"http://127.0.0.1:{port_mc}/stats")
    finally:
        for p in more:
            owned.stop(p)
        stack.stop()
        owned.stop(up)
        os.environ.pop(KEYS_ENV, None)
    mc, rt = stats["ports"]
    admitted = {t: got.statuses[t][200] for t in KEYS}
    answered = sum(sum(c.values()) for c in got.statuses.values())
    tokens = admitted["toks"] * USED_TOKENS
    sent = {t: sum(got.statuses[t].values()) for t in KEYS}
    exact = (
        mc["peak_in_flight"] <= MAX_CONCURRENT
        and mc["over_cap"] == 0
        and admitted["rate"] == min(RPM, sent["rate"])  # never more, and the limit used (not refused early)
        and tokens <= TPM
        and got.statuses["conc"][200] == sent["conc"]  # over max_concurrent waits, never refused
        and not got.errors
    )
    out = {
        "edges": 3,
        "requests": answered,
        "wall_s": round(got.wall_s, 2),
        "requests_per_s": round(answered / max(got.wall_s, 1e-9), 1),
        "statuses": {t: dict(c) for t, c in got.statuses.items()},
        "errors": dict(got.errors),
        "max_concurrent": {"limit": MAX_CONCURRENT, "peak_at_upstream": mc["peak_in_flight"], "over": mc["over_cap"]},
        "rpm": {"limit": RPM, "admitted": admitted["rate"]},
        "tpm": {"limit": TPM, "tokens_used": tokens, "admitted": admitted["toks"]},
        "upstream_requests": mc["total"] + rt["total"],
        "exact": exact,
        "loadavg": [load_before, loadavg()],
    }
    log(
        f"limits: {answered} answers through 3 edges in {out['wall_s']} s; conc peak {mc['peak_in_flight']} of "
        f"{MAX_CONCURRENT} (over {mc['over_cap']}), rate {admitted['rate']} admitted of {RPM} rpm, toks "
        f"{tokens} tokens of {TPM} tpm; errors {dict(got.errors)}; exact: {exact}"
    )
    return out


def _nats_url(config: Path) -> str:
    listen = json.loads(config.read_text())["edge"]["nats"]["listen"]
    return f"nats://{listen}"


def _request(port: int, tenant: str) -> bytes:
    model = "mc" if tenant == "conc" else "rt"
    body = load.body_of("chat", model, False, MAX_TOKENS if tenant == "toks" else 0)
    return (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n"
        f"authorization: Bearer {KEYS[tenant]}\r\n"
        f"content-type: application/json\r\naccept: */*\r\ncontent-length: {len(body)}\r\n\r\n"
    ).encode() + body


async def _run(ports: list[int], opts: LimitsOptions) -> _Got:
    loop = asyncio.get_running_loop()
    got = _Got()
    left = {t: int(opts.requests * SHARE[t]) for t in KEYS}
    t0 = time.monotonic()
    deadline = t0 + opts.max_seconds

    async def client(tenant: str, port: int) -> None:
        request = _request(port, tenant)
        _, conn = await loop.create_connection(load.Conn, "127.0.0.1", port)
        try:
            while left[tenant] > 0 and time.monotonic() < deadline:
                left[tenant] -= 1
                try:
                    async with asyncio.timeout(max(1.0, deadline - time.monotonic())):
                        a = await conn.send(request)
                except (TimeoutError, ConnectionError) as exc:
                    got.errors[type(exc).__name__] += 1
                    return
                got.statuses[tenant][a.status] += 1
                if not a.keep_alive:
                    conn.abort()
                    _, conn = await loop.create_connection(load.Conn, "127.0.0.1", port)
        finally:
            conn.abort()

    await asyncio.gather(*(client(t, ports[i % len(ports)]) for t, n in CONNS.items() for i in range(n)))
    got.wall_s = time.monotonic() - t0
    return got
