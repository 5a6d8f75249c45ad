"""Tenants' rpm, tpm and token budgets, exact across every edge of one NATS: admission and its answers.

Each tenant's use (iop/edge/window.py) is one key of the JetStream KV bucket `iop_limits`, changed
only by compare-and-set (`update(last=revision)`): an edge decides on the value it read and writes
it back only if nobody wrote in between, else it reads again and decides again. So two edges can
never both admit the last request a window holds. Per edge, the admissions of one tenant that
arrive while a write is in flight are decided together and written in the next one (a group
commit): one round trip serves a burst, and one edge never conflicts with itself.

What a request counts: rpm counts admissions, whatever happens to the request afterwards (a
failed, cancelled or timed-out request was admitted; OpenAI counts it too). Tokens count the
estimate at admission (the body's bytes / 4 for the input, plus its max_tokens if it gives one),
corrected to the answer's usage when it ends; a request that never reached a node gives its
estimate back, one that ended without a usage report keeps it. Nothing is ever held: a window's
entries leave with time, so an edge that dies (even SIGKILL) leaves no counter taken.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js import api as js_api
from nats.js.client import JetStreamContext

from iop.edge.tenants import UNLIMITED, Tenant
from iop.edge.window import Decision, Quota, TenantUse, Window, decode_use, duration, encode_use
from iop.errors import QuotaExceeded, RateLimited, Unavailable
from iop.nats import streams
from iop.nats.acked import AckedPublishes

log = logging.getLogger("iop.edge")

LIMITS_BUCKET = "iop_limits"
"""KV bucket of tenants' counted use: key `t.<tenant>`; value a msgpack TenantUse."""

_OP_TIMEOUT_S = 2.0
_MAX_TRIES = 64
_BROKER_ERRORS = (nats.errors.Error, OSError, asyncio.TimeoutError)


def tenant_key(name: str) -> str:
    """The KV key of tenant `name` (`@`, allowed in names, is not in keys: `=40` stands for it)."""
    return "t." + (name.replace("@", "=40") or "=")


@dataclass(slots=True)
class Admission:
    """An admitted request's share: what to correct when it ends, and the quotas for its headers."""

    tenant: str
    alias: str
    tokens: int
    decision: Decision

    def headers(self, api: str) -> list[tuple[bytes, bytes]]:
        return quota_headers(api, self.decision.requests, self.decision.tokens)


def quota_headers(api: str, requests: Quota | None, tokens: Quota | None) -> list[tuple[bytes, bytes]]:
    """OpenAI's x-ratelimit-* headers (Anthropic's anthropic-ratelimit-* on /v1/messages)."""
    out: list[tuple[bytes, bytes]] = []
    anthropic = api in ("messages", "count_tokens")
    for what, quota in (("requests", requests), ("tokens", tokens)):
        if quota is None:
            continue
        if anthropic:
            reset = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + math.ceil(quota.reset_s)))
            out += [
                (f"anthropic-ratelimit-{what}-limit".encode(), str(quota.limit).encode()),
                (f"anthropic-ratelimit-{what}-remaining".encode(), str(quota.remaining).encode()),
                (f"anthropic-ratelimit-{what}-reset".encode(), reset.encode()),
            ]
        else:
            out += [
                (f"x-ratelimit-limit-{what}".encode(), str(quota.limit).encode()),
                (f"x-ratelimit-remaining-{what}".encode(), str(quota.remaining).encode()),
                (f"x-ratelimit-reset-{what}".encode(), duration(quota.reset_s).encode()),
            ]
    return out


class _Max(msgspec.Struct):
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    max_output_tokens: int | None = None


_decode_max = msgspec.json.Decoder(_Max).decode


def estimate_tokens(body: bytes) -> int:
    """Input (the body's bytes / 4: JSON framing makes it a little high) plus the output it allows."""
    try:
        given = _decode_max(body)
        out = given.max_completion_tokens or given.max_tokens or given.max_output_tokens or 0
    except msgspec.DecodeError:
        out = 0
    return -(-len(body) // 4) + max(0, out)


@dataclass(slots=True)
class _Op:
    tenant: Tenant
    alias: str
    tokens: int
    future: asyncio.Future[Decision] | None
    """None: a correction (`tokens` is the delta), nobody waits on it."""
    slot: int = 0
    day: int = 0
    month: int = 0


@dataclass
class _Lane:
    """One tenant's pending operations on this edge and the last value it read or wrote."""

    pending: list[_Op] = field(default_factory=list)
    task: asyncio.Task[None] | None = None
    value: TenantUse | None = None
    revision: int = 0


class Limiter:
    """Admits or refuses limited tenants' requests against their shared use in `iop_limits`."""

    def __init__(self, window_s: float = 60.0) -> None:
        self.window = Window(window_s)
        self.kv: Any = None
        self._lanes: dict[str, _Lane] = {}
        self.on_refusal: Callable[[str, str], None] = lambda tenant, limit: None
        """Called with (tenant, limit) for each refusal (the metrics count them)."""
        self.writes = 0
        self.conflicts = 0
        self._writes: AckedPublishes | None = None
        """A tenant's use written back by compare-and-set, without nats-py's request per write
        (its task, timer and JSON objects: ~140 µs of the ~230 µs a limited admission cost)."""

    async def open(self, js: JetStreamContext, replicas: int, nc: NATS | None = None) -> None:
        """The bucket, made if missing; with `nc`, a tenant's use is written back through its own ack inbox."""
        cfg = js_api.KeyValueConfig(bucket=LIMITS_BUCKET, history=1, direct=True)
        self.kv = await streams.ensure_bucket(js, cfg, replicas=replicas)
        if nc is not None:
            self._writes = AckedPublishes(nc, _OP_TIMEOUT_S)
            await self._writes.start()

    async def admit(self, tenant: Tenant, alias: str, body: bytes, api: str = "") -> Admission:
        """Count the request against its tenant's limits, or raise RateLimited / QuotaExceeded."""
        tokens = estimate_tokens(body) if _counts_tokens(tenant) else 0
        future: asyncio.Future[Decision] = asyncio.get_running_loop().create_future()
        self._enqueue(_Op(tenant, alias, tokens, future))
        decision = await future
        refusal = decision.refusal
        if refusal is None:
            return Admission(tenant.name, alias, tokens, decision)
        self.on_refusal(tenant.name, refusal.limit)
        headers = dict((k.decode(), v.decode()) for k, v in quota_headers(api, decision.requests, decision.tokens))
        if refusal.retry_s is not None:
            headers["Retry-After"] = str(max(1, math.ceil(refusal.retry_s)))
        if refusal.limit.startswith("tokens_per_"):
            raise QuotaExceeded(refusal.message, headers=headers)
        kind = "tokens" if refusal.limit.endswith("tpm") else "requests"
        raise RateLimited(refusal.message, kind=kind, headers=headers)

    def settle(self, admission: Admission, used: int | None, reached_node: bool) -> None:
        """The request ended: correct its estimate to `used` tokens (None: unknown)."""
        if used is None:
            used = admission.tokens if reached_node else 0
        delta = used - admission.tokens
        if delta == 0 or admission.tokens == 0:
            return  # exact already, or a tenant whose tokens nothing counts
        d = admission.decision
        tenant = Tenant(admission.tenant, UNLIMITED)
        self._enqueue(_Op(tenant, admission.alias, delta, None, d.slot, d.day, d.month))

    def state(self) -> dict[str, TenantUse]:
        """The last use this edge saw per tenant (for /status)."""
        return {name: lane.value for name, lane in self._lanes.items() if lane.value is not None}

    async def drain(self) -> None:
        """Wait for the pending corrections (an edge stopping)."""
        tasks = [lane.task for lane in self._lanes.values() if lane.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=_OP_TIMEOUT_S)

    def _enqueue(self, op: _Op) -> None:
        lane = self._lanes.setdefault(op.tenant.name, _Lane())
        lane.pending.append(op)
        if lane.task is None:
            lane.task = asyncio.create_task(self._run(op.tenant.name, lane))

    async def _run(self, name: str, lane: _Lane) -> None:
        try:
            while lane.pending:
                ops, lane.pending = lane.pending, []
                try:
                    async with asyncio.timeout(_OP_TIMEOUT_S * 2):  # not wait_for: no task per commit
                        decisions = await self._commit(name, lane, ops)
                except (*_BROKER_ERRORS, Unavailable) as exc:
                    log.warning("limits: tenant %s's use not written: %s", name or "(anonymous)", exc)
                    lane.value = None
                    for op in ops:
                        if op.future is not None and not op.future.done():
                            op.future.set_exception(
                                Unavailable("the rate limits cannot be checked now (NATS)", code="limits_unavailable")
                            )
                    continue
                for op, decision in zip(ops, decisions, strict=True):
                    if op.future is not None and not op.future.done() and decision is not None:
                        op.future.set_result(decision)
        finally:
            lane.task = None

    async def _commit(self, name: str, lane: _Lane, ops: list[_Op]) -> list[Decision | None]:
        key = tenant_key(name)
        fresh = False
        for _ in range(_MAX_TRIES):
            if lane.value is None:
                await self._read(key, lane)
                fresh = True
            assert lane.value is not None
            use = decode_use(encode_use(lane.value))  # decide on a copy: a lost race decides again
            now = time.time()
            decisions: list[Decision | None] = []
            for op in ops:
                if op.future is None:
                    self.window.correct(use, op.alias, op.slot, op.day, op.month, op.tokens, now)
                    decisions.append(None)
                else:
                    decisions.append(self.window.admit(use, op.tenant.policy, op.alias, op.tokens, now))
            if not fresh and any(d is not None and d.refusal is not None for d in decisions):
                lane.value = None  # refused on what this edge saw last: read what the others did first
                continue
            if all(d is not None and d.refusal is not None for d in decisions):
                return decisions  # nothing changed: nothing to write
            try:
                if lane.revision and self._writes is not None:
                    expected = {js_api.Header.EXPECTED_LAST_SUBJECT_SEQUENCE.value: str(lane.revision)}
                    lane.revision = await self._writes.publish(f"$KV.{LIMITS_BUCKET}.{key}", encode_use(use), expected)
                elif lane.revision:
                    lane.revision = await self.kv.update(key, encode_use(use), last=lane.revision)
                else:
                    lane.revision = await self.kv.create(key, encode_use(use))
            except nats.js.errors.KeyWrongLastSequenceError:
                self.conflicts += 1
                lane.value, fresh = None, False
                continue
            self.writes += 1
            lane.value = use
            return decisions
        raise Unavailable(f"tenant {name}'s limits: too many concurrent writers", code="limits_unavailable")

    async def _read(self, key: str, lane: _Lane) -> None:
        try:
            entry = await self.kv.get(key)
        except nats.js.errors.KeyNotFoundError:
            lane.value, lane.revision = TenantUse(), 0
            return
        lane.value = decode_use(entry.value) if entry.value else TenantUse()
        lane.revision = entry.revision or 0


def _counts_tokens(tenant: Tenant) -> bool:
    p = tenant.policy
    return (
        p.tpm is not None
        or p.tokens_per_day is not None
        or p.tokens_per_month is not None
        or any(pool.tpm is not None for pool in p.pools.values())
    )
