"""What tests share: edges and nodes in the test's event loop or as `python -m iop` processes, waiting on
conditions, broker checks, SSE parsing, throwaway certificates and the zipapp build.

Tests import helpers from here (fake upstreams from tests/fakes.py, fixtures from tests/conftest.py),
never from one another.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import random
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
from nats.js import JetStreamContext
from openai._streaming import ServerSentEvent, SSEDecoder
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

try:
    import httpx2  # the openai SDK's HTTP client since 3.0
except ImportError:  # older SDKs use httpx
    import httpx as httpx2  # type: ignore[no-redef]

from iop import config, wire
from iop.client import EdgeClient
from iop.contracts.status import Status
from iop.edge.http import bind
from iop.edge.keys import EdgeKeys
from iop.edge.process import http_server
from iop.edge.root import Edge
from iop.nats import connection
from iop.nats.access import NatsAccess
from iop.nats.server import EmbeddedNats
from iop.node.runtime import NodeRuntime

REPO = Path(__file__).resolve().parents[1]

# --- waiting ----------------------------------------------------------------------------------


async def until(predicate: Callable[[], bool], changed: asyncio.Event, timeout_s: float = 10.0) -> None:
    """Wait until `predicate()` holds, re-checking each time `changed` is set."""
    async with asyncio.timeout(timeout_s):
        while not predicate():
            changed.clear()
            await changed.wait()


async def eventually(check: Callable[[], Awaitable[bool]], timeout_s: float = 10.0, every_s: float = 0.02) -> float:
    """Poll a condition held by another process (the broker, the OS) until it holds; seconds it took."""
    t0 = time.monotonic()
    for _ in range(int(timeout_s / every_s) + 1):
        if await check():
            return time.monotonic() - t0
        await asyncio.sleep(every_s)  # the condition lives elsewhere: nothing here can signal it
    raise AssertionError(f"condition not met within {timeout_s}s")


# --- edges and nodes in the test's event loop -------------------------------------------------


def deployment(text: str) -> config.Deployment:
    return config.parse(text).deployment


@dataclass
class EdgeHandle:
    url: str
    edge: Edge
    clients: list[openai.AsyncOpenAI] = field(default_factory=list)
    """Handed out by `client()`, closed when the edge stops: their pooled connections must not outlive the loop."""

    def client(self, api_key: str = "test", timeout: float | None = None) -> openai.AsyncOpenAI:
        """An openai SDK client of this edge, without retries; closed with the edge."""
        timeout_or_default = openai.NOT_GIVEN if timeout is None else timeout
        client = openai.AsyncOpenAI(
            base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=timeout_or_default
        )
        self.clients.append(client)
        return client

    def http(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, timeout=30)

    async def status(self) -> Status:
        """GET /status, decoded the way `iop status` and smoke decode it."""
        async with EdgeClient(self.url) as edge:
            return await edge.status()


@asynccontextmanager
async def running_edge(
    dep: config.Deployment, nats_url: str, keys: EdgeKeys | None = None
) -> AsyncIterator[EdgeHandle]:
    """An edge served the way `iop edge` serves it: its uvicorn server with iop's HTTP protocol and limits
    (`http_server`) on a socket from `iop.edge.http.bind`, so tests exercise the stack that ships."""
    nc = await connection.connect(nats_url, "test-edge", wait_s=5)
    edge = Edge(dep, nc, nats_url=nats_url, keys=keys)
    await edge.start()
    sock = bind("127.0.0.1:0")
    server = http_server(edge, grace_s=1)
    serve = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        # The socket listens already: clients may connect at once, the kernel queues them.
        handle = EdgeHandle(f"http://127.0.0.1:{sock.getsockname()[1]}", edge)
        try:
            yield handle
        finally:
            for client in handle.clients:
                await client.close()
    finally:
        # The order `run_edge` stops in: open streams end first, so the graceful shutdown is quick.
        edge.end_streams()
        server.should_exit = True
        await serve
        sock.close()
        await edge.stop()
        await nc.close()


@asynccontextmanager
async def running_node(
    dep: config.Deployment, node_id: str, nats_url: str, access: NatsAccess | None = None
) -> AsyncIterator[NodeRuntime]:
    """A node in the test's loop; `access`: its own NATS user (least privilege) instead of the URL's."""
    node = NodeRuntime(dep, node_id, nats_url, access=access)
    await node.start(connect_wait_s=5)
    try:
        yield node
    finally:
        await node.stop(grace_s=2)


@asynccontextmanager
async def two_edges(
    dep: config.Deployment, nats_url: str, node: str = "n"
) -> AsyncIterator[tuple[EdgeHandle, EdgeHandle, httpx.AsyncClient, httpx.AsyncClient]]:
    """Two edges of one deployment on one NATS, and its node `node` connected to both (scale-out tests)."""
    async with (
        running_edge(dep, nats_url) as e1,
        running_edge(dep, nats_url) as e2,
        running_node(dep, node, nats_url),
        e1.http() as http1,
        e2.http() as http2,
    ):
        for h in (e1, e2):
            await h.edge.registry.wait_connected([node], timeout_s=10)
        yield e1, e2, http1, http2


@asynccontextmanager
async def deployment_running(
    dep: config.Deployment, nats_url: str, keys: EdgeKeys | None = None
) -> AsyncIterator[EdgeHandle]:
    """An edge plus every node of the deployment, returned once the edge sees all nodes connected."""
    async with running_edge(dep, nats_url, keys) as handle:
        nodes = [running_node(dep, n.id, nats_url) for n in dep.nodes]
        entered = []
        try:
            for cm in nodes:
                await cm.__aenter__()
                entered.append(cm)
            await handle.edge.registry.wait_connected([n.id for n in dep.nodes], timeout_s=10)
            yield handle
        finally:
            for cm in reversed(entered):
                await cm.__aexit__(None, None, None)


# --- `python -m iop` as child processes -------------------------------------------------------


def _die_with_parent() -> None:
    # A child must not outlive a test run that was itself killed.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class IopProcess:
    """`python -m iop …` as a child of the test; its stdout and stderr are collected line by line as they come."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self.lines: list[str] = []  # both streams, in the order they were read
        self._changed = asyncio.Event()
        self._readers = [
            asyncio.create_task(self._read(proc.stdout, self.stdout)),
            asyncio.create_task(self._read(proc.stderr, self.stderr)),
        ]

    @property
    def pid(self) -> int:
        return self.proc.pid

    async def _read(self, stream: asyncio.StreamReader | None, into: list[str]) -> None:
        assert stream is not None
        while line := await stream.readline():
            text = line.decode(errors="replace").rstrip()
            into.append(text)
            self.lines.append(text)
            self._changed.set()
        self._changed.set()

    async def wait_line(self, pattern: str, timeout_s: float = 15.0) -> re.Match[str]:
        """The first line of stdout or stderr matching `pattern`; fails if the process ends without one."""
        rx = re.compile(pattern)
        seen = 0
        async with asyncio.timeout(timeout_s):
            while True:
                for line in self.lines[seen:]:
                    if m := rx.search(line):
                        return m
                seen = len(self.lines)
                if all(r.done() for r in self._readers):
                    tail = "\n".join(self.lines[-30:])
                    ended = f"process ended ({self.proc.returncode}) without printing {pattern!r}"
                    raise AssertionError(f"{ended}:\n{tail}")
                self._changed.clear()
                await self._changed.wait()

    async def exit_code(self, timeout_s: float = 15.0) -> int:
        """Wait for the process to exit by itself and for its output to be read."""
        async with asyncio.timeout(timeout_s):
            rc = await self.proc.wait()
            await asyncio.gather(*self._readers)
        return rc

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)

    async def stop(self, grace_s: float) -> None:
        """SIGTERM and up to `grace_s` to exit (0: SIGKILL at once), then SIGKILL; then its output is read."""
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGTERM if grace_s > 0 else signal.SIGKILL)
            try:
                async with asyncio.timeout(grace_s):
                    await self.proc.wait()
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.kill()
                await self.proc.wait()
        with contextlib.suppress(asyncio.CancelledError, TimeoutError):
            await asyncio.wait_for(asyncio.gather(*self._readers), 5)


@asynccontextmanager
async def iop_process(
    *args: str,
    cwd: Path = REPO,
    env: Mapping[str, str] | None = None,
    stop_grace_s: float = 15.0,
    max_open_files: int | None = None,
) -> AsyncIterator[IopProcess]:
    """Run `python -m iop ARGS` from this checkout; stopped on exit (see `IopProcess.stop`).

    `max_open_files`: the child's open-files limit, soft and hard (so it cannot raise it)."""

    def prepare() -> None:
        _die_with_parent()
        if max_open_files is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (max_open_files, max_open_files))

    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "iop",
        *args,
        cwd=cwd,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO), **(env or {})},
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        preexec_fn=prepare,
    )
    child = IopProcess(proc)
    try:
        yield child
    finally:
        await child.stop(stop_grace_s)


@asynccontextmanager
async def node_process(config_file: Path, node_id: str, nats_url: str) -> AsyncIterator[IopProcess]:
    """A node as its own process, returned once it says it serves; SIGKILLed on exit."""
    args = ("node", "--config", str(config_file), "--node", node_id, "--nats", nats_url)
    async with iop_process(*args, stop_grace_s=0) as p:
        await p.wait_line(rf"iop node {node_id} serving")
        yield p


@asynccontextmanager
async def edge_process(
    config_file: Path, nats_url: str, env: Mapping[str, str] | None = None
) -> AsyncIterator[tuple[IopProcess, str]]:
    """An edge as its own process on a free port; yields it and its base URL; SIGKILLed on exit."""
    args = ("edge", "--config", str(config_file), "--listen", "127.0.0.1:0", "--nats", nats_url)
    async with iop_process(*args, env=env, stop_grace_s=0) as p:
        m = await p.wait_line(r"iop edge listening on (http://\S+)")
        yield p, m.group(1)


def free_port() -> int:
    """A loopback port free now, for a process that must be told its port before it starts."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_to_reuse() -> int:
    """A loopback port free now and below the kernel's ephemeral range, for a server a test stops
    and starts again on the same port: no port the OS hands out (port 0, a client's own end) falls
    there, so another worker's process cannot take it in between, as one took a `free_port()`."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    for _ in range(200):
        port = random.randrange(10_000, max(10_001, low))
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    return free_port()


def pid_gone(pid: int) -> bool:
    """True when the process has exited (a zombie waiting to be reaped counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


async def wait_gone(pid: int, timeout_s: float = 5.0) -> None:
    """Wait for a process that is not our child to exit, on its pidfd (readable once it exits)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def exited() -> None:
        if not done.done():
            done.set_result(None)

    loop.add_reader(fd, exited)
    try:
        async with asyncio.timeout(timeout_s):
            await done
    finally:
        loop.remove_reader(fd)
        os.close(fd)


# --- a connection to NATS that a test can cut -------------------------------------------------


class NatsCut:
    """A loopback TCP relay in front of a nats-server, for one client to connect through.

    `cut()` closes every connection through it (the server drops that client and its
    subscriptions at once; messages for it are then lost, as when its server dies) and turns
    new connections away until `heal()`. The client reconnects by itself, as it would to
    another server of a cluster. NATS itself is real: only the network between is cut.
    """

    def __init__(self, server: EmbeddedNats) -> None:
        self.server = server
        self.is_open = True
        self.cuts = 0
        self._conns: set[asyncio.StreamWriter] = set()
        self._sock = self._listening(0)
        self._port: int = self._sock.getsockname()[1]
        self._listener: asyncio.Server | None = None
        self._serving: set[asyncio.Task[asyncio.Server]] = set()
        self.connected = asyncio.Event()
        """Set each time a client connection is relayed to the server (cleared by `cut`)."""

    @property
    def url(self) -> str:
        """The server's URL (with the edge's credential) through this relay."""
        access = self.server.access
        return f"nats://{access.user}:{access.password}@127.0.0.1:{self._port}"

    async def __aenter__(self) -> NatsCut:
        self._listener = await asyncio.start_server(self._relay, sock=self._sock)
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in self._serving:
            self._listener = await task
        self.cut()

    @staticmethod
    def _listening(port: int) -> socket.socket:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen(64)
        return sock

    def cut(self) -> None:
        # Nothing listens while cut, so a reconnecting client is refused, as by a dead server. (A
        # connection accepted and closed at once would leave nats-py a half-closed stream it
        # replaces without closing: an unclosed StreamWriter, not what a lost server does.)
        self.is_open = False
        self.cuts += 1
        self.connected.clear()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        for w in list(self._conns):
            w.transport.abort()
        self._conns.clear()

    def heal(self) -> None:
        self.is_open = True
        sock = self._listening(self._port)
        task = asyncio.get_running_loop().create_task(asyncio.start_server(self._relay, sock=sock))
        self._serving.add(task)

        def served(done: asyncio.Task[asyncio.Server]) -> None:
            self._serving.discard(done)
            if not done.cancelled() and done.exception() is None:
                self._listener = done.result()
                if not self.is_open:  # cut again before it was serving
                    self._listener.close()
                    self._listener = None

        task.add_done_callback(served)

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self.is_open:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(self.server.host, self.server.port)
        except OSError:
            writer.transport.abort()
            return
        self._conns |= {writer, up_writer}
        self.connected.set()

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass  # cut, or closed by the other side: both sides are closed below
            finally:
                for w in (writer, up_writer):
                    w.transport.abort()
                    self._conns.discard(w)

        await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))


# --- the broker's view ------------------------------------------------------------------------


async def broker_counts(js: JetStreamContext, provider: str) -> tuple[int, int]:
    """(ack pending, pending) of a provider's consumer: running and not yet fetched."""
    info = await js.consumer_info(wire.WORK_STREAM, wire.consumer_name(provider))
    return info.num_ack_pending, info.num_pending


async def stream_messages(js: JetStreamContext) -> int:
    return (await js.stream_info(wire.WORK_STREAM)).state.messages


# --- what a client reads ----------------------------------------------------------------------

RESPONSE_EVENT: TypeAdapter[ResponseStreamEvent] = TypeAdapter(ResponseStreamEvent)
# Codes the real API sends and Codex acts on, missing from the SDK's ResponseError.code Literal.
CODES_BEYOND_SDK = {"context_length_exceeded", "insufficient_quota"}


def sse_events(text: str) -> list[dict[str, Any]]:
    """The JSON `data:` payloads of an SSE stream (without `[DONE]`): JSON as the client reads it."""
    out = []
    for line in text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    return out


def sse(data: bytes) -> list[ServerSentEvent]:
    """The events a client reads from `data`, decoded by the openai SDK's own SSE decoder."""
    return list(SSEDecoder().iter_bytes(iter([data])))


def responses_events(data: bytes) -> list[Any]:
    """Every SSE event validated as the SDK's typed Responses stream event; sequence numbers 0, 1, 2, …"""
    events = []
    for n, event in enumerate(sse(data)):
        body = json.loads(event.data)
        assert event.event == body["type"]
        error = (body.get("response") or {}).get("error") or {}
        if body["type"] == "response.failed" and error.get("code") in CODES_BEYOND_SDK:
            error["code"] = "server_error"
        typed = RESPONSE_EVENT.validate_python(body)
        assert typed.sequence_number == n
        events.append(typed)
    return events


def sdk_client(body: bytes, content_type: str) -> openai.OpenAI:
    """An openai client whose every request is answered with `body`, offline."""

    def answer(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(200, headers={"content-type": content_type}, content=body)

    http = httpx2.Client(transport=httpx2.MockTransport(answer))
    return openai.OpenAI(api_key="test", base_url="http://iop.test/v1", http_client=http, max_retries=0)


# --- throwaway certificates -------------------------------------------------------------------


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


def _ec_key_args(name: str) -> list[str]:
    return ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", f"{name}.key"]


def _make_ca(d: Path, name: str) -> None:
    subject = ["-subj", f"/CN={name}", "-addext", "keyUsage=critical,keyCertSign,cRLSign"]
    _openssl("req", "-x509", *_ec_key_args(name), "-out", f"{name}.pem", "-days", "1", *subject, cwd=d)


def _make_cert(d: Path, ca: str, name: str, usage: str) -> None:
    _openssl("req", *_ec_key_args(name), "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
    (d / f"{name}.ext").write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
        f"extendedKeyUsage={usage}\n"
        "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid,issuer\n"
    )
    signing = ["-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial"]
    output = ["-out", f"{name}.pem", "-days", "1", "-extfile", f"{name}.ext"]
    _openssl("x509", "-req", "-in", f"{name}.csr", *signing, *output, cwd=d)


def make_pki(d: Path) -> Path:
    """In `d`, made by the openssl CLI: a throwaway CA (`ca.pem`) with a server certificate for 127.0.0.1 and
    localhost (`server.pem`/`.key`) and a client certificate (`client.pem`/`.key`), and a second CA that
    signed neither (`other-ca.pem`). Returns `d`."""
    _make_ca(d, "ca")
    _make_ca(d, "other-ca")
    _make_cert(d, "ca", "server", "serverAuth")
    _make_cert(d, "ca", "client", "clientAuth")
    return d


def have_openssl() -> bool:
    return shutil.which("openssl") is not None


# --- the zipapp -------------------------------------------------------------------------------


def snapshot_sources(dest: Path) -> Path:
    """A copy of what build.py reads: colleagues edit iop/ while tests run, and two builds from one
    copy must be comparable."""
    dest.mkdir()
    shutil.copy2(REPO / "build.py", dest / "build.py")
    shutil.copy2(REPO / "build-requirements.txt", dest / "build-requirements.txt")
    shutil.copytree(REPO / "iop", dest / "iop", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dest


def build_archive(sources: Path, out: Path, platform: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run `build.py --out OUT` (for `--platform PLATFORM`) from `sources`; fails the test if the build fails."""
    # The shared dependency cache under the repo's build/ is what keeps this quick after the first run.
    command = [sys.executable, str(sources / "build.py"), "--out", str(out), "--build-dir", str(REPO / "build")]
    if platform is not None:
        command += ["--platform", platform]
    done = subprocess.run(command, capture_output=True, text=True, timeout=540, check=False)
    assert done.returncode == 0, done.stderr
    return done


# The interpreter behind the test venv: it has none of iop's dependencies on its path when run with -S.
BARE_PYTHON = getattr(sys, "_base_executable", sys.executable)


def clean_env(cache: Path, home: Path) -> dict[str, str]:
    """An environment without the test venv: PATH without its bin, its own HOME and IOP_CACHE_DIR."""
    venv_bin = str(Path(sys.executable).parent)
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep) if p and p != venv_bin)
    return {"PATH": path, "HOME": str(home), "IOP_CACHE_DIR": str(cache), "LANG": "C.UTF-8"}


def run_pyz(
    pyz: Path, args: list[str], cache: Path, cwd: Path, *, bare: bool = True
) -> subprocess.CompletedProcess[str]:
    """`python iop.pyz ARGS` in `cwd` with a clean environment; `bare` runs it with -S, so anything
    missing from the archive fails instead of being found in site-packages."""
    flags = ["-S"] if bare else []
    return subprocess.run(
        [BARE_PYTHON, *flags, str(pyz), *args],
        cwd=cwd,
        env=clean_env(cache, cwd),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def one_provider_yaml(url: str) -> str:
    """A deployment of one node with one provider `p` (capacity 1) on the upstream at `url`, alias `m`."""
    return f"""
edge:
  queue: {{timeout_s: 30, max_waiting: 100}}
models: [{{alias: m, pool: [p]}}]
nodes:
  - id: n
    adapters: [{{id: up, type: openai, base_url: "{url}", api: both}}]
    providers: [{{id: p, adapter: up, capacity: 1}}]
"""


# Codex CLI's settings that keep it offline but for the edge (tests/test_codex_cli.py, test_clients_doc.py):
# top-level keys first, then the tables, as TOML requires.
CODEX_OFFLINE_TOP = "check_for_update_on_startup = false\n"
CODEX_OFFLINE_TABLES = """
[analytics]
enabled = false

[features]
plugins = false
remote_plugin = false
apps = false
skill_search = false
tool_suggest = false
skill_mcp_dependency_install = false
"""


@asynccontextmanager
async def nats_server_of(conf: Path) -> AsyncIterator[int]:
    """A bare nats-server started here with the config file `conf`, not iop's: yields its client
    port once it says it is ready; stopped (SIGTERM, then SIGKILL) by its PID at the end."""
    from iop.nats.bundle import nats_server_path

    proc = await asyncio.create_subprocess_exec(
        nats_server_path(),
        "-c",
        str(conf),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stderr is not None
    drain: asyncio.Task[bytes] | None = None
    try:
        port, seen = 0, b""
        async with asyncio.timeout(15):
            while b"Server is ready" not in (line := await proc.stderr.readline()):
                assert line, f"nats-server exited during start-up: {seen.decode(errors='replace')}"
                seen += line
                if m := re.search(rb"Listening for client connections on \S+:(\d+)", line):
                    port = int(m.group(1))
        drain = asyncio.create_task(proc.stderr.read())
        yield port
    finally:
        if proc.returncode is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                async with asyncio.timeout(10):
                    await proc.wait()
            except TimeoutError:
                os.kill(proc.pid, signal.SIGKILL)
                await proc.wait()
        if drain is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(drain, 5)
