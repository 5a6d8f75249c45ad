"""Which free provider of a pool a request goes to: the one expected to finish it first.

The expected time of a request on a provider is `cold start + TTFT + output tokens / decode rate`,
each figure at the concurrency the provider would run at with this request added:

- the qualification curve (TTFT p50 and decode tok/s p50 per concurrency level of the provider's
  latest `iop qualify` sweep), interpolated between levels;
- live figures (EWMA of TTFT and of decode tok/s over the provider's recent successful requests,
  from the node's timings in each answer's `Done`); with a curve too, they scale it (a server
  slower today than when it was qualified), without one they are the estimate;
- the request's size: TTFT grows with the prompt (input tokens estimated from the body's bytes),
  the decode term with the output expected (its `max_tokens`, at most what the pool's answers
  usually are);
- a cold server's start time (`cold_start_s`: a server the node runs itself that is stopped or
  still starting, from its heartbeat; 0 while its state is unknown: treated as ready).

A cheap step, O(providers of the pool), no model. Providers within `TIE_FRACTION` of the
best are equally good: among them the most free slots wins (the free-slot order), so identical
providers still share the load. A provider without figures is tried first (it gets measured).
Affinity (a warm prefix cache) is decided before this, by the scheduler.

A full provider is a candidate too: its expected finish is the wait for one of its slots, given
the requests queued ahead of this one that wait for it as well (`Scan`), plus its time at full
concurrency. When that beats every free provider, the request holds out for it — a fast GPU box
that frees a slot every 0.1 s is worth waiting for rather than taking a free slot of a Mac that
needs 2 s — for at most what waiting can gain (the free one's estimate less the busy one's own
time; `Router.wake` has the queue looked at again then, slot freed or not). Its wait is charged
with what it costs the requests arriving after it (each waits one more turn while the busy
provider's backlog lasts, from the pool's arrival rate), so a pool whose load nears the busy
provider's capacity overflows sooner, and one past it never waits. Only the first `MAX_HELD`
waiters of a queue hold out: a deep queue still uses every provider.

With a deadline (`x-iop-deadline-ms`), a provider whose estimate passes it is skipped while one
that meets it is free; `best_case_s` says whether anyone could meet it at all.
"""

from __future__ import annotations

import asyncio
import bisect
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from time import monotonic
from typing import NamedTuple, Protocol, TypeVar

from iop import config, wire
from iop.errors import Unavailable
from iop.policy import Routing

__all__ = ["Ask", "Curve", "Figures", "PoolRules", "Router", "Routing", "Scan", "unmeetable"]


class PoolRules(NamedTuple):
    """A pool's routing and default deadline, from its alias entry."""

    routing: Routing = "expected_finish"
    deadline_s: float | None = None
    """For a request without `x-iop-deadline-ms`; None: no deadline."""

    @classmethod
    def of(cls, dep: config.Deployment) -> dict[str, PoolRules]:
        return {
            m.alias: cls(m.routing, m.deadline_ms / 1000 if m.deadline_ms is not None else None)
            for m in dep.models
            if m.pool is not None
        }


ALPHA = 0.2
"""EWMA weight of the newest sample (about the last ten requests count)."""
PREFILL_REF_TOKENS = 512.0
"""TTFT scales as (input + this) / (input the figures were measured with + this)."""
TYPICAL_OUTPUT_TOKENS = 256.0
"""The output a request is expected to have before its pool's answers taught better."""
TIE_FRACTION = 0.15
"""Estimates this close to the best count as equal: free slots decide among them."""
CORRECTION_BOUNDS = (0.25, 4.0)
"""How far live figures may scale a qualification curve (one odd sample must not swamp it)."""
BYTES_PER_TOKEN = 4
"""A rough input-token estimate from the body's size, for the TTFT term only."""
MAX_HELD = 64
"""Waiters of one queue that may hold out for a busy provider at once (bounds a pass over the queue)."""
WAKE_SLACK_S = 0.005
ARRIVAL_ALPHA = 0.05
"""EWMA weight of the newest gap between a pool's requests (its arrival rate, over about 40 of them)."""


@dataclass(frozen=True)
class Curve:
    """A provider's qualification sweep: TTFT (s) and decode rate (tok/s) at each concurrency measured."""

    levels: tuple[tuple[int, float | None, float | None], ...]
    """(concurrency, ttft_s, decode_tok_s), by concurrency."""

    def at(self, c: float) -> tuple[float | None, float | None]:
        """Both figures at concurrency `c`: linear between levels, the nearest level outside them."""
        return _interpolate(self.levels, c, 1), _interpolate(self.levels, c, 2)


def _interpolate(levels: tuple[tuple[int, float | None, float | None], ...], c: float, i: int) -> float | None:
    points = [(lv[0], lv[i]) for lv in levels if lv[i] is not None]
    if not points:
        return None
    xs = [x for x, _ in points]
    k = bisect.bisect_left(xs, c)
    if k == 0:
        return points[0][1]
    if k == len(points):
        return points[-1][1]
    (x0, y0), (x1, y1) = points[k - 1], points[k]
    assert y0 is not None and y1 is not None
    return y0 + (y1 - y0) * (c - x0) / (x1 - x0)


@dataclass(eq=False)
class Figures:
    """What the edge knows of one provider's speed (kept across refreshes, by provider id)."""

    ttft_s: float | None = None
    """EWMA of the node-measured time to the first answer byte (streamed answers)."""
    decode_tok_s: float | None = None
    """EWMA of output tokens per second after the first."""
    input_tokens: float = 0.0
    """EWMA of the input tokens of the requests `ttft_s` was measured on."""
    load: float = 1.0
    """EWMA of the concurrency the samples ran at (to read the curve at the same point)."""
    samples: int = 0
    curve: Curve | None = None
    held_s: float | None = None
    """EWMA of how long its answered requests held their slot at this edge (grant to end): how
    fast its slots turn over, as a request waiting for one sees it."""

    def learn(self, ttft_s: float | None, decode_tok_s: float | None, input_tokens: int, load: int) -> None:
        a = ALPHA if self.samples else 1.0
        if ttft_s is not None:
            self.ttft_s = ttft_s if self.ttft_s is None else self.ttft_s + a * (ttft_s - self.ttft_s)
            self.input_tokens += a * (input_tokens - self.input_tokens)
        if decode_tok_s is not None:
            d = self.decode_tok_s
            self.decode_tok_s = decode_tok_s if d is None else d + a * (decode_tok_s - d)
        self.load += a * (load - self.load)
        self.samples += 1

    def figures_at(self, c: float) -> tuple[float | None, float | None]:
        """(ttft_s, decode_tok_s) expected at concurrency `c`."""
        ttft, rate = self.ttft_s, self.decode_tok_s
        if self.curve is None:
            return ttft, rate
        cttft, crate = self.curve.at(c)
        if ttft is not None and cttft is not None:
            then = self.curve.at(self.load)[0]
            ttft = cttft * _bounded(ttft / then) if then else cttft
        else:
            ttft = cttft if ttft is None else ttft
        if rate is not None and crate is not None:
            then = self.curve.at(self.load)[1]
            rate = crate * _bounded(rate / then) if then else crate
        else:
            rate = crate if rate is None else rate
        return ttft, rate

    def expected_s(self, c: float, input_tokens: int, output_tokens: float, cold_s: float = 0.0) -> float | None:
        """Seconds until a request of this size would be done here at concurrency `c` (after `cold_s`
        of a server start); None: unknown."""
        ttft, rate = self.figures_at(c)
        if rate is None or rate <= 0:
            return None
        prefill = (ttft or 0.0) * (input_tokens + PREFILL_REF_TOKENS) / (self.input_tokens + PREFILL_REF_TOKENS)
        return cold_s + prefill + output_tokens / rate


def _bounded(x: float) -> float:
    lo, hi = CORRECTION_BOUNDS
    return min(hi, max(lo, x))


@dataclass(eq=False)
class Ask:
    """One request as the router sees it; `reason` is the router's answer for the ledger."""

    input_tokens: int = 0
    max_tokens: int | None = None
    finish_by: float | None = None
    """Monotonic time by which the answer should be complete (`x-iop-deadline-ms`); None: no deadline."""
    reason: str = ""
    """Why the provider it got was chosen (the ledger's `route_reason`)."""
    late: float | None = None
    """Monotonic time after which no provider could answer it in time, even idle (`Router.bound`)."""
    passed: bool = False
    """The router's last answer passed over the free slots it was offered (too slow for its deadline,
    or a busy provider expected to finish sooner): the waiters behind it are asked too."""
    held_since: float | None = None
    """Monotonic time it first held out for a busy provider; None: it never did."""
    hold_until: float = 0.0
    """Monotonic time after which it holds out no longer (waiting longer cannot pay)."""
    scan: Scan | None = None
    """The pass over its pool's queue it is being asked in (`Scan.asking`); None: it queues behind nobody."""
    counted: bool = False
    """Its arrival counts in its pool's arrival rate (the router's first look at it)."""


@dataclass(eq=False)
class Scan:
    """One pass over a pool's queue in its order (the scheduler's pump): the waiters asked so far
    that hold out for a busy provider, all ahead of the next one asked."""

    held: int = 0

    def asking(self, ask: Ask | None) -> Ask | None:
        """`ask`, marked as asked in this pass (the router reads the mark once)."""
        if ask is not None:
            ask.scan = self
        return ask


class Candidate(Protocol):
    """A provider as the router reads it (iop/edge/slots.py's ProviderSlots)."""

    @property
    def id(self) -> str: ...
    @property
    def in_flight(self) -> int: ...
    @property
    def elsewhere(self) -> int: ...
    @property
    def free(self) -> int: ...
    @property
    def capacity(self) -> int: ...


C = TypeVar("C", bound=Candidate)


@dataclass(eq=False)
class Router:
    """Per-provider figures and the choice among a pool's free providers."""

    figures: dict[str, Figures] = field(default_factory=dict)
    output_tokens: dict[str, float] = field(default_factory=dict)
    """Pool alias → EWMA of its answers' output tokens."""
    on_outcome: Callable[[str, bool, wire.Done | None], None] | None = None
    """Called when a pool request ended on a provider, answered or failed by it (its lifecycle policy)."""
    server_of: Callable[[str], wire.ServerLive | None] = field(default=lambda _: None)
    """The model server a provider's node runs for it, from the node's last heartbeat (iop/edge/root.py)."""
    gaps: dict[str, tuple[float, float]] = field(default_factory=dict)
    """Pool alias → (its latest request's arrival, EWMA of the gaps between its requests), monotonic s."""
    wake: Callable[[str], None] | None = None
    """Called with a pool's alias when a hold of one of its requests ends: look at its queue again,
    slot freed or not (the scheduler's pump)."""

    def ended(
        self,
        provider: str,
        alias: str,
        ok: bool,
        report: wire.Done | wire.Failure | None,
        input_tokens: int,
        load: int,
        held_s: float | None = None,
    ) -> None:
        """A pool request on `provider` ended, answered (`ok`) or failed by the provider, after
        holding its slot `held_s`: the node's timings of a good answer teach the figures; the
        outcome goes to the lifecycle policy."""
        done = report if isinstance(report, wire.Done) else None
        if ok and done is not None and done.run_ms > 0:
            out = done.usage.output_tokens if done.usage is not None else None
            self.learn(alias, provider, done.ttfb_ms, done.run_ms, out, input_tokens, load)
            if held_s is not None:
                f = self.of(provider)
                f.held_s = held_s if f.held_s is None else f.held_s + ALPHA * (held_s - f.held_s)
        if self.on_outcome is not None:
            self.on_outcome(provider, ok, done)

    def of(self, provider: str) -> Figures:
        f = self.figures.get(provider)
        if f is None:
            f = self.figures[provider] = Figures()
        return f

    def learn(
        self,
        alias: str,
        provider: str,
        ttfb_ms: float,
        run_ms: float,
        output_tokens: int | None,
        input_tokens: int,
        load: int,
    ) -> None:
        """A successful answer's node timings: TTFT when streamed, the decode rate when usage came."""
        f = self.of(provider)
        streamed = 0 < ttfb_ms < 0.9 * run_ms
        ttft_s = ttfb_ms / 1000 if streamed else None
        rate = None
        if output_tokens:
            typical = self.output_tokens.get(alias)
            self.output_tokens[alias] = (
                output_tokens if typical is None else typical + ALPHA * (output_tokens - typical)
            )
            if streamed:
                if output_tokens > 1:
                    rate = (output_tokens - 1) / ((run_ms - ttfb_ms) / 1000)
            else:
                # A whole answer's first byte is its last: its decode time is the run less the TTFT
                # learnt from streamed answers (none yet: all of it).
                decode_s = run_ms / 1000 - (f.ttft_s or 0.0)
                if decode_s > 0:
                    rate = output_tokens / decode_s
        if ttft_s is not None or rate is not None:
            f.learn(ttft_s, rate, input_tokens, load)

    def expected_output(self, alias: str, ask: Ask) -> float:
        typical = self.output_tokens.get(alias, TYPICAL_OUTPUT_TOKENS)
        return min(float(ask.max_tokens), typical) if ask.max_tokens else typical

    def estimate(self, p: Candidate, alias: str, ask: Ask) -> float | None:
        f = self.figures.get(p.id)
        if f is None:
            return None
        cold = cold_start_s(self.server_of(p.id), time.time())
        return f.expected_s(p.in_flight + p.elsewhere + 1, ask.input_tokens, self.expected_output(alias, ask), cold)

    def best_case_s(self, alias: str, in_rotation: Iterable[Candidate], ask: Ask) -> float | None:
        """The quickest any of `in_rotation` could answer, idle; None if one of them is unmeasured."""
        best: float | None = None
        for p in in_rotation:
            f = self.figures.get(p.id)
            est = f.expected_s(1, ask.input_tokens, self.expected_output(alias, ask)) if f else None
            if est is None:
                return None
            best = est if best is None else min(best, est)
        return best

    def bound(self, alias: str, in_rotation: Iterable[Candidate], ask: Ask, deadline: float, loop_now: float) -> float:
        """The queue deadline (loop clock, at most `deadline`) of a request with a deadline: the moment
        waiting longer would make it late. Raises 504 deadline_unmeetable when that moment is past."""
        assert ask.finish_by is not None
        best_s = self.best_case_s(alias, in_rotation, ask)
        ask.late = ask.finish_by - (best_s or 0.0)
        left = ask.late - monotonic()
        if left <= 0:
            raise unmeetable(alias, ask, best_s)
        return min(deadline, loop_now + left)

    def choose(
        self,
        alias: str,
        by_finish: bool,
        free: list[C],
        ask: Ask,
        busy: Sequence[C] = (),
    ) -> C | None:
        """Which of a pool's `free` providers to take now (None: none, none meets the deadline, or
        the request holds out for one of `busy`, the pool's full providers).

        `by_finish`: the pool routes by expected finish; otherwise (a deadline only) by free slots
        among those that meet the deadline. `ask.scan`: the pass over the queue this is part of
        (the waiters ahead that hold out)."""
        scan, ask.scan, ask.passed = ask.scan, None, False
        if not ask.counted:
            ask.counted = True
            self._arrived(alias)
        if not free:
            return None
        ahead = scan.held if scan is not None else 0
        waiting = self._waiting(alias, busy, ask, ahead) if by_finish and busy and ahead < MAX_HELD else None
        if len(free) == 1 and ask.finish_by is None and waiting is None:
            ask.reason = "only_free"
            return free[0]
        scored = [(self.estimate(p, alias, ask), p) for p in free]
        left = None
        if ask.finish_by is not None:
            left = ask.finish_by - monotonic()
            scored = [(est, p) for est, p in scored if est is None or est <= left]
            if not scored:
                # It waits for a busy provider quick enough: one ahead of those asked after it.
                ask.passed = True
                if scan is not None:
                    scan.held += 1
                return None
        unmeasured = [p for est, p in scored if est is None]
        if unmeasured:
            ask.reason = "unmeasured"
            return max(unmeasured, key=lambda p: p.free)
        known = sorted(((est, p) for est, p in scored if est is not None), key=lambda t: t[0])
        if not by_finish:
            ask.reason = "free_slots"
            return max((p for _, p in known), key=lambda p: p.free)
        first = known[0][0]
        if waiting is not None and self._holds(alias, ask, waiting, first, left):
            ask.passed = True
            if scan is not None:
                scan.held += 1
            return None
        near = [p for est, p in known if est <= first * (1 + TIE_FRACTION)]
        chosen = max(near, key=lambda p: p.free) if len(near) > 1 else known[0][1]
        mine = next(est for est, p in known if p is chosen)
        runner_up = next((est for est, p in known if est > first * (1 + TIE_FRACTION)), None)
        ask.reason = f"expected_finish {mine:.2f}s" + (
            f" vs {runner_up:.2f}s" if runner_up is not None else f" (tie of {len(near)})" if len(near) > 1 else ""
        )
        if ask.held_since is not None:
            ask.reason += f" after holding {monotonic() - ask.held_since:.2f}s for a busy provider"
        return chosen

    def _arrived(self, alias: str) -> None:
        now = monotonic()
        last, gap = self.gaps.get(alias, (now, 0.0))
        self.gaps[alias] = (now, now - last if not gap else gap + ARRIVAL_ALPHA * (now - last - gap))

    def _waiting(
        self, alias: str, busy: Sequence[Candidate], ask: Ask, ahead: int
    ) -> tuple[float, float, float] | None:
        """(expected finish, own time, cost to the others) on the best of the full providers `busy`,
        for a request with `ahead` requests queued before it for them.

        The finish: the wait for its slot, as the slots free at the rate they turn over at this
        edge (`held_s`; the node's time until one was seen), then its time at full concurrency.
        The cost: what its taking a slot there delays the requests that arrive after it while the
        provider's backlog lasts (a turn each, over a busy period of an M/M/1 at the pool's
        arrival rate); infinite when the provider alone cannot take the pool's load."""
        best: tuple[float, float, float] | None = None
        out = self.expected_output(alias, ask)
        now = time.time()
        gap = self.gaps.get(alias, (0.0, 0.0))[1]
        for p in busy:
            f = self.figures.get(p.id)
            if f is None or p.capacity <= 0:
                continue
            own = f.expected_s(p.capacity, ask.input_tokens, out, cold_start_s(self.server_of(p.id), now))
            if own is None:
                continue
            turn = max(own, f.held_s or 0.0) / p.capacity
            wait = (ahead + 1) * turn
            load = turn / gap if gap > 0 else 0.0
            cost = load * wait / (1 - load) if load < 1 else float("inf")
            if best is None or wait + own + cost < best[0] + best[2]:
                best = (wait + own, own, cost)
        return best

    def _holds(
        self, alias: str, ask: Ask, waiting: tuple[float, float, float], first: float, left: float | None
    ) -> bool:
        """Whether the request holds out for the busy provider of `waiting` rather than take the best
        free one (expected `first`): clearly sooner once its cost to the others is counted, in
        time for its deadline, and for at most what waiting can gain over taking the free one at
        its first hold."""
        total, own, cost = waiting
        if total * (1 + TIE_FRACTION) + cost >= first or (left is not None and total > left):
            return False
        now = monotonic()
        if ask.held_since is None:
            ask.held_since, ask.hold_until = now, now + (first - own)
            if self.wake is not None:
                # A hair late: a loop's timer may fire just before the hold's end on this clock.
                asyncio.get_running_loop().call_later(first - own + WAKE_SLACK_S, self.wake, alias)
        return now < ask.hold_until


COLD_START_GUESS_S = 30.0
"""A stopped server's start before it ever started here (its heartbeat reports the last one's)."""


def cold_start_s(server: wire.ServerLive | None, now: float) -> float:
    """Seconds before a provider's model server can answer: 0 when ready (or not one the node runs)."""
    if server is None or server.state in ("ready", "draining"):
        return 0.0
    last = server.last_cold_start_ms / 1000 if server.last_cold_start_ms else COLD_START_GUESS_S
    if server.state == "starting":
        return max(0.0, last - (now - server.since))
    return last


def unmeetable(alias: str, ask: Ask, best_s: float | None) -> Unavailable:
    """504 deadline_unmeetable: no provider can answer before the request's deadline."""
    left = max(0.0, (ask.finish_by or 0.0) - monotonic())
    why = (
        f"the quickest of its providers is expected to take {best_s:.2f} s"
        if best_s is not None
        else "no slot became free in time"
    )
    return Unavailable(
        f"model '{alias}': the request's deadline ({left * 1000:.0f} ms left) cannot be met: {why}",
        code="deadline_unmeetable",
        status=504,
    )
