"""A tenant's rate windows and token budgets as one value, and the admission arithmetic on it.

The value (`TenantUse`) is what the KV bucket `iop_limits` holds per tenant (iop/edge/limits.py
shares it between edges with compare-and-set); everything here is pure and synchronous.

The window is sliding, in 60 slots of `window_s / 60` (1 s for rpm/tpm): an admission counts in
the slot of its time, and a check counts the current slot and the 60 before it. Every 60-second
interval lies within those 61 slots, so no 60 seconds ever admit more than the limit; the price is
that an admission is counted up to one slot (1 s) longer than 60 s. The same rule gives the time
a refused request would be admitted: when enough of the oldest slots have left.
"""

from __future__ import annotations

import calendar
import math
import time
from dataclasses import dataclass

import msgspec

from iop.tenancy import TenantPolicy

SLOTS = 60
"""Slots per window; a check counts SLOTS + 1 of them (the current one is partly elapsed)."""


class Slot(msgspec.Struct, array_like=True, gc=False):
    at: int
    """The slot's index: floor(unix time / slot length)."""
    requests: int
    tokens: int


class TenantUse(msgspec.Struct, array_like=True):
    """One tenant's counted use: its window, its windows per pool alias, its budgets' spending."""

    window: list[Slot] = msgspec.field(default_factory=list)
    pools: dict[str, list[Slot]] = msgspec.field(default_factory=dict)
    day: int = 0
    """The UTC day (days since 1970-01-01) day_tokens counts; another day starts at 0."""
    day_tokens: int = 0
    month: int = 0
    """The UTC month (year * 12 + month - 1) month_tokens counts."""
    month_tokens: int = 0


encode_use = msgspec.msgpack.Encoder().encode
decode_use = msgspec.msgpack.Decoder(TenantUse).decode


def day_of(now: float) -> int:
    return int(now // 86400)


def month_of(now: float) -> int:
    t = time.gmtime(now)
    return t.tm_year * 12 + t.tm_mon - 1


def next_month_start(now: float) -> float:
    t = time.gmtime(now)
    year, month = (t.tm_year + 1, 1) if t.tm_mon == 12 else (t.tm_year, t.tm_mon + 1)
    return float(calendar.timegm((year, month, 1, 0, 0, 0)))


@dataclass(frozen=True, slots=True)
class Quota:
    """One limit as the x-ratelimit-* headers say it: the limit, what is left, when more comes."""

    limit: int
    remaining: int
    reset_s: float


@dataclass(slots=True)
class Refusal:
    limit: str
    """Which limit refused: rpm, tpm, pool_rpm, pool_tpm, tokens_per_day, tokens_per_month."""
    message: str
    retry_s: float | None
    """When the request would be admitted (None: never, e.g. more tokens than the limit)."""


@dataclass(slots=True)
class Decision:
    """The outcome of one admission: admitted (refusal None) with its quotas, or refused."""

    refusal: Refusal | None
    requests: Quota | None
    tokens: Quota | None
    slot: int
    day: int
    month: int


class Window:
    """The arithmetic of one window length (60 s in production; tests use shorter ones)."""

    def __init__(self, window_s: float = 60.0) -> None:
        self.window_s = window_s
        self.slot_s = window_s / SLOTS

    def slot(self, now: float) -> int:
        return math.floor(now / self.slot_s)

    def live(self, slots: list[Slot], now_slot: int) -> list[Slot]:
        """The slots a check at `now_slot` counts (the rest have left the window)."""
        return [s for s in slots if s.at >= now_slot - SLOTS]

    def leaves_at(self, slot: int) -> float:
        """When an admission counted in `slot` stops counting."""
        return (slot + SLOTS + 1) * self.slot_s

    def wait(self, slots: list[Slot], now: float, need: int, limit: int, tokens: bool) -> float | None:
        """Seconds until `need` more (requests or tokens) fit under `limit`; 0 if they do now."""
        used = sum(s.tokens if tokens else s.requests for s in slots)
        if used + need <= limit:
            return 0.0
        if need > limit:
            return None
        for s in sorted(slots, key=lambda s: s.at):
            used -= s.tokens if tokens else s.requests
            if used + need <= limit:
                return max(0.0, self.leaves_at(s.at) - now)
        return 0.0  # not reached: every slot gone leaves 0 used

    def admit(self, use: TenantUse, policy: TenantPolicy, alias: str, tokens: int, now: float) -> Decision:
        """Admit one request of `tokens` estimated tokens to pool `alias` (mutating `use`), or refuse it."""
        at = self.slot(now)
        day, month = day_of(now), month_of(now)
        if use.day != day:
            use.day, use.day_tokens = day, 0
        if use.month != month:
            use.month, use.month_tokens = month, 0
        use.window, w_requests, w_tokens, w_oldest_requests, w_oldest_tokens = _tally(use.window, at - SLOTS)
        for name in [p for p, slots in use.pools.items() if not self.live(slots, at)]:
            del use.pools[name]
        pool_slots, p_requests, p_tokens, p_oldest_requests, p_oldest_tokens = _tally(
            use.pools.get(alias, []), at - SLOTS
        )
        pool = policy.pools.get(alias)
        checks: list[tuple[str, list[Slot], int | None, int, bool, int, int | None]] = [
            ("rpm", use.window, policy.rpm, 1, False, w_requests, w_oldest_requests),
            ("tpm", use.window, policy.tpm, tokens, True, w_tokens, w_oldest_tokens),
            ("pool_rpm", pool_slots, pool.rpm if pool else None, 1, False, p_requests, p_oldest_requests),
            ("pool_tpm", pool_slots, pool.tpm if pool else None, tokens, True, p_tokens, p_oldest_tokens),
        ]
        refusals: list[Refusal] = []
        quotas: dict[bool, Quota] = {}
        for name, slots, limit, need, is_tokens, used, oldest in checks:
            if limit is None:
                continue
            # What `wait` and `quota` say, from one pass over the window (`_tally`) instead of three.
            wait = 0.0 if used + need <= limit else self.wait(slots, now, need, limit, is_tokens)
            if wait is None:
                refusals.append(
                    Refusal(name, f"this request's estimated {need} tokens exceed the {name} of {limit}", None)
                )
            elif wait > 0:
                what = "tokens" if is_tokens else "requests"
                per = f"{self.window_s:g} s" if self.window_s != 60 else "minute"
                where = f" on model '{alias}'" if name.startswith("pool_") else ""
                refusals.append(Refusal(name, f"rate limit reached{where}: {limit} {what} per {per}", wait))
            reset = max(0.0, self.leaves_at(oldest) - now) if oldest is not None else 0.0
            quota = Quota(limit, max(0, limit - used), reset)
            best = quotas.get(is_tokens)
            if best is None or quota.remaining < best.remaining:
                quotas[is_tokens] = quota
        budgets = (
            ("tokens_per_day", policy.tokens_per_day, use.day_tokens, (day + 1) * 86400.0),
            ("tokens_per_month", policy.tokens_per_month, use.month_tokens, next_month_start(now)),
        )
        for name, budget, spent, resets in budgets:
            if budget is not None and spent + tokens > budget:
                per = "day" if name == "tokens_per_day" else "month"
                message = (
                    f"token budget spent: {spent} of {budget} tokens this UTC {per} (this request needs ~{tokens})"
                )
                refusals.append(Refusal(name, message, resets - now if tokens <= budget else None))
        decision = Decision(None, quotas.get(False), quotas.get(True), at, day, month)
        if refusals:
            # The one the client waits longest for is the one it must hear; never admissible first.
            decision.refusal = max(refusals, key=lambda r: math.inf if r.retry_s is None else r.retry_s)
            return decision
        _add(use.window, at, 1, tokens)
        if pool is not None and (pool.rpm is not None or pool.tpm is not None):
            _add(pool_slots, at, 1, tokens)
            use.pools[alias] = pool_slots
        use.day_tokens += tokens
        use.month_tokens += tokens
        if decision.requests is not None:
            q = decision.requests
            decision.requests = Quota(q.limit, max(0, q.remaining - 1), q.reset_s or self.window_s + self.slot_s)
        if decision.tokens is not None:
            q = decision.tokens
            reset = q.reset_s or (self.window_s + self.slot_s if tokens else 0.0)
            decision.tokens = Quota(q.limit, max(0, q.remaining - tokens), reset)
        return decision

    def correct(self, use: TenantUse, alias: str, slot: int, day: int, month: int, delta: int, now: float) -> None:
        """Add `delta` tokens (real usage minus the estimate) where the admission counted them."""
        at = self.slot(now)
        for slots in (use.window, use.pools.get(alias)):
            if slots is None:
                continue
            for s in slots:
                if s.at == slot and s.at >= at - SLOTS:
                    s.tokens = max(0, s.tokens + delta)
        if use.day == day:
            use.day_tokens = max(0, use.day_tokens + delta)
        if use.month == month:
            use.month_tokens = max(0, use.month_tokens + delta)


def _tally(slots: list[Slot], first: int) -> tuple[list[Slot], int, int, int | None, int | None]:
    """The slots from `first` on (those a check counts), their requests and tokens, and the oldest
    slot that holds requests and the oldest that holds tokens (None: none does)."""
    live: list[Slot] = []
    requests = tokens = 0
    oldest_requests: int | None = None
    oldest_tokens: int | None = None
    for s in slots:
        if s.at < first:
            continue
        live.append(s)
        if s.requests:
            requests += s.requests
            if oldest_requests is None or s.at < oldest_requests:
                oldest_requests = s.at
        if s.tokens:
            tokens += s.tokens
            if oldest_tokens is None or s.at < oldest_tokens:
                oldest_tokens = s.at
    return live, requests, tokens, oldest_requests, oldest_tokens


def _add(slots: list[Slot], at: int, requests: int, tokens: int) -> None:
    # One entry per slot: edges whose clocks differ a little may add to an older slot.
    for s in reversed(slots):
        if s.at == at:
            s.requests += requests
            s.tokens += tokens
            return
    slots.append(Slot(at, requests, tokens))


def duration(seconds: float) -> str:
    """OpenAI's reset format: `20ms`, `1s`, `1.5s`, `6m0s`."""
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    if seconds < 60:
        return f"{math.ceil(seconds * 100) / 100:g}s"
    minutes, rest = divmod(math.ceil(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return (f"{hours}h" if hours else "") + f"{minutes}m{rest}s"
