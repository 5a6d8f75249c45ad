"""JetStream topology: the work stream, one durable consumer per provider, the catalog bucket."""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js import api as js_api
from nats.js.errors import NotFoundError

from iop import wire
from iop.errors import BusError
from iop.nats import auth
from iop.nats.server import MAX_PAYLOAD

log = logging.getLogger(__name__)

T = TypeVar("T")

START_WAIT_S = 30.0
"""How long an edge's start-up step waits for JetStream to serve it (a cluster electing leaders)."""
_TRANSIENT_CODES = {10008, 10059}
"""JetStream "temporarily unavailable", and "stream not found" while another edge's create settles."""


def transient(exc: BaseException) -> bool:
    """Whether `exc` is what a forming cluster answers (no leader yet, no responder), not a refusal."""
    if isinstance(exc, (nats.errors.NoRespondersError, nats.errors.TimeoutError, TimeoutError)):
        return True
    if isinstance(exc, nats.js.errors.ServiceUnavailableError):
        return True
    return isinstance(exc, nats.js.errors.APIError) and (exc.err_code in _TRANSIENT_CODES or exc.code == 503)


async def when_available(what: str, step: Callable[[], Awaitable[T]], timeout_s: float = START_WAIT_S) -> T:
    """Run `step` until JetStream lets it through, for up to `timeout_s`; then one BusError line.

    Edges started together (after a power cut, on a fresh cluster) find streams without a leader
    yet, or half made by another edge: each start-up step waits for what it needs instead of dying
    with a traceback. A refusal (BusError, a non-transient API error) is not retried.
    """
    t0 = time.monotonic()
    pause = 0.05
    while True:
        try:
            return await step()
        except (nats.errors.Error, TimeoutError) as exc:
            if not transient(exc):
                raise BusError(f"{what}: {exc.__class__.__name__}: {exc}") from exc
            if time.monotonic() - t0 + pause > timeout_s:
                raise BusError(
                    f"{what}: JetStream did not serve it within {timeout_s:g}s ({exc or type(exc).__name__})"
                ) from exc
            log.info("%s: JetStream not ready yet (%s); trying again", what, exc or type(exc).__name__)
        await asyncio.sleep(pause)  # the cluster's election happens in the servers; nothing here to wait on
        pause = min(pause * 2, 1.0)


default_replicas: contextvars.ContextVar[int] = contextvars.ContextVar("default_replicas", default=1)
"""Replicas of every stream and KV bucket iop creates (`edge.nats.replicas`): set once by the edge."""


def _replicas(replicas: int | None) -> int:
    return replicas if replicas is not None else default_replicas.get()


def _replica_problem(what: str, replicas: int, exc: nats.js.errors.APIError) -> str:
    return (
        f"{what}: cannot keep {replicas} replicas ({exc.description or exc}); edge.nats.replicas must not exceed "
        "the number of JetStream servers in the NATS cluster (1 without a cluster)"
    )


INSUFFICIENT_RESOURCES = (10023, 10047)
"""JetStream's "insufficient resources" and "insufficient storage resources available"."""


def stream_problem(what: str, max_bytes: int | None, replicas: int, exc: nats.js.errors.APIError, sized_by: str) -> str:
    """Why a stream could not be made: a store too small for the bytes it reserves, or the replicas."""
    if exc.err_code in INSUFFICIENT_RESOURCES and max_bytes and max_bytes > 0:
        size = f"{max_bytes / 1024**3:.1f} GiB" if max_bytes >= 1024**3 else f"{max_bytes / 1024**2:.0f} MiB"
        setting = f" ({sized_by})" if sized_by else ""
        fix = f"lower {sized_by}, " if sized_by else ""
        off = f", or set {sized_by.rpartition('.')[0]}.enabled: false" if sized_by.startswith("edge.") else ""
        return (
            f"{what}: the NATS store has less room than the {size}{setting} it reserves "
            f"({exc.description or exc}): {fix}give the store (edge.nats.store_dir) more space{off}"
        )
    return _replica_problem(what, replicas, exc)


async def _until_led(js: JetStreamContext, stream: str, timeout_s: float = 10.0) -> None:
    """Until a stream has a leader: on a cluster its raft group forms after the create returns (and
    after another edge's create), and reads (a KV direct get) before that find no responder."""
    t0 = time.monotonic()
    while True:
        info = await js.stream_info(stream)
        if info.cluster is None or info.cluster.leader:
            return
        if time.monotonic() - t0 > timeout_s:
            raise BusError(f"stream {stream}: no leader elected within {timeout_s:g}s (a cluster without quorum?)")
        await asyncio.sleep(0.05)  # the election happens in the servers; nothing here to wait on


async def ensure_stream(
    js: JetStreamContext,
    cfg: js_api.StreamConfig,
    *,
    replicas: int | None = None,
    sized_by: str = "",
) -> None:
    """Create stream `cfg` if missing, with the deployment's replicas; scale an existing one in place.

    Idempotent and safe from several edges. `replicas` None: `default_replicas`. NATS moves a
    live stream between R1 and R3 by itself (its consumers follow); when it cannot, one BusError
    line names the stream and why.
    `sized_by`: the setting that gives `cfg.max_bytes`, named when the store cannot reserve it.
    """
    n = _replicas(replicas)
    name = cfg.name
    assert name is not None
    cfg = dataclasses.replace(cfg, num_replicas=n)
    try:
        info = await js.stream_info(name)
    except NotFoundError:
        try:
            await js.add_stream(cfg)
            await _until_led(js, name)
            return
        except nats.js.errors.BadRequestError as exc:
            if transient(exc):
                raise
            if exc.err_code != 10058:  # 10058: the name is in use (another edge created it meanwhile)
                raise BusError(stream_problem(f"stream {cfg.name}", cfg.max_bytes, n, exc, sized_by)) from exc
        except nats.js.errors.APIError as exc:
            if transient(exc):
                raise
            raise BusError(stream_problem(f"stream {cfg.name}", cfg.max_bytes, n, exc, sized_by)) from exc
        info = await js.stream_info(name)
    await _until_led(js, name)  # made by another edge a moment ago: its leader may still be elected
    have = info.config.num_replicas or 1
    if have != n:
        try:
            await js.update_stream(dataclasses.replace(info.config, num_replicas=n))
        except nats.js.errors.APIError as exc:
            raise BusError(_replica_problem(f"stream {cfg.name} (now {have} replicas)", n, exc)) from exc
        log.warning("stream %s: replicas %d → %d (NATS copies it in place)", cfg.name, have, n)


async def ensure_bucket(
    js: JetStreamContext, cfg: js_api.KeyValueConfig, *, replicas: int | None = None, sized_by: str = ""
) -> Any:
    """The KV bucket `cfg`, created if missing with the deployment's replicas, scaled in place if not.

    `sized_by`: the setting that gives `cfg.max_bytes`, named when the store cannot reserve it.
    """
    n = _replicas(replicas)
    try:
        kv = await js.key_value(cfg.bucket)
    except (NotFoundError, nats.js.errors.BucketNotFoundError):
        try:
            kv = await js.create_key_value(dataclasses.replace(cfg, replicas=n))
            await _until_led(js, f"KV_{cfg.bucket}")
            return kv
        except nats.js.errors.BadRequestError as exc:
            if transient(exc):
                raise
            if exc.err_code != 10058:
                raise BusError(stream_problem(f"KV bucket {cfg.bucket}", cfg.max_bytes, n, exc, sized_by)) from exc
        except nats.js.errors.APIError as exc:
            if transient(exc):
                raise
            raise BusError(stream_problem(f"KV bucket {cfg.bucket}", cfg.max_bytes, n, exc, sized_by)) from exc
        kv = await js.key_value(cfg.bucket)
    stream = f"KV_{cfg.bucket}"
    await _until_led(js, stream)
    info = await js.stream_info(stream)
    have = info.config.num_replicas or 1
    if have != n:
        try:
            await js.update_stream(dataclasses.replace(info.config, num_replicas=n))
        except nats.js.errors.APIError as exc:
            raise BusError(_replica_problem(f"KV bucket {cfg.bucket} (now {have} replicas)", n, exc)) from exc
        log.warning("KV bucket %s: replicas %d → %d (NATS copies it in place)", cfg.bucket, have, n)
    return kv


async def ensure_work_stream(js: JetStreamContext, *, memory: bool = False, replicas: int | None = None) -> None:
    """Create the work-queue stream if it does not exist (idempotent, safe from several edges)."""
    cfg = js_api.StreamConfig(
        name=wire.WORK_STREAM,
        subjects=[wire.WORK_SUBJECTS],
        retention=js_api.RetentionPolicy.WORK_QUEUE,
        storage=js_api.StorageType.MEMORY if memory else js_api.StorageType.FILE,
        max_msg_size=MAX_PAYLOAD,
        duplicate_window=120.0,
    )
    await ensure_stream(js, cfg, replicas=replicas)


def _consumer_config(provider: str, capacity: int) -> js_api.ConsumerConfig:
    return js_api.ConsumerConfig(
        durable_name=wire.consumer_name(provider),
        filter_subject=wire.work_subject(provider),
        ack_policy=js_api.AckPolicy.EXPLICIT,
        ack_wait=wire.ACK_WAIT_S,
        max_ack_pending=capacity,
        max_waiting=max(512, capacity * 4),
        deliver_policy=js_api.DeliverPolicy.ALL,
    )


async def ensure_provider_consumer(js: JetStreamContext, provider: str, capacity: int) -> None:
    """One durable pull consumer per provider; `max_ack_pending = capacity` is the hard cap.

    An existing consumer whose cap differs is updated in place (a live capacity change): the
    edge's file is the authority, and only edges make or change consumers.
    """
    name = wire.consumer_name(provider)
    cfg = _consumer_config(provider, capacity)
    try:
        info = await js.consumer_info(wire.WORK_STREAM, name)
    except NotFoundError:
        await js.add_consumer(wire.WORK_STREAM, cfg)
        return
    if info.config.max_ack_pending != capacity or info.config.ack_wait != wire.ACK_WAIT_S:
        log.info("provider %s: capacity %s → %s", provider, info.config.max_ack_pending, capacity)
        await js.add_consumer(wire.WORK_STREAM, cfg)  # create-or-update with the same durable name


CATALOG_BUCKET = "iop_catalog"
"""KV bucket holding each node's section of the deployment (key: node id), written by the edge."""


async def catalog_bucket(js: JetStreamContext, *, replicas: int | None = None) -> Any:
    """The catalog bucket, created if missing (idempotent, safe from several edges).

    Direct gets are allowed on it: a node reads its key with `$JS.API.DIRECT.GET.<stream>.<subject>`,
    a subject NATS permissions can pin to that one key (the classic MSG.GET names it in the payload).
    """
    kv = await ensure_bucket(
        js, js_api.KeyValueConfig(bucket=CATALOG_BUCKET, history=1, direct=True), replicas=replicas
    )
    if not kv._direct:  # a bucket made before nodes had their own permissions
        info = await js.stream_info(auth.CATALOG_STREAM)
        await js.update_stream(dataclasses.replace(info.config, allow_direct=True))
        kv = await js.key_value(CATALOG_BUCKET)
    return kv
