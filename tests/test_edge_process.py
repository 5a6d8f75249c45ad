"""iop edge and iop node as an operator runs them (processes): start-up failures, warnings, NATS dying."""

from __future__ import annotations

import asyncio
import errno
import os
import re
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from tests.harness import IopProcess, eventually, iop_process

DEPLOYMENT = """
edge:
  listen: {listen}
  nats: {{listen: "127.0.0.1:0", store_dir: {store}}}
models: [{{alias: sim, pool: [sim-1]}}]
nodes:
  - id: n1
    adapters: [{{id: sim, type: mock, latency_ms: 0, tokens: 2, token_interval_ms: 0}}]
    providers: [{{id: sim-1, adapter: sim, capacity: 2}}]
"""

READY = re.compile(r"embedded nats-server \(pid (\d+)\) ready")
GOOD = {"model": "sim", "messages": [{"role": "user", "content": "hi"}]}


def write_deployment(tmp_path: Path, listen: str = "127.0.0.1:0") -> tuple[Path, Path]:
    store = tmp_path / "store"
    path = tmp_path / "deployment.yaml"
    path.write_text(DEPLOYMENT.format(listen=listen, store=store))
    return path, store


async def nats_pids(edge: IopProcess, count: int) -> list[int]:
    """The pids of the embedded nats-servers the edge has started, once it has started `count`."""

    def pids() -> list[int]:
        return [int(m.group(1)) for line in edge.lines if (m := READY.search(line))]

    async def enough() -> bool:
        return len(pids()) >= count

    await eventually(enough, timeout_s=20)
    return pids()


async def test_edge_on_a_busy_port_says_so_in_one_line_before_starting_anything(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        path, store = write_deployment(tmp_path, f"127.0.0.1:{port}")
        async with iop_process("edge", "--config", str(path), cwd=tmp_path) as edge:
            assert await edge.exit_code() != 0
    assert edge.stderr == [f"iop: edge.listen: cannot listen on 127.0.0.1:{port}: Address already in use"]
    assert not store.exists()  # NATS was never started


async def test_edge_restarts_its_dead_nats_then_gives_up_and_exits_non_zero(tmp_path: Path) -> None:
    path, _ = write_deployment(tmp_path)
    async with iop_process("edge", "--config", str(path), cwd=tmp_path) as edge:
        url = (await edge.wait_line(r"iop edge listening on (http://\S+)")).group(1)
        nats_url = (await edge.wait_line(r"nats=(\S+)")).group(1)
        nats_pid = (await nats_pids(edge, 1))[0]
        async with (
            iop_process("node", "--config", str(path), "--node", "n1", "--nats", nats_url, cwd=tmp_path) as node,
            httpx.AsyncClient(base_url=url, timeout=10) as http,
        ):
            await node.wait_line("iop node n1 serving")
            assert (await http.post("/v1/chat/completions", json=GOOD)).status_code == 200

            os.kill(nats_pid, signal.SIGKILL)
            await edge.wait_line(r"embedded nats-server exited \(status -9\); restarting")
            pids = await nats_pids(edge, 2)

            async def served() -> bool:
                health = await http.get("/healthz")
                if health.status_code != 200:
                    assert health.json()["ok"] is False  # says why while NATS is away
                    return False
                return (await http.post("/v1/chat/completions", json=GOOD)).status_code == 200

            took = await eventually(served, timeout_s=20, every_s=0.1)
            print(f"\nserved again {took:.2f}s after the embedded nats-server was restarted")

            # Three more deaths within the minute: the edge stops, non-zero, with one line saying why.
            for n in (3, 4, 5):
                os.kill(pids[-1], signal.SIGKILL)
                if n < 5:
                    pids = await nats_pids(edge, n)
            assert await edge.exit_code(timeout_s=30) != 0
    assert edge.stderr[-1].startswith("iop: the embedded nats-server exited 4 times within 60s"), edge.stderr[-3:]


async def test_edge_with_an_unusable_store_dir_names_the_path(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    store = tmp_path / "a-file" / "store"  # cannot exist: its parent is a file (root ignores mode bits)
    path = tmp_path / "deployment.yaml"
    path.write_text(DEPLOYMENT.format(listen="127.0.0.1:0", store=store))
    async with iop_process("edge", "--config", str(path), cwd=tmp_path) as edge:
        assert await edge.exit_code() != 0
    assert edge.stderr == [f"iop: store_dir {store}: Not a directory"]


async def test_edge_on_a_store_too_small_for_the_ledger_says_so_and_how_to_set_it(
    tmp_path: Path, small_disk: Callable[[str], Path]
) -> None:
    store = small_disk("1200m") / "nats"  # room for JetStream, less than the ledger's 1 GiB reservation
    path = tmp_path / "deployment.yaml"
    path.write_text(DEPLOYMENT.format(listen="127.0.0.1:0", store=store))
    async with iop_process("edge", "--config", str(path), "--listen", "127.0.0.1:0", cwd=tmp_path) as edge:
        assert await edge.exit_code(30) != 0
    (line,) = [line for line in edge.stderr if line.startswith("iop: ")]
    # Before: "cannot keep 1 replicas ...; edge.nats.replicas must not exceed the number of servers".
    assert "replicas" not in line, line
    assert "stream IOP_LEDGER" in line and "1.0 GiB (edge.ledger.max_bytes)" in line, line
    assert "lower edge.ledger.max_bytes" in line and "edge.ledger.enabled: false" in line, line
    assert not any("Traceback" in line for line in edge.stderr), edge.stderr


def fill(disk: Path) -> Path:
    """Write zeros to `disk` until it has no space left; the file that filled it."""
    filler = disk / "filler"
    chunk = b"\0" * (1024 * 1024)
    with filler.open("wb") as f:
        while True:
            try:
                f.write(chunk)
                f.flush()
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
                return filler


async def test_a_full_disk_fails_pool_requests_and_health_and_both_recover_once_space_returns(
    tmp_path: Path, small_disk: Callable[[str], Path]
) -> None:
    store = small_disk("64m") / "nats"
    path = tmp_path / "deployment.yaml"
    text = DEPLOYMENT.format(listen="127.0.0.1:0", store=store)
    path.write_text(
        text.replace(
            "edge:\n", "edge:\n  queue: {timeout_s: 2}\n  ledger: {enabled: false}\n  responses: {enabled: false}\n", 1
        )
    )
    async with iop_process("edge", "--config", str(path), cwd=tmp_path) as edge:
        url = (await edge.wait_line(r"iop edge listening on (http://\S+)")).group(1)
        nats_url = (await edge.wait_line(r"nats=(\S+)")).group(1)
        async with (
            iop_process("node", "--config", str(path), "--node", "n1", "--nats", nats_url, cwd=tmp_path) as node,
            httpx.AsyncClient(base_url=url, timeout=30) as http,
        ):
            await node.wait_line("iop node n1 serving")
            assert (await http.post("/v1/chat/completions", json=GOOD)).status_code == 200
            filler = fill(store.parent)
            big = {**GOOD, "messages": [{"role": "user", "content": "x" * 65536}]}

            async def refused() -> bool:
                return (await http.post("/v1/chat/completions", json=big)).status_code == 503

            await eventually(refused, timeout_s=30, every_s=0.05)
            health = await http.get("/healthz")
            # Before: /healthz said storage was fine every other second while every pool request failed.
            for _ in range(3):
                health = await http.get("/healthz")
                assert health.status_code == 503 and health.json()["storage"] is False, health.text
            filler.unlink()
            freed = time.monotonic()

            async def served() -> bool:
                return (await http.post("/v1/chat/completions", json=GOOD)).status_code == 200

            # Before: 503 for every pool request for 30 s and more, until the edge was restarted.
            await eventually(served, timeout_s=15, every_s=0.1)
            took = time.monotonic() - freed
            assert (await http.get("/healthz")).status_code == 200
            assert any("room again" in line for line in edge.lines), edge.lines[-10:]
    print(f"\nfull disk freed: pool requests served again {took:.2f}s later")
    assert took < 5, took


LEGACY = """
edge:
  nats: {{listen: "127.0.0.1:0", store_dir: {store}}}
models: [{{alias: a, pool: [p]}}, {{alias: b, pool: [q]}}]
nodes:
  - {{id: n, concurrency: 3, adapters: [{{id: m, type: mock}}], providers: [{{id: p, adapter: m, capacity: 1}}]}}
  - id: o
    runtime: {{concurrency: 3}}
    adapters: [{{id: m, type: mock}}]
    providers: [{{id: q, adapter: m, capacity: 1}}]
"""


async def test_each_process_logs_only_its_own_legacy_warnings_with_a_timestamp(tmp_path: Path) -> None:
    path = tmp_path / "deployment.yaml"
    path.write_text(LEGACY.format(store=tmp_path / "store"))
    stamp = r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} WARNING iop.config: "
    async with iop_process("edge", "--config", str(path), "--listen", "127.0.0.1:0", cwd=tmp_path) as edge:
        nats_url = (await edge.wait_line(r"nats=(\S+)")).group(1)
        warned = [line for line in edge.stderr if "legacy setting" in line]
        assert len(warned) == 2 and all(re.match(stamp, line) for line in warned), warned
        async with iop_process("node", "--config", str(path), "--node", "o", "--nats", nats_url, cwd=tmp_path) as node:
            await node.wait_line("iop node o serving")
    warned = [line for line in node.stderr if "legacy setting" in line]
    assert len(warned) == 1 and re.match(stamp + r"nodes\[1\]\.runtime\.concurrency: legacy", warned[0]), warned


async def test_edge_under_a_1024_open_files_limit_answers_newcomers_503_instead_of_resetting_them(
    tmp_path: Path,
) -> None:
    path, _ = write_deployment(tmp_path)
    async with iop_process("edge", "--config", str(path), cwd=tmp_path, max_open_files=1024) as edge:
        m = await edge.wait_line(r"iop edge listening on http://127\.0\.0\.1:(\d+)", timeout_s=30)
        port = int(m.group(1))
        held: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        try:
            # More idle clients than the edge has files: the kernel completes every handshake.
            for _ in range(1100):
                held.append(await asyncio.open_connection("127.0.0.1", port))
            answers = []
            for reader, _ in held[-100:]:
                try:
                    async with asyncio.timeout(5):
                        answers.append((await reader.read()).split(b"\r\n", 1)[0])
                except (ConnectionError, TimeoutError) as exc:
                    answers.append(type(exc).__name__.encode())
            assert set(answers) == {b"HTTP/1.1 503 Service Unavailable"}, answers
            assert any("max_connections 4096 lowered to 896" in line for line in edge.lines), edge.lines[-5:]
        finally:
            for _, writer in held:
                writer.close()
