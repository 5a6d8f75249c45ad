"""Scenario: routing by expected finish time against free-slot ranking, on a mixed pool.

Two fake upstreams of known speed, as a GPU box beside a Mac running MLX: `gpu` (time to first
token 40 ms, 5 ms per token) and `mac` (250 ms, 25 ms per token), capacity 4 each, one pool
served under two aliases of one stack: `mixed` (routing: expected_finish, the default) and
`mixed-free` (routing: free_slots). The same open-loop load on each (Poisson arrivals at a fixed
rate, seeded; streamed answers of 64 tokens), the two runs alternating per round, at rates from
one the fast provider alone nearly always has a free slot for up to the pool's saturation on a
loaded 2-core machine (about 9 req/s: free-slot ranking's throughput stops following the offered
load past it). Per rate and routing: the client's end-to-end latency over every round's requests
(mean, p50, p99), the throughput, and the share each provider got.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx

from bench import load
from bench.procs import Owned, free_port, http_json, log, wait_until
from bench.stack import openai_pool_node, start_stack

PROVIDERS = (("gpu", 40.0, 5.0), ("mac", 250.0, 25.0))
"""(id, time to first token ms, ms per token) of each fake upstream."""


@dataclass
class RoutingOptions:
    rates_per_s: tuple[float, ...] = (1.0, 2.0, 4.0, 8.0)
    """Offered loads: at 1/s the fast provider is full for under 1 % of the arrivals, at 4/s for
    several percent, at 8/s (its capacity alone, 4 / ~0.45 s on a loaded machine) often."""
    requests: int = 60
    """Per run, at least (its length is requests / rate) ..."""
    min_seconds: float = 15.0
    """... and at least this long (more requests at the higher rates)."""
    tokens: int = 64
    capacity: int = 4
    rounds: int = 2
    seed: int = 27
    storage: str = "file"
    archive: Path | None = None


def run_routing(owned: Owned, workdir: Path, opts: RoutingOptions) -> dict[str, Any]:
    ports: dict[str, int] = {}
    for pid, ttft_ms, token_ms in PROVIDERS:
        ports[pid] = port = free_port()
        argv = [sys.executable, "-m", "bench.upstream", "--port", str(port), "--cap", str(opts.capacity)]
        argv += [
            "--latency",
            f"fixed:{ttft_ms:g}",
            "--token-interval-ms",
            f"{token_ms:g}",
            "--tokens",
            str(opts.tokens),
        ]
        argv += ["--write", "each", "--seed", str(opts.seed)]
        up = owned.start(f"upstream-{pid}", argv)
        wait_until(f"{pid} upstream", partial(_answers, f"http://127.0.0.1:{port}/stats"), 15, [up])
    providers = [(pid, ports[pid], opts.capacity) for pid, _, _ in PROVIDERS]
    members = [pid for pid, _, _ in PROVIDERS]
    stack = start_stack(
        owned,
        workdir,
        "routing",
        models=[
            {"alias": "mixed", "pool": members},
            {"alias": "mixed-free", "pool": members, "routing": "free_slots"},
        ],
        nodes=[openai_pool_node("mixed-node", providers)],
        storage=opts.storage,
        archive=opts.archive,
    )
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    try:
        # A few requests so the router has measured both providers (as any running edge has).
        asyncio.run(_load(stack.url, "mixed", 2.0, 3.0, opts.tokens, opts.seed))
        for rate in opts.rates_per_s:
            at_rate = runs[f"{rate:g}"] = {"expected_finish": [], "free_slots": []}
            for r in range(opts.rounds):
                order = ("free_slots", "expected_finish") if r % 2 == 0 else ("expected_finish", "free_slots")
                for name in order:
                    alias = "mixed" if name == "expected_finish" else "mixed-free"
                    seconds = max(opts.requests / rate, opts.min_seconds)
                    got = asyncio.run(_load(stack.url, alias, rate, seconds, opts.tokens, opts.seed + r))
                    at_rate[name].append(got)
                    lat = got["latency_ms"] or {}
                    log(
                        f"routing {rate:g}/s {name} round {r + 1}: mean {lat.get('mean')} ms, p99 {lat.get('p99')} ms, "
                        f"{got['throughput_rps']} req/s, {got['per_provider']}"
                    )
    finally:
        stack.stop()
    return {
        "providers": [{"id": p, "ttft_ms": t, "ms_per_token": m, "capacity": opts.capacity} for p, t, m in PROVIDERS],
        "requests_per_run": opts.requests,
        "rounds": opts.rounds,
        "tokens": opts.tokens,
        "runs": runs,
        "summary": {rate: {name: _pooled(rs) for name, rs in by.items()} for rate, by in runs.items()},
    }


def _answers(url: str) -> bool:
    return bool(http_json("GET", url, timeout=2))


def _pooled(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Every round's requests together: their latency percentiles, the throughput, the providers' shares."""
    latencies = [ms for r in rounds for ms in r.pop("latencies")]
    shares: dict[str, int] = {}
    for r in rounds:
        for p, n in r["per_provider"].items():
            shares[p] = shares.get(p, 0) + n
    done = len(latencies)
    wall = sum(r["wall_s"] for r in rounds)
    return {
        "requests": sum(r["requests"] for r in rounds),
        "errors": sum(r["errors"] for r in rounds),
        "latency_ms": load.percentiles(latencies),
        "throughput_rps": round(done / wall, 2) if wall else None,
        "per_provider": shares,
    }


async def _load(url: str, alias: str, rate: float, seconds: float, tokens: int, seed: int) -> dict[str, Any]:
    """Open loop: requests at seeded Poisson arrivals for `seconds`; each one's end-to-end time."""
    rng = random.Random(seed)
    at, arrivals = 0.0, []
    while at < seconds:
        arrivals.append(at)
        at += rng.expovariate(rate)
    latencies: list[float] = []
    per_provider: dict[str, int] = {}
    errors = 0
    body = {
        "model": alias,
        "messages": [{"role": "user", "content": "route me"}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": tokens,
    }
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
        t0 = time.monotonic()

        async def one(when: float) -> None:
            nonlocal errors
            await asyncio.sleep(max(0.0, t0 + when - time.monotonic()))
            sent = time.monotonic()
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                async for _ in r.aiter_bytes():
                    pass
                if r.status_code != 200:
                    errors += 1
                    return
                provider = r.headers.get("x-iop-provider", "?")
            latencies.append((time.monotonic() - sent) * 1000)
            per_provider[provider] = per_provider.get(provider, 0) + 1

        await asyncio.gather(*(one(w) for w in arrivals))
        wall = time.monotonic() - t0
    return {
        "requests": len(arrivals),
        "errors": errors,
        "wall_s": round(wall, 2),
        "throughput_rps": round(len(latencies) / wall, 2),
        "latency_ms": load.percentiles(latencies),
        "per_provider": per_provider,
        "latencies": latencies,
    }
