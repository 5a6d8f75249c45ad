"""A provider taken out of its pools and put back: its lifecycle policy, an operator's drain, re-qualification.

Three things drain a provider (`Scheduler.set_drained(by="lifecycle")`; an exclusive qualification
drains on its own, iop/edge/qualification.py):

- its `policy` (iop/policy.py), from the live figures of the requests this edge sent it: more than
  `max_error_rate` of the last `window_s`'s requests failed by the provider, or their median TTFT
  (at the node) passed `max_ttft_ms`, once the window holds `min_requests`;
- a qualification report of it that fails a protocol check (`drain_on_failed_checks`);
- an operator: `POST /admin/providers/{provider}/drain` (`iop provider drain`).

It comes back with a passing qualification report (not from an operator's drain) or
`POST /admin/providers/{provider}/enable` (`iop provider enable`). A drain never touches what
runs or waits: running requests end where they are, waiting ones go to the pool's other
providers or wait for one (capacity stays exact; nothing queued is lost or refused for it).

Edges that share one NATS share the drains: each is one key of the KV bucket `iop_drains` (key =
provider id), written by the edge that decided it and watched by every edge, so an operator's
drain or a policy's verdict holds on all of them, and across an edge's restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import msgspec
import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js import api as js_api
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from iop import config, wire
from iop.edge.keys import EdgeKeys
from iop.edge.scheduler import Scheduler
from iop.errors import BadRequest, NotFound, Unavailable
from iop.nats import streams
from iop.policy import LifecyclePolicy

log = logging.getLogger("iop.edge")

BUCKET = "iop_drains"
"""KV bucket of drained providers, key = provider id; written and read by the edges only."""
DRAIN = "lifecycle"
"""What these drains are called in the scheduler (`ProviderSlots.drains`)."""

Why = Literal["operator", "policy", "checks"]


class Drain(msgspec.Struct, kw_only=True):
    """One provider out of its pools: who decided it, why, when, on which edge."""

    by: Why
    reason: str
    at: float
    edge: str = ""
    who: str = ""
    """The admin key's name for an operator's drain."""


_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder(Drain).decode


@dataclass(eq=False)
class _Window:
    """The outcomes of one provider's recent requests: (monotonic time, ok, node TTFT ms)."""

    events: deque[tuple[float, bool, float | None]] = field(default_factory=deque)

    def add(self, now: float, ok: bool, ttft_ms: float | None, window_s: float) -> None:
        self.events.append((now, ok, ttft_ms))
        while self.events and self.events[0][0] < now - window_s:
            self.events.popleft()

    def verdict(self, policy: LifecyclePolicy) -> str | None:
        """Why the policy drains the provider now, or None."""
        n = len(self.events)
        if n < policy.min_requests:
            return None
        failed = sum(1 for _, ok, _ in self.events if not ok)
        if policy.max_error_rate is not None and failed / n > policy.max_error_rate:
            return f"error rate {failed}/{n} over {policy.window_s:g} s passed {policy.max_error_rate:g}"
        ttfts = [t for _, ok, t in self.events if ok and t is not None]
        if policy.max_ttft_ms is not None and len(ttfts) >= policy.min_requests:
            median = statistics.median(ttfts)
            if median > policy.max_ttft_ms:
                return f"median TTFT {median:.0f} ms over {policy.window_s:g} s passed {policy.max_ttft_ms:g} ms"
        return None


class Lifecycle:
    """The drains of this edge's providers: decided here or by another edge, kept in `iop_drains`."""

    def __init__(
        self, scheduler: Scheduler, catalog: Callable[[], config.Catalog], js: JetStreamContext, edge_id: str
    ) -> None:
        self.scheduler = scheduler
        self.catalog = catalog
        self.js = js
        self.edge_id = edge_id
        self.drains: dict[str, Drain] = {}
        """Provider → its drain, as the bucket says (this edge's and the others')."""
        self.windows: dict[str, _Window] = {}
        self._kv: Any = None
        self._watch: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        scheduler.router.on_outcome = self.outcome

    async def start(self) -> None:
        self._kv = await streams.ensure_bucket(self.js, js_api.KeyValueConfig(bucket=BUCKET, history=1))
        watcher = await self._kv.watchall()
        # The current drains first (up to the watcher's None), so none is missed before serving.
        async for entry in watcher:
            if entry is None:
                break
            self._seen(entry)
        self._watch = asyncio.create_task(self._follow(watcher))

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
            self._watch = None

    async def _follow(self, watcher: Any) -> None:
        try:
            async for entry in watcher:
                if entry is not None:
                    self._seen(entry)
        finally:
            with contextlib.suppress(nats.errors.Error, OSError):
                await watcher.stop()

    def _seen(self, entry: Any) -> None:
        """A key of the bucket changed (any edge): apply it to this edge's scheduler."""
        provider = entry.key
        if entry.operation in ("DEL", "PURGE") or not entry.value:
            self._apply(provider, None)
            return
        try:
            self._apply(provider, _decode(entry.value))
        except msgspec.DecodeError as exc:
            log.warning("drain of %s in %s is unreadable: %s", provider, BUCKET, exc)

    def _apply(self, provider: str, drain: Drain | None) -> None:
        before = self.drains.get(provider)
        if drain is None:
            self.drains.pop(provider, None)
        else:
            self.drains[provider] = drain
        self.scheduler.set_drained(provider, drain is not None, DRAIN, _why(drain) if drain else "")
        if (before is None) != (drain is None):
            if drain is None:
                log.info("provider %s back in its pools", provider)
            else:
                log.warning("provider %s drained out of its pools: %s", provider, _why(drain))

    def reapply(self) -> None:
        """After a refresh (its providers' slots may be new): every drain on the scheduler again."""
        for provider, drain in self.drains.items():
            self.scheduler.set_drained(provider, True, DRAIN, _why(drain))

    # --- deciding -------------------------------------------------------------------------------

    async def drain(self, provider: str, by: Why, reason: str, who: str = "") -> Drain:
        """Take `provider` out of its pools on every edge (an operator's drain replaces a policy's)."""
        self._known(provider)
        drain = Drain(by=by, reason=reason, at=time.time(), edge=self.edge_id, who=who)
        self._apply(provider, drain)  # here at once; the others when the bucket tells them
        try:
            await self._kv.put(provider, _encode(drain))
        except (nats.errors.Error, OSError) as exc:
            raise Unavailable(f"could not keep the drain of '{provider}' in {BUCKET}: {exc}") from exc
        return drain

    async def enable(self, provider: str, *, unless: tuple[Why, ...] = ()) -> bool:
        """Put `provider` back in its pools on every edge; False if it was not drained (or `unless` holds it)."""
        self._known(provider)
        current = self.drains.get(provider)
        if current is None or current.by in unless:
            return False
        self._apply(provider, None)
        self.windows.pop(provider, None)  # a fresh start: the old window's failures are not held against it
        try:
            await self._kv.delete(provider)
        except (nats.errors.Error, OSError) as exc:
            raise Unavailable(f"could not remove the drain of '{provider}' from {BUCKET}: {exc}") from exc
        return True

    def _known(self, provider: str) -> None:
        if provider not in self.scheduler.providers:
            raise NotFound(f"provider '{provider}' does not exist or has no capacity", code="unknown_provider")

    def outcome(self, provider: str, ok: bool, done: wire.Done | None) -> None:
        """A pool request on `provider` ended (the router's `on_outcome`): its policy's window."""
        ref = self.catalog().providers.get(provider)
        policy = ref.provider.policy if ref is not None else None
        if policy is None or provider in self.drains:
            return
        window = self.windows.setdefault(provider, _Window())
        ttft_ms = done.ttfb_ms if done is not None and done.ttfb_ms > 0 else None
        window.add(time.monotonic(), ok, ttft_ms, policy.window_s)
        verdict = window.verdict(policy)
        if verdict is not None:
            self._spawn(self.drain(provider, "policy", verdict))

    def qualified(self, provider: str, failed_checks: list[str]) -> None:
        """A qualification report of `provider` was kept: a failed protocol check drains it (if its
        policy says so), a passing one brings it back from its policy's or an earlier report's drain."""
        if provider not in self.scheduler.providers:
            return
        if failed_checks:
            ref = self.catalog().providers.get(provider)
            policy = ref.provider.policy if ref is not None else None
            if policy is not None and policy.drain_on_failed_checks:
                self._spawn(self.drain(provider, "checks", "qualification failed " + ", ".join(failed_checks)))
        else:
            self._spawn(self._enabled(provider))

    async def _enabled(self, provider: str) -> None:
        await self.enable(provider, unless=("operator",))

    def _spawn(self, work: Any) -> None:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(self._logged(work))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _logged(self, work: Any) -> None:
        try:
            await work
        except (Unavailable, NotFound) as exc:
            log.error("lifecycle: %s", exc)


def _why(drain: Drain) -> str:
    return f"{drain.by}: {drain.reason}"


def lifecycle_routes(keys: EdgeKeys, lifecycle: Callable[[], Lifecycle]) -> list[Route]:
    """`POST /admin/providers/{provider}/drain` (body `{"reason": ...}`, optional) and `.../enable`:
    an administrator's drain and enable, on every edge of the NATS. Admin keys only (or loopback
    without admin keys, as every /admin path): a client key gets 403."""

    async def drain(request: Request) -> Response:
        who = keys.admin(request.scope)
        provider = request.path_params["provider"]
        body = await request.body()
        try:
            reason = _drain_request(body).reason if body.strip() else ""
        except msgspec.DecodeError as exc:
            raise BadRequest(f"invalid drain request: {exc}", code="invalid_json") from None
        done = await lifecycle().drain(provider, "operator", reason or "drained by an operator", who)
        log.info("admin drain of %s by %s: %s", provider, who or "-", done.reason)
        return Response(_encode({"provider": provider, "drained": True, "drain": done}), media_type=JSON)

    async def enable(request: Request) -> Response:
        who = keys.admin(request.scope)
        provider = request.path_params["provider"]
        was = await lifecycle().enable(provider)
        # An exclusive qualification's drain is the qualifier's: it ends with its lease, not here.
        held = lifecycle().scheduler.providers[provider].drained
        log.info("admin enable of %s by %s%s", provider, who or "-", "" if was else " (was not drained)")
        return Response(_encode({"provider": provider, "drained": held, "was_drained": was}), media_type=JSON)

    return [
        Route("/admin/providers/{provider}/drain", drain, methods=["POST"]),
        Route("/admin/providers/{provider}/enable", enable, methods=["POST"]),
    ]


class _DrainRequest(msgspec.Struct, forbid_unknown_fields=True):
    reason: Annotated[str, msgspec.Meta(max_length=200)] = ""


_drain_request = msgspec.json.Decoder(_DrainRequest).decode
JSON = "application/json"
