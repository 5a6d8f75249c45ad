"""NATS for iop: the embedded nats-server, client connections, and the JetStream work stream."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import ctypes
import dataclasses
import fcntl
import hashlib
import hmac
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import ssl
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any
from urllib.parse import unquote, urlsplit

import nats
import nats.errors
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js import api as js_api
from nats.js.errors import NotFoundError

from iop import config, natsauth, wire
from iop.bundle import nats_server_path
from iop.errors import BusError

log = logging.getLogger("iop.bus")

MAX_PAYLOAD = 8 * 1024 * 1024
"""The embedded server's max_payload: room for large prompts (Codex sends whole conversations)."""

_LISTEN_RE = re.compile(rb"Listening for client connections on (\S+):(\d+)")
_ROUTE_PROBLEM_RE = re.compile(
    rb"(Error trying to connect to route.*|cluster name .* does not match .*|.*[Aa]uthorization.*)$"
)

_CLUSTER_CHATTER = (
    b"Waiting for routing to be established",
    b"has not established contact with a meta leader",
    b"Metalayer blocking snapshot",
    b"detected consumer remapping",
)
"""Warnings a cluster member logs on every start and stop: not news to an operator."""

ROUTE_USER = "iop-route"
"""The user cluster members present to each other's route port (password derived like every other)."""

CLUSTER_WAIT_S = 30.0
"""How long an edge waits at start for its NATS cluster to elect a JetStream leader before it gives up."""

default_replicas: contextvars.ContextVar[int] = contextvars.ContextVar("default_replicas", default=1)
"""Replicas of every stream and KV bucket iop creates (`edge.nats.replicas`): set once by the edge."""


@dataclass(frozen=True)
class NatsAccess:
    """How a client proves itself to NATS and which server certificates it trusts.

    Secrets are read from environment variables named in the deployment file and never logged
    (`repr` leaves them out). `where` names those variables, for error messages.
    """

    user: str | None = None
    password: str | None = field(default=None, repr=False)
    token: str | None = field(default=None, repr=False)
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    where: str = "edge.nats"

    @classmethod
    def from_settings(cls, nats: config.NatsSettings, environ: Mapping[str, str] | None = None) -> NatsAccess:
        """Read the secrets the settings name; BusError naming the field when a variable is unset."""
        env = os.environ if environ is None else environ

        def secret(field_name: str, var: str | None) -> str | None:
            if var is None:
                return None
            value = env.get(var, "")
            if not value:
                raise BusError(f"edge.nats.{field_name}: environment variable {var} is not set (or empty)")
            if any(ord(c) < 32 or ord(c) == 127 for c in value):
                raise BusError(f"edge.nats.{field_name}: the value of {var} contains control characters")
            return value

        where = "edge.nats"
        if nats.token_env:
            where = f"the token in ${nats.token_env}"
        elif nats.user_env:
            where = f"the user in ${nats.user_env} and the password in ${nats.password_env}"
        return cls(
            user=secret("user_env", nats.user_env),
            password=secret("password_env", nats.password_env),
            token=secret("token_env", nats.token_env),
            tls_ca=nats.tls_ca,
            tls_cert=nats.tls_cert,
            tls_key=nats.tls_key,
            where=where,
        )

    @property
    def has_credentials(self) -> bool:
        return bool(self.token or (self.user and self.password))

    def ssl_context(self) -> ssl.SSLContext | None:
        """A client TLS context trusting `tls_ca` (and presenting `tls_cert`); None: nats-py's default."""
        if not (self.tls_ca or self.tls_cert):
            return None
        try:
            ctx = ssl.create_default_context(cafile=self.tls_ca)
        except (OSError, ssl.SSLError) as exc:
            raise BusError(f"edge.nats.tls_ca: cannot load {self.tls_ca}: {_reason(exc)}") from exc
        if self.tls_cert:
            try:
                ctx.load_cert_chain(self.tls_cert, self.tls_key)
            except (OSError, ssl.SSLError) as exc:
                raise BusError(
                    f"edge.nats.tls_cert: cannot load {self.tls_cert} with key {self.tls_key}: {_reason(exc)}"
                ) from exc
        return ctx


default_access: contextvars.ContextVar[NatsAccess | None] = contextvars.ContextVar("default_access", default=None)
"""What `connect()` uses when not given `access`: set once by `iop node` for every connection it makes."""


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLCertVerificationError):
        return str(exc.verify_message or exc.reason or exc)
    if isinstance(exc, ssl.SSLError):
        return str(exc.reason or exc)
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__


SECRET_FILE = "iop-nats-secret"
"""In the embedded server's store_dir: the per-deployment secret every NATS password derives from."""


class Credentials:
    """The embedded server's users: the edge and one per node, passwords derived from one secret.

    The secret is made at first start (by the edge, or a node started with the same file on the
    same machine) and kept in `store_dir` with mode 0600. Deriving (HMAC) rather than storing each
    password means a node added by a refresh has its credential at once, and `iop nats-creds`
    can print any node's without a registry of them.
    """

    def __init__(self, secret: bytes, path: Path) -> None:
        self._secret = secret
        self.path = path

    def __repr__(self) -> str:
        return f"Credentials({self.path})"

    @classmethod
    def load(cls, store_dir: str | Path, *, create: bool = True) -> Credentials:
        path = Path(store_dir) / SECRET_FILE
        try:
            return cls(_read_secret(path), path)
        except FileNotFoundError:
            if not create:
                raise BusError(f"no NATS credentials at {path}: start the edge once (it makes them)") from None
        path.parent.mkdir(parents=True, exist_ok=True)
        # Written whole under a temporary name, then linked into place: two processes starting at
        # once (edge and node) both end up with the one secret that got there first.
        tmp = path.with_name(f".{SECRET_FILE}.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_hex(32) + "\n")
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
        return cls(_read_secret(path), path)

    def password(self, user: str) -> str:
        return hmac.new(self._secret, user.encode(), hashlib.sha256).hexdigest()

    def edge(self) -> NatsAccess:
        user = natsauth.EDGE_USER
        return NatsAccess(user=user, password=self.password(user), where=f"the edge's credential from {self.path}")

    def node(self, node_id: str) -> NatsAccess:
        user = natsauth.node_user(node_id)
        return NatsAccess(
            user=user, password=self.password(user), where=f"node {node_id}'s credential from {self.path}"
        )

    def authorization(self, nodes: Iterable[config.Node]) -> str:
        """The server's `authorization` block: the edge, and each node with its permissions."""
        return natsauth.authorization(
            self.password(natsauth.EDGE_USER), [(n, self.password(natsauth.node_user(n.id))) for n in nodes]
        )


def _read_secret(path: Path) -> bytes:
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        raise BusError(f"{path} is readable by others (mode {mode:o}): chmod 600 it")
    secret = path.read_text().strip()
    if len(secret) < 32:
        raise BusError(f"{path} does not hold a secret (delete it to make a new one)")
    return secret.encode()


class EmbeddedNats:
    """The bundled nats-server as a child process with JetStream on a file (or memory) store.

    It always requires credentials, on loopback too: the edge's, and each node's own with only
    that node's permissions (`iop/natsauth.py`). `url` carries the edge's credential, for
    clients in this process; `address` is the plain one, to print and to give nodes.
    """

    def __init__(
        self,
        listen: str,
        store_dir: str | Path,
        *,
        lock: bool = True,
        nodes: Iterable[config.Node] = (),
        cluster: config.ClusterSettings | None = None,
    ) -> None:
        self.host, _, port = listen.rpartition(":")
        self.port = int(port)
        self.cluster = cluster
        self.route_problems: list[str] = []
        """The server's last complaints about its routes (refused, unreachable, wrong cluster name)."""
        self.store_dir = Path(store_dir)
        self.lock = lock
        self.nodes = list(nodes)
        self.credentials: Credentials | None = None
        self.proc: asyncio.subprocess.Process | None = None
        self._lock_file: IO[str] | None = None
        self._drain: asyncio.Task[None] | None = None
        self._conf_dir: Path | None = None
        self._reloaded = asyncio.Event()

    @property
    def address(self) -> str:
        return f"nats://{self.host}:{self.port}"

    @property
    def url(self) -> str:
        access = self.access
        return f"nats://{access.user}:{access.password}@{self.host}:{self.port}"

    @property
    def access(self) -> NatsAccess:
        """The edge's credential for this server."""
        if self.credentials is None:
            self.credentials = Credentials.load(self.store_dir)
        return self.credentials.edge()

    def node_access(self, node_id: str) -> NatsAccess:
        """Node `node_id`'s own credential for this server (it works once the node is authorized)."""
        if self.credentials is None:
            self.credentials = Credentials.load(self.store_dir)
        return self.credentials.node(node_id)

    async def start(self, timeout_s: float = 15.0) -> None:
        """Start the server and return once it accepts clients (its log says `Server is ready`)."""
        try:
            self.store_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise BusError(f"store_dir {self.store_dir}: {exc.strerror or exc}") from exc
        if self.lock and self._lock_file is None:
            # nats-server does not lock its store; two servers on one directory would corrupt it.
            try:
                f = (self.store_dir / "iop.lock").open("w")
            except OSError as exc:
                raise BusError(f"store_dir {self.store_dir}: {exc.strerror or exc}") from exc
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                f.close()
                raise BusError(f"store_dir {self.store_dir} is in use by another iop edge") from exc
            self._lock_file = f
        if self.credentials is None:
            self.credentials = Credentials.load(self.store_dir)
        # A private directory (0700) and file (0600): the file holds the passwords. Removed at stop.
        self._conf_dir = Path(tempfile.mkdtemp(prefix="iop-nats-"))
        name = str(self._conf_dir / "nats.conf")
        with os.fdopen(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as fh:
            fh.write(self._conf())
        binary = nats_server_path()
        self.proc = await asyncio.create_subprocess_exec(
            binary,
            "-c",
            name,
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
        self._drain = asyncio.create_task(_drain_log(self.proc.stderr, self._reloaded, self.route_problems))
        log.info(
            "embedded nats-server (pid %d) ready on %s (store %s, credentials in %s)",
            self.proc.pid,
            self.address,
            self.store_dir,
            self.credentials.path,
        )

    async def wait(self) -> int:
        """Until the server process exits; its exit status (negative: the signal that ended it)."""
        proc = self.proc
        if proc is None:
            return 0
        return await proc.wait()

    async def restart(self, timeout_s: float = 15.0) -> None:
        """Start the server again after it died: same port (clients reconnect by themselves), same store."""
        await self._release_process()
        await self.start(timeout_s)

    def _conf(self) -> str:
        assert self.credentials is not None
        port = self.port if self.port else -1
        return (
            f"host: {_quote(self.host)}\nport: {port}\n"
            f"max_payload: {MAX_PAYLOAD}\n"
            f"jetstream {{ store_dir: {_quote(str(self.store_dir.resolve()))} }}\n" + self._cluster_conf()
        ) + self.credentials.authorization(self.nodes)

    @property
    def server_name(self) -> str | None:
        """This member's name in the cluster (JetStream needs one per server), None when alone."""
        c = self.cluster
        if c is None:
            return None
        return c.server_name or f"{socket.gethostname()}-{c.listen.rpartition(':')[2]}"

    def _cluster_conf(self) -> str:
        """`server_name` and the `cluster` block; routes carry the route user's credential.

        Every member derives the route password from the same secret, which is why the members
        share `iop-nats-secret` (docs/scale-out.md): the nodes' passwords must work on any of them.
        """
        c = self.cluster
        if c is None:
            return ""
        assert self.credentials is not None
        password = self.credentials.password(ROUTE_USER)
        routes = [f"nats-route://{ROUTE_USER}:{password}@{r}" for r in c.routes]
        return (
            f"server_name: {_quote(self.server_name or '')}\n"
            f"cluster {{\n  name: {_quote(c.name)}\n  listen: {_quote(c.listen)}\n"
            f"  authorization {{ user: {_quote(ROUTE_USER)}, password: {_quote(password)} }}\n"
            f"  routes: [{', '.join(_quote(r) for r in routes)}]\n}}\n"
        )

    async def authorize(self, nodes: Iterable[config.Node], timeout_s: float = 10.0) -> None:
        """Give the running server the users and permissions of `nodes` (a refreshed deployment).

        The config is rewritten and the server reloads it (SIGHUP); this returns once its log says
        so. A node no longer listed loses its user, and the server closes its connection.
        """
        self.nodes = list(nodes)
        if self.proc is None or self._conf_dir is None:
            return
        path = self._conf_dir / "nats.conf"
        tmp = self._conf_dir / "nats.conf.new"
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as fh:
            fh.write(self._conf())
        tmp.replace(path)
        self._reloaded.clear()
        self.proc.send_signal(signal.SIGHUP)
        try:
            async with asyncio.timeout(timeout_s):
                await self._reloaded.wait()
        except TimeoutError:
            raise BusError(f"nats-server did not reload its users within {timeout_s:g}s") from None

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
        await self._release_process()
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None

    async def _release_process(self) -> None:
        """Forget a process that has exited: its log reader and its generated config."""
        self.proc = None
        if self._drain is not None:
            self._drain.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._drain
            self._drain = None
        if self._conf_dir is not None:
            shutil.rmtree(self._conf_dir, ignore_errors=True)
            self._conf_dir = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


AUTH_ERROR_EVERY_S = 60.0
"""The server's "authentication error" for one user is passed on once in this long (a removed node retries)."""


async def _drain_log(stderr: asyncio.StreamReader, reloaded: asyncio.Event, route_problems: list[str]) -> None:
    # Keep reading so the pipe never fills and blocks the server; surface warnings and errors.
    said: dict[str, float] = {}
    while line := await stderr.readline():
        if b"Reloaded server configuration" in line:
            reloaded.set()
        elif (b"[ERR]" in line) and (route := _ROUTE_PROBLEM_RE.search(line.strip())):
            problem = re.sub(r" \(attempt \d+\)", "", route.group(1).decode(errors="replace"))
            if problem in route_problems:
                route_problems.remove(problem)
            route_problems.append(problem)  # the latest last; only said when the cluster never forms
            del route_problems[:-3]
            log.debug("nats-server: %s", line.decode(errors="replace").strip())
        elif any(benign in line for benign in _CLUSTER_CHATTER):
            log.debug("nats-server: %s", line.decode(errors="replace").strip())
        elif b"[ERR]" in line or b"[WRN]" in line:
            text = line.decode(errors="replace").strip()
            if m := re.search(r'authentication error - User "([^"]*)"', text):
                now = time.monotonic()
                if now - said.get(m.group(1), -AUTH_ERROR_EVERY_S) < AUTH_ERROR_EVERY_S:
                    continue
                said[m.group(1)] = now
            log.warning("nats-server: %s", text)


def _quote(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


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
    `access` defaults to `default_access`.
    """
    if access is None:
        access = default_access.get() or NatsAccess()
    if not access.has_credentials:
        access = url_access(url, access)
    tls = access.ssl_context()
    shown = _redact(url)
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
            log.warning("%s: waiting for NATS at %s (%s)", name, shown, _reason(exc))
        last_error.append(_reason(exc))
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
        raise BusError(f"cannot connect to NATS at {shown}: {_reason(failure)}") from failure
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
        return f"NATS at {url}: cannot verify the server's TLS certificate: {_reason(exc)}{hint}"
    if isinstance(exc, ssl.SSLError) and "CERTIFICATE" in str(exc.reason or ""):
        # The server's alert about our own certificate (missing, unknown CA, expired...).
        mine = f"the client certificate {access.tls_cert}" if access.tls_cert else "no client certificate"
        return f"NATS at {url} refused the TLS handshake with {mine} ({exc.reason}); check edge.nats.tls_cert"
    return None


def _redact(url: str) -> str:
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


def _replicas(replicas: int | None) -> int:
    return replicas if replicas is not None else default_replicas.get()


def _replica_problem(what: str, replicas: int, exc: nats.js.errors.APIError) -> str:
    return (
        f"{what}: cannot keep {replicas} replicas ({exc.description or exc}); edge.nats.replicas must not exceed "
        "the number of JetStream servers in the NATS cluster (1 without a cluster)"
    )


async def _until_led(js: JetStreamContext, stream: str, timeout_s: float = 10.0) -> None:
    """Until a new stream has a leader: on a cluster its raft group forms after the create returns,
    and reads (a KV direct get) before that find no responder."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        info = await js.stream_info(stream)
        if info.cluster is None or info.cluster.leader:
            return
        await asyncio.sleep(0.05)  # the election happens in the servers; nothing here to wait on


async def ensure_stream(
    js: JetStreamContext, cfg: js_api.StreamConfig, *, replicas: int | None = None, scale: bool = True
) -> None:
    """Create stream `cfg` if missing, with the deployment's replicas; scale an existing one in place.

    Idempotent and safe from several edges. `replicas` None: `default_replicas`. NATS moves a
    live stream between R1 and R3 by itself (its consumers follow); when it cannot, one BusError
    line names the stream and why. `scale` False (a node): never change an existing stream.
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
            if exc.err_code != 10058:  # 10058: the name is in use (another edge created it meanwhile)
                raise BusError(_replica_problem(f"stream {cfg.name}", n, exc)) from exc
        except nats.js.errors.APIError as exc:
            raise BusError(_replica_problem(f"stream {cfg.name}", n, exc)) from exc
        info = await js.stream_info(name)
    have = info.config.num_replicas or 1
    if have != n and scale:
        try:
            await js.update_stream(dataclasses.replace(info.config, num_replicas=n))
        except nats.js.errors.APIError as exc:
            raise BusError(_replica_problem(f"stream {cfg.name} (now {have} replicas)", n, exc)) from exc
        log.warning("stream %s: replicas %d → %d (NATS copies it in place)", cfg.name, have, n)


async def ensure_bucket(js: JetStreamContext, cfg: js_api.KeyValueConfig, *, replicas: int | None = None) -> Any:
    """The KV bucket `cfg`, created if missing with the deployment's replicas, scaled in place if not."""
    n = _replicas(replicas)
    try:
        kv = await js.key_value(cfg.bucket)
    except (NotFoundError, nats.js.errors.BucketNotFoundError):
        try:
            kv = await js.create_key_value(dataclasses.replace(cfg, replicas=n))
            await _until_led(js, f"KV_{cfg.bucket}")
            return kv
        except nats.js.errors.BadRequestError as exc:
            if exc.err_code != 10058:
                raise BusError(_replica_problem(f"KV bucket {cfg.bucket}", n, exc)) from exc
        except nats.js.errors.APIError as exc:
            raise BusError(_replica_problem(f"KV bucket {cfg.bucket}", n, exc)) from exc
        kv = await js.key_value(cfg.bucket)
    stream = f"KV_{cfg.bucket}"
    info = await js.stream_info(stream)
    have = info.config.num_replicas or 1
    if have != n:
        try:
            await js.update_stream(dataclasses.replace(info.config, num_replicas=n))
        except nats.js.errors.APIError as exc:
            raise BusError(_replica_problem(f"KV bucket {cfg.bucket} (now {have} replicas)", n, exc)) from exc
        log.warning("KV bucket %s: replicas %d → %d (NATS copies it in place)", cfg.bucket, have, n)
    return kv


async def ensure_work_stream(
    js: JetStreamContext, *, memory: bool = False, replicas: int | None = None, scale: bool = True
) -> None:
    """Create the work-queue stream if it does not exist (idempotent, safe from several edges)."""
    cfg = js_api.StreamConfig(
        name=wire.WORK_STREAM,
        subjects=[wire.WORK_SUBJECTS],
        retention=js_api.RetentionPolicy.WORK_QUEUE,
        storage=js_api.StorageType.MEMORY if memory else js_api.StorageType.FILE,
        max_msg_size=MAX_PAYLOAD,
        duplicate_window=120.0,
    )
    await ensure_stream(js, cfg, replicas=replicas, scale=scale)


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


async def ensure_provider_consumer(js: JetStreamContext, provider: str, capacity: int, *, update: bool = True) -> None:
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
    if update and (info.config.max_ack_pending != capacity or info.config.ack_wait != wire.ACK_WAIT_S):
        log.info("provider %s: capacity %s → %s", provider, info.config.max_ack_pending, capacity)
        await js.add_consumer(wire.WORK_STREAM, cfg)  # create-or-update with the same durable name


async def consumer_counts(js: JetStreamContext, provider: str) -> dict[str, Any]:
    """The broker's view of a provider: ack-pending (running) and pending (not yet fetched)."""
    info = await js.consumer_info(wire.WORK_STREAM, wire.consumer_name(provider))
    return {"num_ack_pending": info.num_ack_pending, "num_pending": info.num_pending}


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
        info = await js.stream_info(natsauth.CATALOG_STREAM)
        await js.update_stream(dataclasses.replace(info.config, allow_direct=True))
        kv = await js.key_value(CATALOG_BUCKET)
    return kv
