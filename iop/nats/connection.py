"""Client connections for the life of a process: reconnect forever, refuse bad credentials at once."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import re
import ssl
import time
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import unquote, urlsplit

import nats.errors
from nats.aio.client import Client as NATS

from iop.errors import BusError
from iop.nats.access import NatsAccess, reason
from iop.nats.server import EmbeddedNats

log = logging.getLogger(__name__)

CLUSTER_WAIT_S = 30.0
"""How long an edge waits at start for its NATS cluster to elect a JetStream leader before it gives up."""


def servers_of(url: str) -> list[str]:
    """`nats://a:1,nats://b:2` → the list nats-py takes."""
    return [u.strip() for u in url.split(",") if u.strip()]


async def close(nc: NATS) -> None:
    """Close `nc`, also when its server is gone with commands still buffered.

    nats-py's close writes what it buffered while disconnected to the old socket, and uvloop
    raises RuntimeError for a closed transport there (nats-py catches only OSError on that path):
    an edge stopping because its embedded nats-server kept dying printed that traceback as its
    last line instead of the one that says why it stopped. What was buffered is lost either way.
    """
    try:
        await nc.close()
    except RuntimeError as exc:
        log.debug("closing NATS with its connection gone: %s", exc)


async def flush(nc: NATS, timeout_s: int = 5) -> None:
    """Everything written to `nc` so far has reached the server (subscriptions included).

    nats-py's own `flush()` writes its PING straight to the socket, ahead of commands still waiting
    in its buffer for the flusher task: its PONG can come back before a SUB that was issued earlier
    has been sent. Measured here: after subscribe() + flush(), another connection's message was
    missed in 7 of 150 tries. Pushing the buffer out first makes the PING really come last.
    """
    await nc._flush_pending(force_flush=True)
    await nc.flush(timeout=timeout_s)


async def connect(
    url: str,
    name: str,
    *,
    access: NatsAccess | None = None,
    on_disconnect: Callable[[], Awaitable[None]] | None = None,
    on_reconnect: Callable[[], Awaitable[None]] | None = None,
    wait_s: float | None = None,
    inbox_prefix: str = "_INBOX",
) -> NATS:
    """Connect for the life of the process: reconnect forever, notice a dead server in seconds.

    The first connection is retried until `wait_s` passes (None: forever), so a node may start
    before its edge. A server that refuses our credentials or a certificate we cannot verify is
    not retried: that is a configuration error, raised at once as one BusError line.
    `access` None: only what the URL carries.
    """
    if access is None:
        access = NatsAccess()
    if not access.has_credentials:
        access = url_access(url, access)
    tls = access.ssl_context()
    shown = redact(url)
    loop = asyncio.get_running_loop()
    refused: asyncio.Future[str] = loop.create_future()
    last_error: list[str] = []
    connected = False
    refusals_said: set[str] = set()

    async def _error(exc: Exception) -> None:
        problem = _refusal(exc, access, shown)
        if connected:
            # Credentials changed under a running process: say so once (nats-py keeps retrying,
            # and a node removed from the deployment may retry for hours), again after a reconnect.
            loud = problem is not None and problem not in refusals_said
            if problem is not None:
                refusals_said.add(problem)
            (log.warning if loud else log.debug)("%s: nats: %s", name, problem or exc)
            return
        if problem:
            if not refused.done():
                refused.set_result(problem)
            return
        # Said on the second failure, not the first: a server refusing our credentials may reset
        # the first connection before its refusal arrives, and then the refusal is the one line.
        if len(last_error) == 1:
            log.warning("%s: waiting for NATS at %s (%s)", name, shown, reason(exc))
        last_error.append(reason(exc))
        del last_error[:-2]

    async def _disconnected() -> None:
        if not connected:
            return  # closing an attempt that never connected: nothing was lost
        log.warning("%s: disconnected from NATS", name)
        if on_disconnect:
            await on_disconnect()

    async def _reconnected() -> None:
        refusals_said.clear()
        log.warning("%s: reconnected to NATS", name)
        if on_reconnect:
            await on_reconnect()

    nc = NATS()
    attempt: asyncio.Future[None] = asyncio.ensure_future(
        nc.connect(
            servers=servers_of(url),
            name=name,
            user=access.user,
            password=access.password,
            token=access.token,
            tls=tls,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,  # type: ignore[arg-type]  # annotated int, used as seconds
            ping_interval=5,
            max_outstanding_pings=3,
            connect_timeout=2,
            error_cb=_error,
            disconnected_cb=_disconnected,
            reconnected_cb=_reconnected,
            pending_size=64 * 1024 * 1024,
            inbox_prefix=inbox_prefix,
        )
    )
    # nats-py retries the first connection forever by itself (max_reconnect_attempts=-1), so the
    # deadline and the refusals are enforced out here, and the attempt cancelled.
    either: set[asyncio.Future[Any]] = {attempt, refused}
    try:
        done, _ = await asyncio.wait(either, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
        if attempt in done and attempt.exception() is None:
            connected = True
            return nc
        failure = attempt.exception() if attempt in done else None
    finally:
        if not connected:  # refused, timed out, failed, or we were cancelled: abandon the attempt
            attempt.cancel()
            # asyncio.wait collects the attempt without raising its error (read above as `failure`).
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait({attempt})
            if attempt.done() and not attempt.cancelled():
                attempt.exception()  # retrieved: no "exception was never retrieved" at exit
            try:
                await nc.close()
            except (nats.errors.Error, OSError, TimeoutError) as exc:
                log.debug("closing an abandoned NATS connection: %s", exc)
    if refused.done():
        raise BusError(refused.result())
    if failure is not None:
        raise BusError(f"cannot connect to NATS at {shown}: {reason(failure)}") from failure
    why = last_error[-1] if last_error else "no answer"
    raise BusError(f"cannot connect to NATS at {shown} within {wait_s:g}s: {why}")


def url_access(url: str, access: NatsAccess) -> NatsAccess:
    """The credential written into the URL(s), given to nats-py explicitly.

    nats-py sends a URL's user:password only to that URL; the servers a cluster advertises (and a
    client fails over to) get only the explicit credential, and would refuse the connection.
    """
    for server in servers_of(url):
        parts = urlsplit(server)
        if parts.username and parts.password:
            return dataclasses.replace(
                access,
                user=unquote(parts.username),
                password=unquote(parts.password),
                where="the credentials in the NATS URL",
            )
        if parts.username:
            return dataclasses.replace(access, token=unquote(parts.username), where="the token in the NATS URL")
    return access


def _refusal(exc: BaseException, access: NatsAccess, url: str) -> str | None:
    """The one-line explanation of an error retrying cannot fix, or None for one it may."""
    if isinstance(exc, nats.errors.AuthorizationError) or "authorization violation" in str(exc).lower():
        if access.has_credentials:
            return f"NATS at {url} refused our credentials ({access.where}): authorization violation"
        return (
            f"NATS at {url} requires credentials: set edge.nats user_env and password_env, or token_env, "
            "and those environment variables"
        )
    if isinstance(exc, ssl.SSLCertVerificationError):
        hint = f" (CA file {access.tls_ca})" if access.tls_ca else "; set edge.nats.tls_ca to the CA that signed it"
        return f"NATS at {url}: cannot verify the server's TLS certificate: {reason(exc)}{hint}"
    if isinstance(exc, ssl.SSLError) and "CERTIFICATE" in str(exc.reason or ""):
        # The server's alert about our own certificate (missing, unknown CA, expired...).
        mine = f"the client certificate {access.tls_cert}" if access.tls_cert else "no client certificate"
        return f"NATS at {url} refused the TLS handshake with {mine} ({exc.reason}); check edge.nats.tls_cert"
    return None


def redact(url: str) -> str:
    """The URL(s) without any user:password@ part, for messages."""
    return re.sub(r"//[^/@,]*@", "//***@", url)


async def wait_jetstream(nc: NATS, timeout_s: float = CLUSTER_WAIT_S, embedded: EmbeddedNats | None = None) -> float:
    """Until JetStream answers (a cluster has elected its meta leader); seconds waited.

    A single server answers at once; a cluster takes about 5 s after its members meet. Past
    `timeout_s` one BusError line says why, from the embedded server's route complaints when it
    has any (unreachable route, wrong cluster name, refused route credential).
    """
    js = nc.jetstream()
    t0 = time.monotonic()
    last = ""
    while True:
        try:
            await js.account_info()
            return time.monotonic() - t0
        except (nats.errors.Error, TimeoutError) as exc:
            last = str(exc) or type(exc).__name__
        if time.monotonic() - t0 > timeout_s:
            break
        await asyncio.sleep(0.25)  # the cluster's election happens elsewhere; nothing here to wait on
    why = "; ".join(dict.fromkeys(embedded.route_problems)) if embedded and embedded.route_problems else last
    raise BusError(f"NATS JetStream not available within {timeout_s:g}s (no cluster quorum?): {why}")
