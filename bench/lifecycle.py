"""Scenario: model servers the node runs itself — cold start and swap latency (docs/lifecycle.md).

An edge and a node as processes; the node's two adapters each run tests/model_server.py, a fake
server that takes `load_s` to load its model (503 on /health meanwhile), in one exclusive group of
size 1. Measured from the client, beside what the node says its server took to become ready
(`/status`, `server.last_cold_start_ms`): a cold start (the first request to a stopped server), a
warm request, and swaps (a request for the other model: drain and stop one, start the other).
iop's own share is the request's latency less the server's start-to-ready.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.measure import spread
from bench.procs import REPO, Owned, free_port, http, iop_argv, log


@dataclass
class LifecycleOptions:
    load_s: float = 1.0
    swaps: int = 6
    archive: Path | None = None
    timeout_s: float = 60.0


def _adapter(name: str, port: int, load_s: float) -> dict[str, Any]:
    script = str(REPO / "tests" / "model_server.py")
    return {
        "id": name,
        "type": "openai",
        "base_url": f"http://127.0.0.1:{port}/v1",
        "server": {
            "command": [sys.executable, script, "--port", str(port), "--name", name, "--load-s", str(load_s)],
            "ready_url": f"http://127.0.0.1:{port}/health",
            "idle_stop_s": 600,
            "stop_grace_s": 5,
            "group": "gpu",
            "group_size": 1,
        },
    }


def run_lifecycle(owned: Owned, workdir: Path, opts: LifecycleOptions) -> dict[str, Any]:
    http_port, nats_port = free_port(), free_port()
    ports = {"a": free_port(), "b": free_port()}
    deployment = {
        "edge": {
            "listen": f"127.0.0.1:{http_port}",
            "nats": {"listen": f"127.0.0.1:{nats_port}", "store_dir": str(workdir / "lifecycle-nats")},
            "queue": {"timeout_s": opts.timeout_s},
        },
        "models": [{"alias": n, "pool": [f"gpu-{n}"]} for n in ports],
        "nodes": [
            {
                "id": "box",
                "adapters": [_adapter(n, p, opts.load_s) for n, p in ports.items()],
                "providers": [{"id": f"gpu-{n}", "adapter": n, "capacity": 2} for n in ports],
            }
        ],
    }
    cfg = workdir / "lifecycle.yaml"
    cfg.write_text(json.dumps(deployment))
    base = f"http://127.0.0.1:{http_port}"
    edge = owned.start("lifecycle-edge", iop_argv(opts.archive, "edge", "--config", str(cfg)))
    node = owned.start("lifecycle-node", iop_argv(opts.archive, "node", "--config", str(cfg), "--node", "box"))
    try:
        _wait_connected(base, opts.timeout_s)
        asked = time.time()
        cold = _ask(base, "a")
        ready_ms = _server(base, "gpu-a", asked)["last_cold_start_ms"]
        warm: list[float | None] = [_ask(base, "a") for _ in range(5)]
        swaps: list[float | None] = []
        shares: list[float | None] = []
        for i in range(opts.swaps):
            model = "b" if i % 2 == 0 else "a"
            asked = time.time()
            took = _ask(base, model)
            swaps.append(took)
            shares.append(took - _server(base, f"gpu-{model}", asked)["last_cold_start_ms"] / 1000)
        counts = {p: _server(base, p) for p in ("gpu-a", "gpu-b")}
        pids = [s.get("pid", 0) for s in counts.values() if s.get("pid")]
        log(f"lifecycle: cold {cold:.2f}s (server ready after {ready_ms / 1000:.2f}s), swaps {spread(swaps, 2)}")
    finally:
        owned.stop(node)
        owned.stop(edge)
    orphans = [pid for pid in pids if Path(f"/proc/{pid}").exists()]
    return {
        "load_s": opts.load_s,
        "cold_start_s": round(cold, 3),
        "cold_server_ready_s": round(ready_ms / 1000, 3),
        "cold_iop_share_s": round(cold - ready_ms / 1000, 3),
        "warm_s": spread(warm, 4),
        "swap_s": spread(swaps, 3),
        "swap_iop_share_s": spread(shares, 3),
        "swaps_counted": sum(s.get("swaps", 0) for s in counts.values()),
        "cold_starts_counted": sum(s.get("cold_starts", 0) for s in counts.values()),
        "orphans_after_node_sigterm": len(orphans),
    }


def _ask(base: str, model: str) -> float:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    t0 = time.monotonic()
    status, data = http("POST", base + "/v1/chat/completions", body, timeout=120)
    if status != 200:
        raise RuntimeError(f"lifecycle: {model} answered {status}: {data[:300]!r}")
    return time.monotonic() - t0


def _server(base: str, provider: str, ready_after: float = 0.0) -> dict[str, Any]:
    """The provider's server in /status, once a heartbeat says it became ready after `ready_after`
    (wall clock; heartbeats lag up to a second)."""
    t0 = time.monotonic()
    while True:
        status, data = http("GET", base + "/status")
        if status != 200:
            raise RuntimeError(f"lifecycle: /status answered {status}")
        server: dict[str, Any] = next(
            (p.get("server") or {} for n in json.loads(data)["nodes"] for p in n["providers"] if p["id"] == provider),
            {},
        )
        fresh = server.get("state") == "ready" and server.get("since", 0.0) >= ready_after
        if fresh or not ready_after:
            return server
        if time.monotonic() - t0 > 5:
            raise RuntimeError(f"lifecycle: /status never showed {provider}'s server ready")
        time.sleep(0.05)  # the next heartbeat brings it: another process's state


def _wait_connected(base: str, timeout_s: float) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        try:
            status, data = http("GET", base + "/status")
            if status == 200 and all(n["connected"] for n in json.loads(data)["nodes"]):
                return
        except OSError:
            pass  # not listening yet
        time.sleep(0.05)  # another process's state: nothing here can signal it
    raise RuntimeError(f"lifecycle: the node did not connect within {timeout_s:g}s")
