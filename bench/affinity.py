"""Scenario: prefix-cache affinity on a pool of three providers (capacities 2, 4, 4).

16 sessions, each 20 turns of a growing conversation (every turn adds the answer and a new
~500-token message), run at once with a think time between turns (an agent running its tools).
Each provider is a bench/prefixcache.py port: a model server whose time to first token is
proportional to the part of the prompt not in its own bounded cache. Three runs on one stack, the
caches emptied before each:

    off      no session key: every turn goes wherever is free (iop without affinity)
    on       `prompt_cache_key` per session, the pool's affinity_wait_ms 0 (the default)
    on_wait  the same on a pool alias with affinity_wait_ms set (waits that long for the session's provider)

Per run: the warm-turn rate (turns after the first whose whole previous turn was still cached at
the provider that got them), cached / prompt tokens, time to first token at the client (through
iop: queue wait included), and the edge's /status affinity hits.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench import load
from bench.procs import Owned, free_port, http_json, log, wait_until
from bench.stack import openai_pool_node, start_stack

CAPACITIES = (2, 4, 4)


@dataclass
class AffinityOptions:
    sessions: int = 16
    turns: int = 20
    message_chars: int = 2_000
    """Each new user message (about 500 tokens)."""
    think_ms: tuple[float, float] = (200.0, 600.0)
    """Pause between a session's answer and its next turn (uniform, seeded): an agent running its tools.
    Long enough that the pool is not saturated, so the figures show the cache, not the queue."""
    cache_tokens: int = 96_000
    prefill_us_per_token: float = 20.0
    decode_ms: float = 16.0
    wait_ms: float = 100.0
    """affinity_wait_ms of the `on_wait` run's alias."""
    seed: int = 19
    max_seconds: float = 120.0
    storage: str = "file"
    archive: Path | None = None


def run_affinity(owned: Owned, workdir: Path, opts: AffinityOptions) -> dict[str, Any]:
    ports = [free_port() for _ in CAPACITIES]
    argv = [sys.executable, "-m", "bench.prefixcache", *[x for p in ports for x in ("--port", str(p))]]
    argv += ["--cache-tokens", str(opts.cache_tokens), "--prefill-us-per-token", str(opts.prefill_us_per_token)]
    argv += ["--decode-ms", str(opts.decode_ms)]
    up = owned.start("prefixcache", argv)
    base = f"http://127.0.0.1:{ports[0]}"
    wait_until("prefixcache upstream", lambda: bool(http_json("GET", base + "/stats", timeout=2)), 15, [up])
    providers = [(f"p{i}-cap{c}", port, c) for i, (port, c) in enumerate(zip(ports, CAPACITIES, strict=True))]
    members = [p[0] for p in providers]
    stack = start_stack(
        owned,
        workdir,
        "affinity",
        models=[
            {"alias": "pc", "pool": members},
            {"alias": "pc-wait", "pool": members, "affinity_wait_ms": opts.wait_ms},
        ],
        nodes=[openai_pool_node("pc-node", providers)],
        storage=opts.storage,
        archive=opts.archive,
    )
    runs: dict[str, Any] = {}
    try:
        for name, alias, keyed in (("off", "pc", False), ("on", "pc", True), ("on_wait", "pc-wait", True)):
            http_json("POST", base + "/reset")
            before = _hits(stack.url, alias)
            t0 = time.monotonic()
            ttft = asyncio.run(_sessions(stack.url, alias, keyed, name, opts))
            wall = time.monotonic() - t0
            after = _hits(stack.url, alias)
            per_port = http_json("GET", base + "/stats")
            runs[name] = _summary(name, alias, keyed, ttft, wall, per_port, providers, before, after)
            r = runs[name]
            log(
                f"affinity {name}: warm turns {r['warm_rate']}, cached tokens {r['cached_token_rate']}, "
                f"mean TTFT {r['ttft_ms']['mean'] if r['ttft_ms'] else None} ms, affinity hits {r['affinity_hits']}"
            )
    finally:
        stack.stop()
        owned.stop(up)
    return {
        "sessions": opts.sessions,
        "turns": opts.turns,
        "capacities": list(CAPACITIES),
        "cache_tokens_per_provider": opts.cache_tokens,
        "prefill_us_per_token": opts.prefill_us_per_token,
        "decode_ms": opts.decode_ms,
        "think_ms": list(opts.think_ms),
        "wait_ms": opts.wait_ms,
        "runs": runs,
    }


def _hits(url: str, alias: str) -> tuple[int, int]:
    pool = next(p for p in http_json("GET", url + "/status")["pools"] if p["alias"] == alias)
    return pool.get("affinity_hits", 0), pool.get("affinity_misses", 0)


def _summary(
    name: str,
    alias: str,
    keyed: bool,
    ttft: list[tuple[int, float]],
    wall: float,
    per_port: dict[str, dict[str, int]],
    providers: list[tuple[str, int, int]],
    before: tuple[int, int],
    after: tuple[int, int],
) -> dict[str, Any]:
    stats = list(per_port.values())
    follow_ups = sum(s["follow_ups"] for s in stats)
    prompt = sum(s["prompt_tokens"] for s in stats)
    later = [ms for turn, ms in ttft if turn > 0]
    return {
        "alias": alias,
        "session_key": keyed,
        "requests": len(ttft),
        "wall_s": round(wall, 2),
        "warm_rate": round(sum(s["warm"] for s in stats) / follow_ups, 4) if follow_ups else None,
        "cached_token_rate": round(sum(s["cached_tokens"] for s in stats) / prompt, 4) if prompt else None,
        "ttft_ms": load.percentiles([ms for _, ms in ttft]),
        "ttft_later_turns_ms": load.percentiles(later),
        "affinity_hits": after[0] - before[0],
        "affinity_misses": after[1] - before[1],
        "per_provider": {pid: per_port[str(port)]["requests"] for pid, port, _ in providers},
    }


async def _sessions(url: str, alias: str, keyed: bool, run: str, opts: AffinityOptions) -> list[tuple[int, float]]:
    """Every session's turns; returns (turn, time to first body byte in ms) per request."""
    out: list[tuple[int, float]] = []
    rng = random.Random(f"{opts.seed}-{run}")
    limits = httpx.Limits(max_connections=opts.sessions * 2, max_keepalive_connections=opts.sessions * 2)
    deadline = time.monotonic() + opts.max_seconds
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:

        async def session(sid: int) -> None:
            messages: list[dict[str, str]] = [{"role": "system", "content": f"run {run}, session {sid}: you code."}]
            for turn in range(opts.turns):
                if time.monotonic() > deadline:
                    return
                text = f"session {sid} turn {turn}: " + rng.choice("abcdefgh") * opts.message_chars
                messages.append({"role": "user", "content": text})
                body: dict[str, Any] = {"model": alias, "messages": messages, "stream": True}
                if keyed:
                    body["prompt_cache_key"] = f"{run}-session-{sid}"
                sent = time.monotonic()
                first = 0.0
                parts = []
                async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                    if r.status_code != 200:
                        raise RuntimeError(f"affinity: HTTP {r.status_code}: {(await r.aread())[:200]!r}")
                    async for chunk in r.aiter_bytes():
                        if not first:
                            first = time.monotonic()
                        parts.append(chunk)
                out.append((turn, (first - sent) * 1000))
                answer = "".join(
                    ev.get("choices", [{}])[0].get("delta", {}).get("content") or ""
                    for ev in load_events(b"".join(parts))
                )
                messages.append({"role": "assistant", "content": answer})
                await asyncio.sleep(rng.uniform(*opts.think_ms) / 1000)

        await asyncio.gather(*(session(i) for i in range(opts.sessions)))
    return out


def load_events(data: bytes) -> list[dict[str, Any]]:
    events = []
    for line in data.split(b"\n"):
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            ev = json.loads(line[6:])
            if ev.get("choices"):
                events.append(ev)
    return events
