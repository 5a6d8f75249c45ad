"""The usage ledger: one `RequestRecord` per request, published to the JetStream stream IOP_LEDGER.

Publishing never runs on a request's path: `LedgerWriter.add` appends to a bounded buffer and a
background task sends the records in batches, one message per alias (all aliases at once, in one
round trip). It sends as soon as a record comes, after a short gathering window: a crash (SIGKILL,
power) loses only the records of requests that ended in the last `GATHER_S` plus one publish round
trip, and those of requests still running. While NATS is down the records wait in the buffer; what
does not fit is dropped, counted (`dropped`, the metric `iop_ledger_dropped_total`) and logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import re
import secrets
import time
from collections import deque
from typing import Literal

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js import api as js_api
from nats.js.errors import NotFoundError

from iop.errors import BusError
from iop.nats import streams

log = logging.getLogger("iop.edge")

LEDGER_STREAM = "IOP_LEDGER"
LEDGER_SUBJECTS = "iop.ledger.>"
"""What readers filter on: every ledger subject, whatever the stream's token."""
GATHER_S = 0.005
"""After a record comes, how long the writer lets others gather before it sends them (NATS up).

It was a 0.25 s timer: an edge SIGKILLed right after a burst lost 12-57 of 300 records. Now a
record waits at most this long plus the publish in flight; records that come meanwhile form the
next batches, so a burst still sends few messages."""
BATCH_RECORDS = 512
"""Most records in one ledger message (~60 KB)."""
RETRY_S = 1.0
LOSS_LOG_EVERY_S = 10.0

_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


_TOKEN_SUBJECTS = re.compile(r"^iop\.ledger\.([0-9a-f]{32})\.>$")


def ledger_subject(alias: str, token: str = "") -> str:
    """The subject an alias's records go to: `iop.ledger.<token>.<alias>`.

    Aliases may hold `.`, `*` or `>`; those become `_`. The token is the stream's secret (see
    `ensure_ledger_stream`); "" gives the subjects of a ledger made before it had one.
    """
    return "iop.ledger." + (f"{token}." if token else "") + (_UNSAFE.sub("_", alias) or "_")


def token_of(subjects: list[str] | None) -> str | None:
    """The secret token in the ledger stream's subjects; None for another (an older) form."""
    for subject in subjects or []:
        if m := _TOKEN_SUBJECTS.match(subject):
            return m.group(1)
    return None


class RequestRecord(msgspec.Struct, kw_only=True, array_like=True, gc=False):
    """What the edge knows about one request when it ends. Never a prompt, an answer or a key.

    Stored as a msgpack array (field order is the format: new fields go at the end, with a
    default). Times are in milliseconds; unknown values are None, never a guess. Not tracked by
    the garbage collector (scalars only): reading a million of them stays cheap.
    """

    id: str
    """The request id (`x-request-id`, the client's or generated)."""
    start: float
    """Unix time the edge received the request."""
    alias: str
    """The `model` the client asked for ("" when the request never named a known one)."""
    route: Literal["pool", "direct", ""]
    api: Literal["chat", "responses", "messages", "embeddings", "completions", "count_tokens", "compact", ""]
    stream: bool
    status: int
    """The HTTP status the client got (499: the client went away first)."""
    error: str = ""
    """The error code, "" on success."""
    edge: str = ""
    node: str = ""
    provider: str = ""
    """The provider (pool) or CLI resource (direct) of the last attempt."""
    model: str = ""
    """The upstream model name the provider was asked for."""
    attempts: int = 0
    """Providers tried (failover makes it more than 1); 0 when nothing was dispatched."""
    queue_ms: float | None = None
    """From arrival until a node started the request."""
    ttfb_ms: float | None = None
    """From arrival until the first answer byte left the edge."""
    duration_ms: float = 0.0
    input_tokens: int | None = None
    output_tokens: int | None = None
    cached_tokens: int | None = None
    reasoning_tokens: int | None = None
    bytes_in: int = 0
    bytes_out: int = 0
    key: str = ""
    """The name of the client key used (`name:key` entries name keys), never the key."""
    cancelled: bool = False
    upstream_status: int | None = None
    """The HTTP status the upstream answered (openai adapter)."""
    exit_code: int | None = None
    """The CLI command's exit status (direct routes)."""
    run_ms: float | None = None
    """How long the node ran it (CLI: the process's run time)."""
    node_ttfb_ms: float | None = None
    """From the node's start until it sent the first answer byte: the gateway's own share is ttfb_ms minus this."""
    affinity: bool = False
    """Routed by prefix-cache affinity: the provider its session (session key) used last."""
    tenant: str = ""
    """The tenant of the client key (iop/edge/tenants.py): its name, "" without client keys."""
    cold_start_ms: float | None = None
    """Of `queue_ms`, how long the node waited for the provider's model server to start (a cold start
    or a swap, iop/node/servers.py); None when it was ready."""
    route_reason: str = ""
    """Why this provider (pool requests): `affinity`, `only_free`, `free_slots`, `unmeasured`, or
    `expected_finish 1.20s vs 3.40s` (its estimate against the next best's; iop/edge/routing.py)."""
    trace_id: str = ""
    """The request's OpenTelemetry trace (32 hex digits) when it was traced and sampled; "" otherwise."""


encode_batch = msgspec.msgpack.Encoder().encode
decode_batch = msgspec.msgpack.Decoder(list[RequestRecord]).decode


async def ensure_ledger_stream(js: JetStreamContext, max_age_s: float, max_bytes: int) -> str:
    """Create IOP_LEDGER (file storage, limits retention) or bring its limits to the configured ones.

    Returns the stream's secret token. The stream takes only `iop.ledger.<token>.>`: a node may
    name any reply subject in the JetStream requests it must make (pulling its work), and the
    server's answers land there; with `iop.ledger.>` one node credential stored 200,000 junk
    messages in 1.7 s. Nodes can neither read the stream's config nor list streams, so they cannot
    learn the token (128 random bits, made by the first edge, read from the stream by the others).
    """
    try:
        token = token_of((await js.stream_info(LEDGER_STREAM)).config.subjects)
    except NotFoundError:
        token = None
    cfg = js_api.StreamConfig(
        name=LEDGER_STREAM,
        subjects=[f"iop.ledger.{token or secrets.token_hex(16)}.>"],
        retention=js_api.RetentionPolicy.LIMITS,
        storage=js_api.StorageType.FILE,
        discard=js_api.DiscardPolicy.OLD,
        max_age=max_age_s,
        max_bytes=max_bytes,
        duplicate_window=120.0,
    )
    # Created with edge.nats.replicas (streams.default_replicas), or scaled in place to them.
    # max_bytes is reserved on the store at once: a store too small gets a line naming the setting.
    await streams.ensure_stream(js, cfg, sized_by="edge.ledger.max_bytes")
    have = (await js.stream_info(LEDGER_STREAM)).config
    stored = token_of(have.subjects)  # another edge may have made it first, with its token
    if stored is not None:
        cfg = dataclasses.replace(cfg, subjects=have.subjects)
    else:
        log.warning("ledger: stream %s takes its records on a secret subject from now on", LEDGER_STREAM)
    if stored is None or have.max_bytes != max_bytes or abs((have.max_age or 0) - max_age_s) > 1e-3:
        replicas = have.num_replicas or 1
        try:
            await js.update_stream(dataclasses.replace(cfg, num_replicas=replicas))
        except nats.js.errors.APIError as exc:
            problem = streams.stream_problem(
                f"stream {LEDGER_STREAM}", max_bytes, replicas, exc, "edge.ledger.max_bytes"
            )
            raise BusError(problem) from exc
    found = token_of(cfg.subjects)
    assert found is not None
    return found


class LedgerWriter:
    """Buffers records and publishes them in batches from one background task."""

    def __init__(self, nc: NATS, js: JetStreamContext, edge_id: str, *, buffer_records: int = 100_000) -> None:
        self.nc = nc
        self.js = js
        self.edge_id = edge_id
        self.token = ""
        """The ledger stream's secret subject token (`ensure_ledger_stream`), set before `start`."""
        self.limit = buffer_records
        self._buffer: dict[str, deque[RequestRecord]] = {}
        """Records waiting, by subject (alias): interleaved aliases still make one batch each."""
        self._count = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._batch_seq = 0
        self._sending: dict[str, tuple[str, int, bytes]] = {}
        """Subject → the batch being sent there (message id, records, data): resent unchanged until stored."""
        self._started = f"{time.time_ns():x}"
        self.written = 0
        self.dropped = 0
        self._dropped_logged = 0
        self._last_loss_log = 0.0
        self.changed = asyncio.Event()
        """Set after every flush (tests and shutdown wait on it)."""

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    def add(self, record: RequestRecord) -> None:
        """Queue a record; never blocks, never raises. Full buffer: the record is lost and counted."""
        if self._count >= self.limit:
            self.dropped += 1
            self._log_loss()
            return
        subject = ledger_subject(record.alias, self.token)
        waiting = self._buffer.get(subject)
        if waiting is None:
            waiting = self._buffer[subject] = deque()
        waiting.append(record)
        self._count += 1
        self._wake.set()

    @property
    def pending(self) -> int:
        return self._count

    def clear(self) -> None:
        """Forget the records waiting (a benchmark measuring `add` alone)."""
        self._buffer.clear()
        self._sending.clear()
        self._count = 0

    def _log_loss(self) -> None:
        now = time.monotonic()
        if now - self._last_loss_log >= LOSS_LOG_EVERY_S:
            self._last_loss_log = now
            log.error(
                "ledger: buffer full (%d records waiting for NATS): %d records lost so far",
                self._count,
                self.dropped,
            )

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            await asyncio.sleep(GATHER_S)  # a window for a burst's records to share messages
            self._wake.clear()
            if not await self.flush():
                self._wake.set()  # what is left is tried again after the pause
                await asyncio.sleep(RETRY_S)  # NATS is down: the records wait, the buffer bounds them

    async def flush(self) -> bool:
        """Send what is buffered; False when NATS refused (the unsent records stay, in order)."""
        while self._count:
            if not self.nc.is_connected:
                # Not handed to the client while it reconnects: its own buffer is unbounded by us
                # and is lost (or fails its close) if NATS never comes back. Ours is counted.
                return False
            for subject, waiting in self._buffer.items():
                if subject in self._sending or not waiting:
                    continue
                batch = [waiting[i] for i in range(min(BATCH_RECORDS, len(waiting)))]
                self._batch_seq += 1
                # A retry resends this exact message under the same id: had the first try reached the
                # server after all, the duplicate window stores it once.
                msg_id = f"{self.edge_id}-{self._started}-{self._batch_seq}"
                self._sending[subject] = (msg_id, len(batch), encode_batch(batch))
            sending = list(self._sending.items())
            outcomes = await asyncio.gather(
                *(
                    self.js.publish(subject, data, timeout=5.0, headers={"Nats-Msg-Id": msg_id})
                    for subject, (msg_id, _, data) in sending
                ),
                return_exceptions=True,
            )
            refused: BaseException | None = None
            for (subject, (_, count, _)), outcome in zip(sending, outcomes, strict=True):
                if isinstance(outcome, (nats.errors.Error, TimeoutError, OSError)):
                    refused = outcome
                    continue
                if isinstance(outcome, BaseException):
                    raise outcome
                del self._sending[subject]
                waiting = self._buffer[subject]
                for _ in range(count):
                    waiting.popleft()
                if not waiting:
                    del self._buffer[subject]
                self._count -= count
                self.written += count
            self.changed.set()
            if refused is not None:
                log.warning("ledger: %d records waiting, NATS refused a batch: %s", self._count, refused or "")
                return False
        return True

    async def stop(self, timeout_s: float = 2.0) -> None:
        """Send what is left (up to `timeout_s`), then stop; what could not be sent is counted as lost."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                for _ in range(int(timeout_s / RETRY_S * 4) + 1):
                    if await self.flush():
                        break
                    await asyncio.sleep(RETRY_S / 4)  # a pause between tries, not a wait for an event
        if self._count:
            self.dropped += self._count
            log.error("ledger: %d records could not be written before shutdown", self._count)
            self.clear()
