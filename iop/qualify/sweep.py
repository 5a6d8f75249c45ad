"""The performance sweep: streams at rising concurrency, then the knee of the throughput curve.

Widen geometrically (1, 2, 4, …, the ceiling), stop early once the curve is flat, then
binary-search between the last level below the knee and the first at or above it, so that the
recommendation is one concurrency, not a power of two. Each level keeps `concurrency` streams in
flight until `rounds x concurrency` requests have been answered; prompts are random so that no
request rides another's prefix cache.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from iop.percentile import nearest_rank
from iop.qualify.calls import Streamed, stream
from iop.qualify.probes import Target
from iop.qualify.schema import Level, Recommendation

KNEE_FRACTION = 0.9
"""The recommended capacity reaches this share of the peak aggregate throughput."""
MIN_OK_SHARE = 0.95
"""A level counts only if this share of its requests succeeded (GPUStack's rule)."""
FLAT_GAIN = 1.03
"""Widening stops once a level adds less than this factor over the best so far."""

_WORDS = tuple(
    [
        "river",
        "stone",
        "cloud",
        "lantern",
        "orbit",
        "meadow",
        "copper",
        "signal",
        "harbor",
        "violet",
        "engine",
        "marble",
        "tundra",
        "falcon",
        "ember",
        "canyon",
        "quartz",
        "willow",
        "beacon",
        "summit",
        "glacier",
        "prism",
        "cedar",
        "thunder",
        "mosaic",
    ]
)


@dataclass
class SweepSettings:
    ceiling: int
    configured: int
    """The configured capacity: always measured, the verdict compares against it."""
    output_tokens: int = 128
    prompt_words: int = 64
    rounds: int = 3
    budget_s: float = 300.0
    level_timeout_s: float = 120.0


def levels_up_to(ceiling: int) -> list[int]:
    """1, 2, 4, … below `ceiling`, then `ceiling` itself."""
    out, c = [], 1
    while c < ceiling:
        out.append(c)
        c *= 2
    return [*out, ceiling]


def _prompt(words: int) -> str:
    return f"[{random.getrandbits(64):016x}] Continue this list with more words: " + " ".join(
        random.choice(_WORDS) for _ in range(words)
    )


async def measure(t: Target, concurrency: int, s: SweepSettings) -> Level:
    total = s.rounds * concurrency
    queue = list(range(total))
    results: list[Streamed] = []

    async def worker() -> None:
        while queue:
            queue.pop()
            body = t.chat(
                _prompt(s.prompt_words),
                max_tokens=s.output_tokens,
                temperature=1.0,
                stream_options={"include_usage": True},
            )
            results.append(await stream(t.client, t.provider, "chat", body, t.timeout_s))

    t0 = time.monotonic()
    tasks = [asyncio.create_task(worker()) for _ in range(concurrency)]
    try:
        async with asyncio.timeout(s.level_timeout_s):
            await asyncio.gather(*tasks)
    except TimeoutError:
        pass  # the level is judged on what finished; the rest count as errors
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    wall = max(time.monotonic() - t0, 1e-6)
    return level_of(concurrency, total, results, wall)


def _pct(values: list[float], q: float) -> float | None:
    p = nearest_rank(values, q)
    return None if p is None else round(p, 2)


def level_of(concurrency: int, total: int, results: list[Streamed], wall_s: float) -> Level:
    good = [r for r in results if not r.error and not r.malformed and r.first_token is not None]
    ttft, itl, tpot, e2e, decode = [], [], [], [], []
    tokens_total = 0
    usage_missing = 0
    for r in good:
        tokens = r.completion_tokens
        if tokens is None:
            usage_missing += 1
            tokens = r.content_events
        tokens_total += tokens
        assert r.first_token is not None
        first = (r.first_token - r.sent) * 1000
        whole = (r.end - r.sent) * 1000
        ttft.append(first)
        e2e.append(whole)
        if tokens > 0:
            tpot.append(whole / tokens)
        if tokens > 1 and r.end > r.first_token:
            itl.append((whole - first) / (tokens - 1))
            decode.append((tokens - 1) / (r.end - r.first_token))
    bad = [r for r in results if r not in good]
    first_error = (bad[0].error or bad[0].malformed or "no answer text") if bad else ""
    if len(results) < total and not first_error:
        first_error = "the level ran out of time"
    return Level(
        concurrency=concurrency,
        requests=total,
        ok=len(good),
        errors=total - len(good),
        output_tokens=tokens_total,
        wall_s=round(wall_s, 3),
        throughput_tok_s=round(tokens_total / wall_s, 2),
        ttft_ms_p50=_pct(ttft, 0.5),
        ttft_ms_p95=_pct(ttft, 0.95),
        itl_ms_p50=_pct(itl, 0.5),
        tpot_ms_p50=_pct(tpot, 0.5),
        e2e_ms_p50=_pct(e2e, 0.5),
        e2e_ms_p95=_pct(e2e, 0.95),
        decode_tok_s_p50=_pct(decode, 0.5),
        usage_missing=usage_missing,
        first_error=first_error[:200],
    )


def _counts(level: Level) -> bool:
    return level.requests > 0 and level.ok >= MIN_OK_SHARE * level.requests


Measure = Callable[[int], Awaitable[Level]]
"""Measures one concurrency level."""


async def sweep(t: Target, s: SweepSettings) -> list[Level]:
    """Measure levels of `t` until the curve is flat, the ceiling is reached or the budget runs out."""
    return await sweep_levels(lambda c: measure(t, c, s), s)


async def sweep_levels(measure_at: Measure, s: SweepSettings) -> list[Level]:
    """Which levels to measure, and which to measure again, whatever measures them."""
    until = time.monotonic() + s.budget_s
    done: dict[int, Level] = {}
    best = 0.0
    for c in levels_up_to(s.ceiling):
        if time.monotonic() > until:
            break
        level = done[c] = await measure_at(c)
        if not _counts(level):
            break  # failing under load: higher levels say nothing more
        if best and level.throughput_tok_s < best * FLAT_GAIN and time.monotonic() < until:
            # Flat once may be a stall of the host (a stall only ever lowers a level's rate): measure
            # the level again and keep the better of the two before concluding the knee is behind us.
            again = await measure_at(c)
            if _counts(again) and again.throughput_tok_s > level.throughput_tok_s:
                level = done[c] = again
        if best and level.throughput_tok_s < best * FLAT_GAIN:
            best = max(best, level.throughput_tok_s)
            break  # flat: the knee is behind us
        best = max(best, level.throughput_tok_s)
    # Refine between the last level below the knee and the first at or above it.
    while time.monotonic() < until:
        lo, hi = _bracket(done)
        if lo is None or hi is None or hi - lo <= 1:
            break
        mid = (lo + hi) // 2
        done[mid] = await measure_at(mid)
    # The level just below the knee decides the recommendation: a stall there (which only lowers a
    # rate) would move the knee up, so it is measured again and the better kept.
    lo, hi = _bracket(done)
    if lo is not None and time.monotonic() < until:
        again = await measure_at(lo)
        if _counts(again) and again.throughput_tok_s > done[lo].throughput_tok_s:
            done[lo] = again
    if s.configured not in done and time.monotonic() < until:
        done[s.configured] = await measure_at(s.configured)
    return [done[c] for c in sorted(done)]


def _bracket(done: dict[int, Level]) -> tuple[int | None, int | None]:
    valid = {c: lv for c, lv in done.items() if _counts(lv)}
    if not valid:
        return None, None
    peak = max(lv.throughput_tok_s for lv in valid.values())
    hi = min((c for c, lv in valid.items() if lv.throughput_tok_s >= KNEE_FRACTION * peak), default=None)
    if hi is None:
        return None, None
    lo = max((c for c in valid if c < hi), default=None)
    return lo, hi


def recommend(levels: list[Level], configured: int, swept_to: int) -> Recommendation:
    """The knee: the smallest concurrency reaching ≥ 90 % of the peak aggregate tokens/s; and the verdict."""
    rec = Recommendation(configured_capacity=configured, swept_to=swept_to, knee_fraction=KNEE_FRACTION)
    valid = [lv for lv in levels if _counts(lv)]
    if not valid:
        why = levels[0].first_error if levels else "no level was measured"
        rec.verdict = f"no recommendation: no concurrency level succeeded ({why})"
        return rec
    peak = max(valid, key=lambda lv: lv.throughput_tok_s)
    rec.peak_throughput_tok_s = peak.throughput_tok_s
    rec.peak_concurrency = peak.concurrency
    knee = min(
        (lv for lv in valid if lv.throughput_tok_s >= KNEE_FRACTION * peak.throughput_tok_s),
        key=lambda lv: lv.concurrency,
    )
    rec.recommended_capacity = knee.concurrency
    rec.throughput_at_recommended_tok_s = knee.throughput_tok_s
    at_cfg = next((lv for lv in valid if lv.concurrency == configured), None)
    rec.throughput_at_configured_tok_s = at_cfg.throughput_tok_s if at_cfg else None
    rec.verdict = verdict(knee, at_cfg, configured, swept_to, peak)
    if at_cfg is not None and at_cfg.e2e_ms_p50 and knee.e2e_ms_p50:
        lo, hi = sorted((at_cfg, knee), key=lambda lv: lv.concurrency)
        if lo.e2e_ms_p50 and hi.e2e_ms_p50:
            rec.e2e_ratio = round(hi.e2e_ms_p50 / lo.e2e_ms_p50, 2)
    return rec


def _pct_more(a: float, b: float) -> str:
    return f"{(a / b - 1) * 100:+.0f} %" if b > 0 else "n/a"


def verdict(knee: Level, at_cfg: Level | None, configured: int, swept_to: int, peak: Level) -> str:
    r = knee.concurrency
    if at_cfg is None:
        return f"capacity {configured}, recommended {r} (capacity {configured} itself was not measured)"
    if r > configured:
        gained = _pct_more(knee.throughput_tok_s, at_cfg.throughput_tok_s)
        return f"capacity {configured}, recommended {r}: {gained} throughput"
    if r < configured:
        ratio = ""
        if at_cfg.e2e_ms_p50 and knee.e2e_ms_p50:
            ratio = f" at {at_cfg.e2e_ms_p50 / knee.e2e_ms_p50:.1f}x the latency"
        gain = max(0.0, (at_cfg.throughput_tok_s / knee.throughput_tok_s - 1) * 100) if knee.throughput_tok_s else 0.0
        return f"over-committed: {configured} gives {gain:.0f} % more than {r}{ratio}"
    if swept_to <= configured and peak.concurrency == configured:
        return (
            f"capacity {configured} is at the knee or below it: throughput still rises there; "
            "qualify with --exclusive to measure beyond it"
        )
    return f"capacity {configured} matches the measured knee"
