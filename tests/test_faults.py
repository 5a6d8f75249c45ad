"""Faults with real processes: a node SIGKILLed mid-stream and restarted, an edge restarted.

Also the helpers the other `test_faults_*` files share: `python -m iop` children, broker checks,
and waiting for a process (group) to be gone. Measured figures are printed (`pytest -s`) and
recorded in docs/reliability.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import re
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import nats
from nats.js import JetStreamContext

from iop import wire
from iop.bus import EmbeddedNats
from tests.fakes import fake_upstream
from tests.harness import deployment, running_edge, until

REPO = Path(__file__).resolve().parents[1]


# --- helpers shared by the fault tests --------------------------------------------------------


def _die_with_parent() -> None:
    # A child must not outlive a test run that was itself killed.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class IopProcess:
    """`python -m iop …` as a child of the test, its output collected line by line."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self._new = asyncio.Event()
        self._reader = asyncio.create_task(self._read())

    @property
    def pid(self) -> int:
        return self.proc.pid

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        while line := await self.proc.stdout.readline():
            self.lines.append(line.decode(errors="replace").rstrip())
            self._new.set()
        self._new.set()

    async def wait_line(self, pattern: str, timeout_s: float = 15.0) -> re.Match[str]:
        """The first output line matching `pattern`; fails if the process ends without one."""
        rx = re.compile(pattern)
        seen = 0
        async with asyncio.timeout(timeout_s):
            while True:
                for line in self.lines[seen:]:
                    if m := rx.search(line):
                        return m
                seen = len(self.lines)
                if self._reader.done():
                    tail = "\n".join(self.lines[-30:])
                    raise AssertionError(f"process ended without printing {pattern!r}:\n{tail}")
                self._new.clear()
                await self._new.wait()

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)

    async def stop(self) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
        await self.proc.wait()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(self._reader, 5)


@asynccontextmanager
async def iop_process(*args: str) -> AsyncIterator[IopProcess]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "iop",
        *args,
        cwd=REPO,
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        preexec_fn=_die_with_parent,
    )
    child = IopProcess(proc)
    try:
        yield child
    finally:
        await child.stop()


@asynccontextmanager
async def node_process(config_file: Path, node_id: str, nats_url: str) -> AsyncIterator[IopProcess]:
    """A node as its own process, returned once it says it serves."""
    async with iop_process("node", "--config", str(config_file), "--node", node_id, "--nats", nats_url) as p:
        await p.wait_line(rf"iop node {node_id} serving")
        yield p


@asynccontextmanager
async def edge_process(config_file: Path, nats_url: str) -> AsyncIterator[tuple[IopProcess, str]]:
    """An edge as its own process on a free port; yields it and its base URL."""
    async with iop_process("edge", "--config", str(config_file), "--listen", "127.0.0.1:0", "--nats", nats_url) as p:
        m = await p.wait_line(r"iop edge listening on (http://\S+)")
        yield p, m.group(1)


async def eventually(check: Callable[[], Awaitable[bool]], timeout_s: float = 10.0, every_s: float = 0.02) -> float:
    """Poll a condition held by another process (the broker, the OS) until it holds; seconds it took."""
    t0 = time.monotonic()
    for _ in range(int(timeout_s / every_s) + 1):
        if await check():
            return time.monotonic() - t0
        await asyncio.sleep(every_s)  # the condition lives elsewhere: nothing here can signal it
    raise AssertionError(f"condition not met within {timeout_s}s")


async def broker_counts(js: JetStreamContext, provider: str) -> tuple[int, int]:
    """(ack pending, pending) of a provider's consumer: running and not yet fetched."""
    info = await js.consumer_info(wire.WORK_STREAM, wire.consumer_name(provider))
    return info.num_ack_pending, info.num_pending


async def stream_messages(js: JetStreamContext) -> int:
    return (await js.stream_info(wire.WORK_STREAM)).state.messages


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


def sse_events(text: str) -> list[dict[str, object]]:
    """The JSON `data:` payloads of an SSE stream (without `[DONE]`)."""
    out = []
    for line in text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    return out


# --- node killed mid-stream, node restarted ---------------------------------------------------


def node_yaml(live_url: str, held_url: str) -> str:
    return f"""
edge:
  queue: {{timeout_s: 20, max_waiting: 100}}
models:
  - {{alias: live, pool: [p-live]}}
  - {{alias: held, pool: [p-held]}}
nodes:
  - id: n1
    adapters:
      - {{id: a-live, type: openai, base_url: "{live_url}", api: both}}
      - {{id: a-held, type: openai, base_url: "{held_url}", api: both}}
    providers:
      - {{id: p-live, adapter: a-live, capacity: 1}}
      - {{id: p-held, adapter: a-held, capacity: 1}}
"""


CHAT = {"messages": [{"role": "user", "content": "x"}]}


async def test_node_killed_mid_stream_fails_fast_frees_the_slot_and_restarts(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    held_gate = asyncio.Event()
    async with fake_upstream(tokens=100_000, token_interval_s=0.02) as live, fake_upstream(gate=held_gate) as held:
        text = node_yaml(live.url, held.url)
        cfg = tmp_path / "iop.yaml"
        cfg.write_text(text)
        dep = deployment(text)
        nc = await nats.connect(nats_server.url)
        js = nc.jetstream()
        try:
            async with running_edge(dep, nats_server.url) as h, h.http() as http:
                reg = h.edge.registry
                async with node_process(cfg, "n1", nats_server.url) as node:
                    await reg.wait_connected(["n1"], timeout_s=10)
                    # One stream whose first bytes reached the client, one request that has none yet.
                    body = {"model": "live", "stream": True, **CHAT}
                    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                        assert r.status_code == 200
                        it = r.aiter_text()
                        first = await anext(it)
                        assert first.startswith("data: ")
                        pending = asyncio.create_task(http.post("/v1/chat/completions", json={"model": "held", **CHAT}))
                        await held.wait_for(lambda u: u.in_flight == 1)
                        assert await broker_counts(js, "p-live") == (1, 0)

                        killed = time.monotonic()
                        node.kill()
                        lost = asyncio.create_task(until(lambda: not reg.connected("n1"), reg.changed, 10))
                        rest = "".join([t async for t in it])
                        stream_failed_s = time.monotonic() - killed
                    answer = await pending
                    unanswered_failed_s = time.monotonic() - killed
                    await lost
                    events = sse_events(first + rest)
                    assert events[-1]["error"]["code"] == "node_lost"  # type: ignore[index]
                    assert answer.status_code == 502 and answer.json()["error"]["code"] == "node_lost"

                    async def slots_free() -> bool:
                        counts = [await broker_counts(js, p) for p in ("p-live", "p-held")]
                        return counts == [(0, 0), (0, 0)] and await stream_messages(js) == 0

                    slots_free_s = time.monotonic() - killed + await eventually(slots_free)
                    # The killed node's upstream connection closed with it.
                    await live.wait_for(lambda u: u.disconnects == 1)

                # Restart: it re-announces, binds its consumers, serves; the edge does nothing.
                live.tokens, live.token_interval_s = 3, 0.0
                restarted = time.monotonic()
                async with node_process(cfg, "n1", nats_server.url) as node2:
                    await reg.wait_connected(["n1"], timeout_s=10)
                    connected_s = time.monotonic() - restarted
                    r2 = await http.post("/v1/chat/completions", json={"model": "live", **CHAT})
                    serve_s = time.monotonic() - restarted
                    assert r2.status_code == 200, r2.text
                    # Neither request of the dead node ran again: their messages are gone for good.
                    assert await stream_messages(js) == 0
                    assert (live.total, held.total) == (2, 1)
                    assert await broker_counts(js, "p-held") == (0, 0)

                    # Restarted at once, as a supervisor would: the edge still counts the dead
                    # instance as connected, so the new one is refused, retries, and is let in once
                    # the old one is declared lost.
                    st = reg.nodes["n1"]
                    old_instance = st.instance
                    node2.kill()
                    killed_again = time.monotonic()
                    async with node_process(cfg, "n1", nats_server.url):
                        await until(lambda: st.connected and st.instance not in (None, old_instance), reg.changed)
                        r3 = await http.post("/v1/chat/completions", json={"model": "live", **CHAT})
                        assert r3.status_code == 200, r3.text
                        back_s = time.monotonic() - killed_again
                    assert live.total == 3
        finally:
            held_gate.set()
            await nc.close()
    print(
        f"\nnode SIGKILL: stream error event after {stream_failed_s:.2f}s, 502 after {unanswered_failed_s:.2f}s, "
        f"broker slots free after {slots_free_s:.2f}s; restart: connected after {connected_s:.2f}s, "
        f"served after {serve_s:.2f}s; restarted at once: serving {back_s:.2f}s after the kill"
    )
    assert stream_failed_s < wire.HEARTBEAT_INTERVAL_S * wire.HEARTBEATS_MISSED + 1.0
    assert unanswered_failed_s < wire.HEARTBEAT_INTERVAL_S * wire.HEARTBEATS_MISSED + 1.0
    assert slots_free_s < wire.HEARTBEAT_INTERVAL_S * wire.HEARTBEATS_MISSED + 1.5


async def edge_status(url: str) -> dict[str, object]:
    async with httpx.AsyncClient(base_url=url, timeout=5) as http:
        data: dict[str, object] = (await http.get("/status")).json()
        return data


def node_of(status: dict[str, object], node_id: str) -> dict[str, object]:
    nodes = status["nodes"]
    assert isinstance(nodes, list)
    found: dict[str, object] = next(n for n in nodes if n["id"] == node_id)
    return found


async def test_edge_restart_the_node_serves_the_new_edge_without_restarting(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    async with fake_upstream(tokens=100_000, token_interval_s=0.02) as live, fake_upstream() as held:
        cfg = tmp_path / "iop.yaml"
        cfg.write_text(node_yaml(live.url, held.url))
        nc = await nats.connect(nats_server.url)
        js = nc.jetstream()
        try:
            async with node_process(cfg, "n1", nats_server.url) as node:
                async with edge_process(cfg, nats_server.url) as (edge1, url1):

                    async def seen_by_edge1() -> bool:
                        return bool(node_of(await edge_status(url1), "n1")["connected"])

                    await eventually(seen_by_edge1)
                    instance = node_of(await edge_status(url1), "n1")["instance"]
                    client = httpx.AsyncClient(base_url=url1, timeout=10)
                    try:
                        body = {"model": "live", "stream": True, **CHAT}
                        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                            assert r.status_code == 200
                            await anext(r.aiter_text())
                            killed = time.monotonic()
                            edge1.kill()
                            await edge1.proc.wait()
                    except httpx.HTTPError:
                        pass  # the edge died under the client: its connection breaks, nothing more
                    finally:
                        await client.aclose()
                # The node finds out by itself that nobody reads this answer any more: it stops the
                # upstream call and frees the broker slot, with no edge to tell it.
                await live.wait_for(lambda u: u.disconnects == 1, timeout_s=15)
                abandoned_s = time.monotonic() - killed

                async def slot_free() -> bool:
                    return await broker_counts(js, "p-live") == (0, 0) and await stream_messages(js) == 0

                await eventually(slot_free)
                live.tokens, live.token_interval_s = 3, 0.0
                restarted = time.monotonic()
                async with edge_process(cfg, nats_server.url) as (_, url2), httpx.AsyncClient(base_url=url2) as http:

                    async def seen_by_edge2() -> bool:
                        return bool(node_of(await edge_status(url2), "n1")["connected"])

                    await eventually(seen_by_edge2)
                    r2 = await http.post("/v1/chat/completions", json={"model": "live", **CHAT}, timeout=10)
                    serve_s = time.monotonic() - restarted
                    assert r2.status_code == 200, r2.text
                    # The very same node process and instance, never restarted.
                    assert node_of(await edge_status(url2), "n1")["instance"] == instance
                    assert node.proc.returncode is None
                    assert sum(line.startswith("iop node n1 serving") for line in node.lines) == 1, node.lines
                assert live.total == 2
        finally:
            await nc.close()
    print(
        f"\nedge SIGKILL: node stopped the orphaned request after {abandoned_s:.2f}s; "
        f"new edge served after {serve_s:.2f}s"
    )
    assert abandoned_s < wire.PROBE_INTERVAL_S * 3 + 1


async def test_node_and_edge_killed_together_the_redelivery_never_runs(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    from nats.js import api as js_api

    from iop import bus

    async with fake_upstream(tokens=100_000, token_interval_s=0.02) as live, fake_upstream() as held:
        cfg = tmp_path / "iop.yaml"
        cfg.write_text(node_yaml(live.url, held.url))
        nc = await nats.connect(nats_server.url)
        js = nc.jetstream()
        try:
            # A short ack_wait, so that the broker redelivers within the test; nobody updates it,
            # since the capacity matches what the deployment says.
            await bus.ensure_work_stream(js)
            await js.add_consumer(
                wire.WORK_STREAM,
                js_api.ConsumerConfig(
                    durable_name=wire.consumer_name("p-live"),
                    filter_subject=wire.work_subject("p-live"),
                    ack_policy=js_api.AckPolicy.EXPLICIT,
                    ack_wait=1.0,
                    max_ack_pending=1,
                ),
            )
            async with (
                node_process(cfg, "n1", nats_server.url) as node1,
                edge_process(cfg, nats_server.url) as (
                    edge1,
                    url1,
                ),
            ):

                async def seen() -> bool:
                    return bool(node_of(await edge_status(url1), "n1")["connected"])

                await eventually(seen)
                client = httpx.AsyncClient(base_url=url1, timeout=10)
                try:
                    body = {"model": "live", "stream": True, **CHAT}
                    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                        await anext(r.aiter_text())  # bytes reached the client
                        # Both die at once: no edge is left to terminate the work message.
                        node1.kill()
                        edge1.kill()
                        await asyncio.gather(node1.proc.wait(), edge1.proc.wait())
                except httpx.HTTPError:
                    pass
                finally:
                    await client.aclose()
            assert await broker_counts(js, "p-live") == (1, 0)
            async with (
                edge_process(cfg, nats_server.url) as (_, url2),
                node_process(cfg, "n1", nats_server.url) as node2,
            ):
                # The broker redelivers after ack_wait; the new node asks the dead edge (no responder)
                # and drops it.
                await node2.wait_line(r"redelivered request \w+ dropped")

                async def slot_free() -> bool:
                    return await broker_counts(js, "p-live") == (0, 0) and await stream_messages(js) == 0

                await eventually(slot_free)
                live.tokens, live.token_interval_s = 3, 0.0
                async with httpx.AsyncClient(base_url=url2, timeout=10) as http:
                    r2 = await http.post("/v1/chat/completions", json={"model": "live", **CHAT})
                assert r2.status_code == 200, r2.text
            assert live.total == 2  # the first request once, the new one once
        finally:
            await nc.close()
