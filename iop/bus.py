"""NATS for iop: the embedded nats-server, client connections, and the JetStream work stream."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fcntl
import logging
import os
import re
import signal
import sys
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import IO, Any

import nats
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js import api as js_api
from nats.js.errors import NotFoundError

from iop import wire
from iop.bundle import nats_server_path
from iop.errors import BusError

log = logging.getLogger("iop.bus")

MAX_PAYLOAD = 8 * 1024 * 1024
"""The embedded server's max_payload: room for large prompts (Codex sends whole conversations)."""

_LISTEN_RE = re.compile(rb"Listening for client connections on (\S+):(\d+)")


class EmbeddedNats:
    """The bundled nats-server as a child process with JetStream on a file (or memory) store."""

    def __init__(self, listen: str, store_dir: str | Path, *, lock: bool = True) -> None:
        self.host, _, port = listen.rpartition(":")
        self.port = int(port)
        self.store_dir = Path(store_dir)
        self.lock = lock
        self.proc: asyncio.subprocess.Process | None = None
        self._lock_file: IO[str] | None = None
        self._drain: asyncio.Task[None] | None = None
        self._conf: Path | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    async def start(self, timeout_s: float = 15.0) -> None:
        """Start the server and return once it accepts clients (its log says `Server is ready`)."""
        self.store_dir.mkdir(parents=True, exist_ok=True)
        if self.lock and self._lock_file is None:
            # nats-server does not lock its store; two servers on one directory would corrupt it.
            f = (self.store_dir / "iop.lock").open("w")
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                f.close()
                raise BusError(f"store_dir {self.store_dir} is in use by another iop edge") from exc
            self._lock_file = f
        port = self.port if self.port else -1
        conf = (
            f"host: {_quote(self.host)}\nport: {port}\n"
            f"max_payload: {MAX_PAYLOAD}\n"
            f"jetstream {{ store_dir: {_quote(str(self.store_dir.resolve()))} }}\n"
        )
        fd, name = tempfile.mkstemp(prefix="iop-nats-", suffix=".conf")
        with os.fdopen(fd, "w") as fh:
            fh.write(conf)
        self._conf = Path(name)
        binary = nats_server_path()
        self.proc = await asyncio.create_subprocess_exec(
            binary, "-c", name,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            # Own session: Ctrl-C in a terminal reaches only the edge, which stops the server after
            # draining. Parent-death signal: if the edge is killed outright, the server goes too.
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        assert self.proc.stderr is not None
        tail: list[bytes] = []
        try:
            async with asyncio.timeout(timeout_s):
                while True:
                    line = await self.proc.stderr.readline()
                    if not line:
                        raise BusError(
                            f"nats-server exited during start-up: {b' | '.join(tail[-3:]).decode(errors='replace')}"
                        )
                    tail.append(line.strip())
                    if m := _LISTEN_RE.search(line):
                        self.port = int(m.group(2))
                    if b"Server is ready" in line:
                        break
        except TimeoutError as exc:
            await self.stop()
            raise BusError(f"nats-server did not become ready within {timeout_s:g}s") from exc
        except BusError:
            await self.stop()
            raise
        self._drain = asyncio.create_task(_drain_log(self.proc.stderr))
        log.info("embedded nats-server ready on %s (store %s)", self.url, self.store_dir)

    async def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM, wait up to `timeout_s`, then SIGKILL; release the store lock."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                async with asyncio.timeout(timeout_s):
                    await proc.wait()
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        if self._drain is not None:
            self._drain.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._drain
            self._drain = None
        if self._conf is not None:
            self._conf.unlink(missing_ok=True)
            self._conf = None
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


async def _drain_log(stderr: asyncio.StreamReader) -> None:
    # Keep reading so the pipe never fills and blocks the server; surface warnings and errors.
    while line := await stderr.readline():
        if b"[ERR]" in line or b"[WRN]" in line:
            log.warning("nats-server: %s", line.decode(errors="replace").strip())


def _quote(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def servers_of(url: str) -> list[str]:
    """`nats://a:1,nats://b:2` → the list nats-py takes."""
    return [u.strip() for u in url.split(",") if u.strip()]


async def connect(
    url: str,
    name: str,
    *,
    on_disconnect: Callable[[], Awaitable[None]] | None = None,
    on_reconnect: Callable[[], Awaitable[None]] | None = None,
    wait_s: float | None = None,
) -> NATS:
    """Connect for the life of the process: reconnect forever, notice a dead server in seconds.

    The first connection is retried until `wait_s` passes (None: forever), so a node may start
    before its edge.
    """

    async def _error(exc: Exception) -> None:
        log.debug("nats: %s", exc)

    async def _disconnected() -> None:
        log.warning("%s: disconnected from NATS", name)
        if on_disconnect:
            await on_disconnect()

    async def _reconnected() -> None:
        log.warning("%s: reconnected to NATS", name)
        if on_reconnect:
            await on_reconnect()

    loop = asyncio.get_running_loop()
    give_up = None if wait_s is None else loop.time() + wait_s
    delay = 0.1
    announced = False
    while True:
        try:
            nc: NATS = await nats.connect(
                servers=servers_of(url),
                name=name,
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.5,
                ping_interval=5,
                max_outstanding_pings=3,
                connect_timeout=2,
                error_cb=_error,
                disconnected_cb=_disconnected,
                reconnected_cb=_reconnected,
                pending_size=64 * 1024 * 1024,
            )
            return nc
        except (OSError, nats.errors.Error, TimeoutError) as exc:
            if give_up is not None and loop.time() >= give_up:
                raise BusError(f"cannot connect to NATS at {url}: {exc or type(exc).__name__}") from exc
            if not announced:
                log.warning("%s: waiting for NATS at %s (%s)", name, url, exc or type(exc).__name__)
                announced = True
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)


async def ensure_work_stream(js: JetStreamContext, *, memory: bool = False) -> None:
    """Create the work-queue stream if it does not exist (idempotent, safe from several edges)."""
    cfg = js_api.StreamConfig(
        name=wire.WORK_STREAM,
        subjects=[wire.WORK_SUBJECTS],
        retention=js_api.RetentionPolicy.WORK_QUEUE,
        storage=js_api.StorageType.MEMORY if memory else js_api.StorageType.FILE,
        max_msg_size=MAX_PAYLOAD,
        duplicate_window=120.0,
    )
    try:
        await js.stream_info(wire.WORK_STREAM)
    except NotFoundError:
        try:
            await js.add_stream(cfg)
        except nats.js.errors.BadRequestError:
            await js.stream_info(wire.WORK_STREAM)  # another edge created it meanwhile


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


async def ensure_provider_consumer(
    js: JetStreamContext, provider: str, capacity: int, *, update: bool = True
) -> None:
    """One durable pull consumer per provider; `max_ack_pending = capacity` is the hard cap.

    An existing consumer whose cap differs is updated in place (a live capacity change) when
    `update` is set; nodes only create a missing consumer, the edge's file is the authority.
    """
    name = wire.consumer_name(provider)
    cfg = _consumer_config(provider, capacity)
    try:
        info = await js.consumer_info(wire.WORK_STREAM, name)
    except NotFoundError:
        await js.add_consumer(wire.WORK_STREAM, cfg)
        return
    if update and info.config.max_ack_pending != capacity:
        log.info("provider %s: capacity %s → %s", provider, info.config.max_ack_pending, capacity)
        await js.add_consumer(wire.WORK_STREAM, cfg)  # create-or-update with the same durable name


async def consumer_counts(js: JetStreamContext, provider: str) -> dict[str, Any]:
    """The broker's view of a provider: ack-pending (running) and pending (not yet fetched)."""
    info = await js.consumer_info(wire.WORK_STREAM, wire.consumer_name(provider))
    return {"num_ack_pending": info.num_ack_pending, "num_pending": info.num_pending}
