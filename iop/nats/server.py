"""The embedded nats-server: a child process with JetStream, its config, its log and its reloads."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fcntl
import logging
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO

from iop import config
from iop.errors import BusError
from iop.nats import auth
from iop.nats.access import Credentials, NatsAccess
from iop.nats.bundle import nats_server_path
from iop.nats.goruntime import server_env

log = logging.getLogger(__name__)

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


class EmbeddedNats:
    """The bundled nats-server as a child process with JetStream on a file (or memory) store.

    It always requires credentials, on loopback too: the edge's, and each node's own with only
    that node's permissions (`iop/nats/auth.py`). `url` carries the edge's credential, for
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
        self._reloads = 0
        """How many times the config was rewritten for a reload (a comment in it: each rewrite a change)."""
        self.store_failed = ""
        """The server's last critical write error (a full disk): its streams stay failed until it restarts."""
        self.store_failed_event = asyncio.Event()
        self.recycling: asyncio.Future[None] | None = None
        """Set while `recycle` restarts the server: its exit then is asked for, not a death."""

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
        _move_global_account(self.store_dir / "jetstream", clustered=self.cluster is not None)
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
            env=server_env(os.environ),
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
        self._drain = asyncio.create_task(
            _drain_log(self.proc.stderr, self._reloaded, self.route_problems, self._store_write_failed)
        )
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

    def _store_write_failed(self, problem: str) -> None:
        self.store_failed = problem
        self.store_failed_event.set()

    async def recycle(self, timeout_s: float = 15.0) -> None:
        """Stop the server and start it again on the same port and store, keeping the store lock.

        nats-server keeps a stream whose store failed a write (a full disk) failed, freed disk or
        not, until it loads the stream again at its next start.
        """

        async def again() -> None:
            await _terminate(self.proc, timeout_s)
            self.store_failed = ""
            self.store_failed_event.clear()
            await self.restart(timeout_s)

        self.recycling = asyncio.ensure_future(again())
        try:
            await self.recycling
        finally:
            self.recycling = None

    async def restart(self, timeout_s: float = 15.0) -> None:
        """Start the server again after it died: same port (clients reconnect by themselves), same store."""
        await self._release_process()
        await self.start(timeout_s)

    def _conf(self) -> str:
        assert self.credentials is not None
        port = self.port if self.port else -1
        return (
            (
                f"host: {_quote(self.host)}\nport: {port}\n"
                f"max_payload: {MAX_PAYLOAD}\n"
                f"jetstream {{ store_dir: {_quote(str(self.store_dir.resolve()))} }}\n" + self._cluster_conf()
            )
            + self.credentials.accounts(self.nodes)
            + f"# reload {self._reloads}\n"
        )

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
        # Twice: nats-server 2.15 reloads a new account's service imports of the edge account's
        # JetStream (a node's pulls, acks, catalog get) without effect on the reload that adds it,
        # and with it on the next (tests/test_nats_accounts.py). The counter in the file makes
        # the second a change too.
        for _ in range(2):
            self._reloads += 1
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
        await _terminate(proc, timeout_s)
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


def _move_global_account(store: Path, *, clustered: bool) -> None:
    """Move what an iop before node accounts stored in NATS's global account (`$G`) to the edge's.

    A single server keeps a stream's files under its account's directory and nothing else names
    the account, so the move is a rename. A cluster's meta layer records each stream's account:
    its members cannot move it, and say so instead of starting without the stored state.
    """
    old, new = store / "$G", store / auth.EDGE_ACCOUNT
    if not old.is_dir():
        return
    if clustered or new.exists():
        where = "this cluster member's" if clustered else "the"
        raise BusError(
            f"edge.nats.store_dir: {where} store {store} holds JetStream data in NATS's global account ($G), "
            f"written by an iop from before nodes had NATS accounts of their own; "
            + (
                "a cluster cannot move it in place (docs/scale-out.md, 'Upgrading a cluster made before node accounts')"
                if clustered
                else f"{new} exists too: keep one of the two and remove the other"
            )
        )
    old.rename(new)
    log.warning("moved the JetStream store %s to %s (the edge's NATS account)", old, new)


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


AUTH_ERROR_EVERY_S = 60.0
"""The server's "authentication error" for one user is passed on once in this long (a removed node retries)."""


async def _drain_log(
    stderr: asyncio.StreamReader,
    reloaded: asyncio.Event,
    route_problems: list[str],
    store_failed: Callable[[str], None],
) -> None:
    # Keep reading so the pipe never fills and blocks the server; surface warnings and errors.
    said: dict[str, float] = {}
    while line := await stderr.readline():
        if b"Reloaded server configuration" in line:
            reloaded.set()
        elif b"critical write error" in line:
            text = line.decode(errors="replace").strip()
            store_failed(text.split("[ERR] ", 1)[-1])
            log.warning("nats-server: %s", text)
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


async def _terminate(proc: asyncio.subprocess.Process | None, timeout_s: float) -> None:
    """SIGTERM a running server, wait up to `timeout_s`, then SIGKILL it and wait."""
    if proc is None or proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    try:
        async with asyncio.timeout(timeout_s):
            await proc.wait()
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
