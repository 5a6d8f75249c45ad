"""Device facts: what a node tells the edge about its machine, and how /status and `iop status` show it."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path

import httpx
import pytest

from iop import wire
from iop.contracts.status import decode_status
from iop.nats.server import EmbeddedNats
from iop.node import device
from iop.statusview import describe_device
from tests.harness import deployment, iop_process, running_edge

GPUS = "NVIDIA GeForce RTX 4090, 24564 MiB\nNVIDIA A100-SXM4-80GB, 81920 MiB\n"


def fake_command(bindir: Path, name: str, script: str) -> Path:
    """A stand-in for a command of the outside world (nvidia-smi) on a PATH of our own."""
    bindir.mkdir(exist_ok=True)
    path = bindir / name
    path.write_text(f"#!/bin/sh\n{script}\n")
    path.chmod(0o755)
    return bindir


def test_device_facts_of_this_machine_with_nvidia_gpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bindir = fake_command(tmp_path / "bin", "nvidia-smi", f"printf '{GPUS}'")
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    d = device.gather()
    assert d.os.startswith(platform.system())
    assert d.arch == platform.machine()
    assert d.cpu_cores == os.cpu_count()
    assert d.cpu_model and d.cpu_model != "unknown"
    assert d.memory_mb > 0
    assert d.python == platform.python_version() and d.iop
    assert d.accelerators == [
        wire.Accelerator(name="NVIDIA GeForce RTX 4090", memory_mb=24564),
        wire.Accelerator(name="NVIDIA A100-SXM4-80GB", memory_mb=81920),
    ]
    line = describe_device(d)
    assert "accelerators: NVIDIA GeForce RTX 4090 24 GiB, NVIDIA A100-SXM4-80GB 80 GiB" in line, line
    print("\n" + line)


def test_device_without_accelerators_says_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(fake_command(tmp_path / "bin", "true", "exit 0")))  # no nvidia-smi here
    d = device.gather()
    assert d.accelerators == []
    assert "accelerators: none" in describe_device(d)


def test_device_a_hanging_nvidia_smi_is_left_out_after_its_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bindir = fake_command(tmp_path / "bin", "nvidia-smi", "exec sleep 30")
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(device, "PROBE_TIMEOUT_S", 0.5)
    t0 = time.monotonic()
    d = device.gather()
    took = time.monotonic() - t0
    assert d.accelerators == []
    assert took < 10, took  # bounded by the timeout, not by the command
    print(f"\nhanging nvidia-smi: gathered in {took:.2f}s with a 0.5 s timeout")


NODE = """
models:
  - {alias: sim, pool: [p1]}
nodes:
  - id: n1
    adapters:
      - {id: m, type: mock, latency_ms: 0, tokens: 3}
    providers:
      - {id: p1, adapter: m, capacity: 1}
"""


async def test_device_facts_reach_status_and_iop_status(nats_server: EmbeddedNats, tmp_path: Path) -> None:
    cfg = tmp_path / "iop.yaml"
    cfg.write_text(NODE)
    bindir = fake_command(tmp_path / "bin", "nvidia-smi", f"printf '{GPUS}'")
    env = {"PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}"}
    async with running_edge(deployment(NODE), nats_server.url) as h:
        args = ("node", "--config", str(cfg), "--node", "n1", "--nats", nats_server.url)
        async with iop_process(*args, env=env, stop_grace_s=0) as node:
            await node.wait_line("iop node n1 serving")
            await h.edge.registry.wait_connected(["n1"], timeout_s=10)
            async with httpx.AsyncClient(base_url=h.url) as http:
                status = decode_status((await http.get("/status")).content)
            d = status.nodes[0].device
            assert d is not None
            assert d.cpu_cores == os.cpu_count() and d.memory_mb > 0 and d.os.startswith(platform.system())
            assert [a.name for a in d.accelerators] == ["NVIDIA GeForce RTX 4090", "NVIDIA A100-SXM4-80GB"]
            async with iop_process("status", "--edge", h.url) as cli:
                assert await cli.exit_code() == 0, cli.lines
    device_lines = [line for line in cli.stdout if line.startswith("n1 ") and "accelerators:" in line]
    assert len(device_lines) == 1, cli.stdout
    assert "NVIDIA GeForce RTX 4090 24 GiB" in device_lines[0] and f"({os.cpu_count()} cores)" in device_lines[0]
    print("\n" + "\n".join(cli.stdout))
