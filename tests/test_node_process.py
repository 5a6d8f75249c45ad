"""`iop node` as a process: it stops at once on SIGTERM in every state, and hears when the edge refuses it.

Figures are printed (`pytest -s`) and recorded in docs/reliability.md.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from pathlib import Path

import pytest

from iop.bus import EmbeddedNats
from iop.node.catalog import differences
from tests.harness import IopProcess, deployment, iop_process, node_process, running_edge, running_node

MOCK_NODE = """
models:
  - {alias: sim, pool: [p1]}
nodes:
  - id: n1
    adapters:
      - {id: m, type: mock, latency_ms: 0, tokens: 3}
    providers:
      - {id: p1, adapter: m, capacity: 1}
"""

STOP_BOUND_S = 3.0
"""What the tests accept for "stops within a second" on a machine others load too (the figure is printed)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def sigterm_exit_s(p: IopProcess) -> float:
    """SIGTERM the process and return how long it took to exit by itself (fails past STOP_BOUND_S)."""
    t0 = time.monotonic()
    os.kill(p.pid, signal.SIGTERM)
    rc = await p.exit_code(timeout_s=STOP_BOUND_S)
    took = time.monotonic() - t0
    assert rc == 0, p.lines
    assert not any("Traceback" in line for line in p.lines), p.lines
    return took


async def test_node_waiting_for_nats_stops_on_sigterm(tmp_path: Path) -> None:
    cfg = tmp_path / "iop.yaml"
    cfg.write_text(MOCK_NODE)
    nowhere = f"nats://127.0.0.1:{free_port()}"
    async with iop_process("node", "--config", str(cfg), "--node", "n1", "--nats", nowhere) as p:
        await p.wait_line("waiting for NATS")
        took = await sigterm_exit_s(p)
    print(f"\nwaiting for NATS: exited {took:.2f}s after SIGTERM")


async def test_node_waiting_for_its_catalog_stops_on_sigterm(nats_server: EmbeddedNats) -> None:
    # No --config and no edge: the node waits for the edge to publish its catalog.
    async with iop_process("node", "--node", "n1", "--nats", nats_server.url) as p:
        await p.wait_line("waiting for the edge to publish its catalog")
        took = await sigterm_exit_s(p)
    print(f"\nwaiting for its catalog: exited {took:.2f}s after SIGTERM")


async def test_node_refused_at_hello_stops_on_sigterm(nats_server: EmbeddedNats, tmp_path: Path) -> None:
    # The edge does not know n1: the node retries its hello (for a predecessor to be declared lost).
    cfg = tmp_path / "iop.yaml"
    cfg.write_text(MOCK_NODE)
    other = deployment(MOCK_NODE.replace("id: n1", "id: n2"))
    async with running_edge(other, nats_server.url) as h:
        args = ("node", "--config", str(cfg), "--node", "n1", "--nats", nats_server.url, "-v")
        async with iop_process(*args) as p:
            await p.wait_line("refused")
            took = await sigterm_exit_s(p)
        assert not h.edge.registry.connected("n2")
    print(f"\nrefused at hello: exited {took:.2f}s after SIGTERM")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
async def test_node_serving_stops_on_a_signal(nats_server: EmbeddedNats, tmp_path: Path, sig: int) -> None:
    cfg = tmp_path / "iop.yaml"
    cfg.write_text(MOCK_NODE)
    async with running_edge(deployment(MOCK_NODE), nats_server.url) as h, node_process(cfg, "n1", nats_server.url) as p:
        await h.edge.registry.wait_connected(["n1"], timeout_s=10)
        t0 = time.monotonic()
        os.kill(p.pid, sig)
        assert await p.exit_code(timeout_s=STOP_BOUND_S) == 0, p.lines
        took = time.monotonic() - t0
    print(f"\nserving, idle: exited {took:.2f}s after {signal.Signals(sig).name}")


async def test_node_says_how_the_edges_catalog_differs_from_its_file(
    nats_server: EmbeddedNats, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="iop.node")
    local = deployment(MOCK_NODE)
    at_edge = deployment(MOCK_NODE.replace("capacity: 1", "capacity: 2").replace("tokens: 3", "tokens: 5"))
    async with running_edge(at_edge, nats_server.url) as h, running_node(local, "n1", nats_server.url) as node:
        await h.edge.registry.wait_connected(["n1"], timeout_s=10)
        assert node.node == at_edge.node("n1")  # it follows the edge
    said = [r.getMessage() for r in caplog.records if "differs from the local file" in r.getMessage()]
    assert len(said) == 1, said
    assert "capacity n1/p1: 1 → 2" in said[0], said
    assert "adapter_changed n1/m" in said[0] and '"tokens":3' in said[0] and '"tokens":5' in said[0], said
    print("\n" + said[0])
    # Legacy concurrency, which never changes admission, is named too.
    legacy = deployment(MOCK_NODE.replace("id: n1", "id: n1\n    concurrency: 4")).node("n1")
    assert differences(local.node("n1"), legacy).endswith("→ 4")
