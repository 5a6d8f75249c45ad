"""Qualification at the edge: requests pinned to one provider, exclusive leases, and the results kept.

Everything here is an admin action (`/admin/qualify/...`, an admin key or, without admin keys,
loopback): a client key never pins a request to a provider, drains one or writes a result.

- `POST /admin/qualify/providers/{provider}/v1/chat/completions` (and `/v1/responses`): the
  request is served by that provider only. It still takes one of the provider's slots through the
  scheduler (`Scheduler.acquire_pinned`), so this edge's counts and the broker's cap stay exact.
- `POST /admin/qualify/leases` opens a lease; `exclusive` drains the providers out of their
  pools (no new user work) and may raise their capacity to a `ceiling` for the sweep (applied as a
  refresh: consumers, node catalogs and the scheduler move together). The qualifier renews the
  lease (`PUT .../leases/{id}`) every few seconds; when it ends (`DELETE`) or is not renewed in
  time (the qualifier was killed), the edge puts everything back.
- `GET /admin/qualify/status` is /status for the admin key the qualifier holds.
- `PUT /admin/qualify/results/{provider}` keeps a report in the KV bucket `iop_qualify` (history
  kept); `/status` shows its summary and `GET /admin/qualify/results` returns the latest reports.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js import api as js_api
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from iop import config
from iop.contracts.refresh import RefreshResult
from iop.contracts.status import QualificationSummary
from iop.edge.api import ApiEndpoint, Serving
from iop.edge.keys import EdgeKeys
from iop.edge.lifecycle import Lifecycle
from iop.edge.routing import Curve
from iop.errors import BadRequest, NotFound, Unavailable
from iop.nats import streams

log = logging.getLogger("iop.edge")

RESULTS_BUCKET = "iop_qualify"
"""KV bucket of qualification reports, key = provider id; written by the edge only (nodes have no right)."""
RESULTS_HISTORY = 16
"""Reports kept per provider (the latest is the one shown)."""
LEASE_TTL_S = 6.0
"""A lease not renewed within this is over: the qualifier renews every third of it."""
LEASE_TTL_MAX_S = 60.0
CEILING_FACTOR = 2
"""An exclusive sweep may raise a provider's capacity to at most this many times the configured one."""

_json = msgspec.json.Encoder().encode


class LeaseRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    providers: list[str]
    exclusive: bool = False
    ceiling: int | None = None
    """Exclusive only: the capacity each provider runs at during the lease (at most twice the configured one)."""
    ttl_s: float = LEASE_TTL_S


class LeaseGrant(msgspec.Struct, kw_only=True):
    id: str
    providers: list[str]
    exclusive: bool
    ttl_s: float
    capacity: dict[str, int]
    """The capacity in force per provider while the lease lasts."""
    configured: dict[str, int]
    """The capacity each provider has outside the lease."""


class _Check(msgspec.Struct):
    id: str
    group: str
    status: str


class _Level(msgspec.Struct):
    concurrency: int
    ttft_ms_p50: float | None = None
    decode_tok_s_p50: float | None = None


class _Uploaded(msgspec.Struct):
    """What the edge reads of a report it keeps: who it is about, its summary, its protocol checks
    and its curve (the router's, iop/edge/routing.py); the rest is kept as sent."""

    provider: str
    summary: QualificationSummary
    checks: list[_Check] = msgspec.field(default_factory=list)
    sweep: list[_Level] = msgspec.field(default_factory=list)

    def curve(self) -> Curve | None:
        levels = sorted(
            (lv.concurrency, lv.ttft_ms_p50 / 1000 if lv.ttft_ms_p50 is not None else None, lv.decode_tok_s_p50)
            for lv in self.sweep
            if lv.concurrency > 0
        )
        return Curve(tuple(levels)) if levels else None

    def failed_protocol(self) -> list[str]:
        return [c.id for c in self.checks if c.group == "protocol" and c.status == "fail"]


_lease_request = msgspec.json.Decoder(LeaseRequest).decode
_uploaded = msgspec.json.Decoder(_Uploaded).decode


class Qualified(Serving, Protocol):
    """What qualification needs from the edge beyond what a request needs."""

    @property
    def keys(self) -> EdgeKeys: ...
    @property
    def deployment(self) -> config.Deployment: ...
    @property
    def js(self) -> JetStreamContext: ...
    @property
    def lifecycle(self) -> Lifecycle: ...

    async def refresh_to(self, new: config.Deployment) -> RefreshResult: ...


@dataclass(eq=False)
class QualificationLease:
    """One `iop qualify` run's hold on its providers (drained and raised when exclusive), renewed or expired."""

    id: str
    providers: list[str]
    exclusive: bool
    ttl_s: float
    configured: dict[str, int]
    capacity: dict[str, int]
    timer: asyncio.TimerHandle | None = None
    ended: bool = False


@dataclass(eq=False)
class QualifyDesk:
    """The edge's side of `iop qualify`: leases, drains, raised capacities, and the kept reports."""

    edge: Qualified
    leases: dict[str, QualificationLease] = field(default_factory=dict)
    summaries: dict[str, QualificationSummary] = field(default_factory=dict)
    reports: dict[str, bytes] = field(default_factory=dict)
    _kv: Any = None
    _tasks: set[asyncio.Task[bool]] = field(default_factory=set)

    async def start(self) -> None:
        """Open (or create) the results bucket and load the latest report of every provider."""
        # Through the one bucket helper: made with the deployment's replicas (an R1 bucket on a
        # cluster kept every other edge from starting while its one server was down).
        self._kv = await streams.ensure_bucket(
            self.edge.js, js_api.KeyValueConfig(bucket=RESULTS_BUCKET, history=RESULTS_HISTORY)
        )
        await self._load()

    async def _load(self) -> None:
        try:
            keys = await self._kv.keys()
        except nats.js.errors.NoKeysError:
            return
        for key in keys:
            try:
                entry = await self._kv.get(key)
            except nats.js.errors.KeyNotFoundError:
                continue
            if entry.value:
                self._keep(key, entry.value)

    def _keep(self, provider: str, raw: bytes) -> _Uploaded | None:
        try:
            up = _uploaded(raw)
        except msgspec.DecodeError as exc:
            log.warning("qualification report of %s in %s is unreadable: %s", provider, RESULTS_BUCKET, exc)
            return None
        self.summaries[provider] = up.summary
        self.reports[provider] = raw
        self.edge.scheduler.router.of(provider).curve = up.curve()
        return up

    async def stop(self) -> None:
        for s in list(self.leases.values()):
            await self.end(s.id)

    # --- leases -----------------------------------------------------------------------------

    async def grant(self, req: LeaseRequest, who: str) -> LeaseGrant:
        sched = self.edge.scheduler
        if not req.providers:
            raise BadRequest("a lease names at least one provider", param="providers")
        if not 1.0 <= req.ttl_s <= LEASE_TTL_MAX_S:
            raise BadRequest(f"ttl_s must be between 1 and {LEASE_TTL_MAX_S:g}", param="ttl_s")
        configured: dict[str, int] = {}
        for pid in req.providers:
            ref = self.edge.catalog.providers.get(pid)
            if ref is None or ref.provider.capacity is None or pid not in sched.providers:
                raise NotFound(f"provider '{pid}' does not exist or has no capacity", param="providers")
            configured[pid] = ref.provider.capacity
            if req.exclusive and any(pid in s.providers and s.exclusive for s in self.leases.values()):
                raise BadRequest(f"provider '{pid}' is already qualified exclusively", code="provider_busy", status=409)
        capacity = dict(configured)
        if req.exclusive and req.ceiling is not None:
            for pid, cap in configured.items():
                if not cap <= req.ceiling <= CEILING_FACTOR * cap:
                    raise BadRequest(
                        f"ceiling {req.ceiling} for '{pid}' must lie between its capacity {cap} "
                        f"and {CEILING_FACTOR * cap}",
                        param="ceiling",
                    )
                capacity[pid] = req.ceiling
        elif req.ceiling is not None:
            raise BadRequest("a ceiling above the capacity needs an exclusive lease", param="ceiling")
        lease = QualificationLease(
            secrets.token_hex(8), list(req.providers), req.exclusive, req.ttl_s, configured, capacity
        )
        self.leases[lease.id] = lease
        if req.exclusive:
            for pid in lease.providers:
                sched.set_drained(pid, True)
            if capacity != configured:
                result = await self.edge.refresh_to(_with_capacities(self.edge.deployment, capacity))
                if result.error:
                    await self.end(lease.id)
                    raise Unavailable(f"could not raise the capacity for the sweep: {result.error}")
        self._arm(lease)
        log.info(
            "qualify lease %s by %s: %s%s",
            lease.id,
            who,
            ", ".join(f"{p} at {capacity[p]}" for p in lease.providers),
            " (exclusive: drained out of their pools)" if req.exclusive else "",
        )
        return self._grant_of(lease)

    def _grant_of(self, s: QualificationLease) -> LeaseGrant:
        return LeaseGrant(
            id=s.id,
            providers=s.providers,
            exclusive=s.exclusive,
            ttl_s=s.ttl_s,
            capacity=s.capacity,
            configured=s.configured,
        )

    def _arm(self, s: QualificationLease) -> None:
        if s.timer is not None:
            s.timer.cancel()
        s.timer = asyncio.get_running_loop().call_later(s.ttl_s, self._expire, s.id)

    def _expire(self, sid: str) -> None:
        log.warning("qualify lease %s was not renewed within its ttl: putting its providers back", sid)
        task = asyncio.get_running_loop().create_task(self.end(sid))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def renew(self, sid: str) -> LeaseGrant:
        s = self.leases.get(sid)
        if s is None:
            raise NotFound(f"qualify lease '{sid}' is over (ended or expired)", code="lease_over")
        self._arm(s)
        return self._grant_of(s)

    async def end(self, sid: str) -> bool:
        """Put the lease's providers back: their configured capacity, then their pools. False if already over."""
        s = self.leases.pop(sid, None)
        if s is None or s.ended:
            return False
        s.ended = True
        if s.timer is not None:
            s.timer.cancel()
        if s.capacity != s.configured:
            # Only what this lease raised, and only if nobody changed it since (a refresh wins).
            current = self.edge.catalog.providers
            back = {
                pid: cap
                for pid, cap in s.configured.items()
                if pid in current and current[pid].provider.capacity == s.capacity[pid]
            }
            if back:
                result = await self.edge.refresh_to(_with_capacities(self.edge.deployment, back))
                if result.error:
                    log.error("qualify lease %s: could not restore the capacity: %s", sid, result.error)
        if s.exclusive:
            for pid in s.providers:
                self.edge.scheduler.set_drained(pid, False)
        log.info("qualify lease %s over: %s back in their pools", sid, ", ".join(s.providers))
        return True

    # --- results ----------------------------------------------------------------------------

    async def store(self, provider: str, raw: bytes) -> None:
        try:
            up = _uploaded(raw)
        except msgspec.DecodeError as exc:
            raise BadRequest(f"not a qualification report: {exc}", code="invalid_report") from None
        if up.provider != provider:
            raise BadRequest(f"the report is about '{up.provider}', not '{provider}'", code="invalid_report")
        if provider not in self.edge.catalog.providers:
            raise NotFound(f"provider '{provider}' does not exist")
        try:
            await self._kv.put(provider, raw)
        except (nats.errors.Error, OSError) as exc:
            raise Unavailable(f"could not keep the report in {RESULTS_BUCKET}: {exc}") from exc
        kept = self._keep(provider, raw)
        if kept is not None:
            # A failed protocol check drains it (its policy permitting); a passing run brings it back.
            self.edge.lifecycle.qualified(provider, kept.failed_protocol())

    async def latest(self) -> bytes:
        await self._load()  # another edge may have written since
        return b'{"reports":[' + b",".join(self.reports[p] for p in sorted(self.reports)) + b"]}"


def _with_capacities(dep: config.Deployment, capacity: dict[str, int]) -> config.Deployment:
    nodes = [
        msgspec.structs.replace(
            n,
            providers=[
                msgspec.structs.replace(p, capacity=capacity[p.id]) if p.id in capacity else p for p in n.providers
            ],
        )
        for n in dep.nodes
    ]
    return msgspec.structs.replace(dep, nodes=nodes)


def qualify_routes(edge: Qualified, desk: Callable[[], QualifyDesk], status: Callable[[], bytes]) -> list[Route]:
    """The admin routes of qualification (`desk()` is read per request: the edge owns it).

    `status()` is the /status document: the qualifier reads it here with its admin key, which
    /status itself (a client endpoint) does not take.
    """

    async def targets(request: Request) -> Response:
        edge.keys.admin(request.scope)
        return Response(status(), media_type="application/json")

    async def leases(request: Request) -> Response:
        who = edge.keys.admin(request.scope)
        try:
            req = _lease_request(await request.body())
        except msgspec.DecodeError as exc:
            raise BadRequest(f"invalid lease request: {exc}", code="invalid_json") from None
        return Response(_json(await desk().grant(req, who)), media_type="application/json")

    async def lease(request: Request) -> Response:
        edge.keys.admin(request.scope)
        sid = request.path_params["sid"]
        if request.method == "DELETE":
            ended = await desk().end(sid)
            return Response(_json({"ended": ended}), media_type="application/json")
        return Response(_json(desk().renew(sid)), media_type="application/json")

    async def result(request: Request) -> Response:
        edge.keys.admin(request.scope)
        await desk().store(request.path_params["provider"], await request.body())
        return Response(_json({"kept": True, "at": time.time()}), media_type="application/json")

    async def results(request: Request) -> Response:
        edge.keys.admin(request.scope)
        return Response(await desk().latest(), media_type="application/json")

    return [
        Route("/admin/qualify/providers/{provider}/v1/chat/completions", ApiEndpoint(edge, "chat", pinned=True)),
        Route("/admin/qualify/providers/{provider}/v1/responses", ApiEndpoint(edge, "responses", pinned=True)),
        Route("/admin/qualify/status", targets, methods=["GET"]),
        Route("/admin/qualify/leases", leases, methods=["POST"]),
        Route("/admin/qualify/leases/{sid}", lease, methods=["PUT", "DELETE"]),
        Route("/admin/qualify/results", results, methods=["GET"]),
        Route("/admin/qualify/results/{provider}", result, methods=["PUT"]),
    ]
