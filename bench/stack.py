"""An iop deployment under test: its generated config, the edge and its nodes, and their CPU counters.

The work stream is stored as iop stores it by default: `file` (the edge's embedded nats-server on a
temporary store). `memory` starts a nats-server here, creates the work stream in memory before the
edge sees it, and points the edge and nodes at it (`--nats`): the same iop, minus the disk.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.procs import Owned, Proc, comm, cpu_s, free_port, http_json, iop_argv, log, status_ready, wait_until

# --- deployments ------------------------------------------------------------------------------------


def edge_settings(http_port: int, nats_port: int, store: Path, max_waiting: int = 100_000) -> dict[str, Any]:
    return {
        "listen": f"127.0.0.1:{http_port}",
        "nats": {"listen": f"127.0.0.1:{nats_port}", "store_dir": str(store)},
        "queue": {"timeout_s": 600, "max_waiting": max_waiting},
    }


def openai_pool_node(node_id: str, providers: list[tuple[str, int, int]]) -> dict[str, Any]:
    """A node whose providers (id, upstream port, capacity) each forward to the bench upstream."""
    return {
        "id": node_id,
        "adapters": [
            {"id": f"{pid}-up", "type": "openai", "base_url": f"http://127.0.0.1:{port}/v1", "api": "both"}
            for pid, port, _ in providers
        ],
        "providers": [
            {"id": pid, "adapter": f"{pid}-up", "model": "fake-model", "capacity": cap} for pid, _, cap in providers
        ],
    }


def start_one_pool(owned: Owned, workdir: Path, name: str, port: int, capacity: int = 8) -> Stack:
    """An edge and one node `n` whose provider `fake` (of `capacity`) forwards to the bench upstream
    on `port`: the pool `bench`, for the experiments that watch one request's way through."""
    node = openai_pool_node("n", [("fake", port, capacity)])
    return start_stack(owned, workdir, name, [{"alias": "bench", "pool": ["fake"]}], [node])


def mock_node(node_id: str, providers: list[str], capacity: int, latency_ms: float, tokens: int) -> dict[str, Any]:
    return {
        "id": node_id,
        "adapters": [
            {"id": "mock", "type": "mock", "latency_ms": latency_ms, "tokens": tokens, "token_interval_ms": 0}
        ],
        "providers": [{"id": p, "adapter": "mock", "capacity": capacity} for p in providers],
    }


# --- a running stack --------------------------------------------------------------------------------


@dataclass
class Stack:
    """One edge and its nodes, started from this tree (or an archive), ready to serve."""

    owned: Owned
    url: str
    edge: Proc
    nodes: list[Proc]
    nats_pid: int | None
    config_path: Path
    started_s: float
    extra: list[Proc] = field(default_factory=list)

    def cpu(self) -> dict[str, float]:
        """CPU seconds so far of the edge, the node processes together, and nats-server."""
        return {
            "edge": self.edge.cpu_s(),
            "node": sum(n.cpu_s() for n in self.nodes),
            "nats": cpu_s(self.nats_pid) if self.nats_pid else 0.0,
        }

    def status(self) -> Any:
        return http_json("GET", self.url + "/status")

    def stop(self) -> None:
        # Nodes first (they leave cleanly), then the edge (it stops its own nats-server).
        for p in [*self.nodes, *self.extra, self.edge]:
            self.owned.stop(p)


def queue_extra(standby: int | None, **queue: Any) -> dict[str, Any] | None:
    """`edge_extra` for `start_stack` that sets edge.queue fields (`standby` None: the edge's default)."""
    if standby is None and not queue:
        return None
    q = {"timeout_s": 600, "max_waiting": 100_000} | queue
    return {"queue": q | ({"standby": standby} if standby is not None else {})}


def start_stack(
    owned: Owned,
    workdir: Path,
    name: str,
    models: list[dict[str, Any]],
    nodes: list[dict[str, Any]],
    *,
    storage: str = "file",
    archive: Path | None = None,
    max_waiting: int = 100_000,
    node_procs: str = "each",
    ready_timeout_s: float = 90.0,
    edge_extra: dict[str, Any] | None = None,
    ready_headers: dict[str, str] | None = None,
    top_extra: dict[str, Any] | None = None,
) -> Stack:
    """Write the deployment, start edge and nodes, wait until /status shows every node and full capacity.

    node_procs: `each` = one `iop node` process per node; `sim` = all nodes in one bench/simnodes.py.
    """
    t0 = time.monotonic()
    http_port, nats_port = free_port(), free_port()
    store = workdir / f"{name}-nats"
    edge_cfg = edge_settings(http_port, nats_port, store, max_waiting) | (edge_extra or {})
    deployment = {"edge": edge_cfg, "models": models, "nodes": nodes} | (top_extra or {})
    cfg = workdir / f"{name}.yaml"
    cfg.write_text(json.dumps(deployment, indent=1))  # JSON is YAML
    nats_url = f"nats://127.0.0.1:{nats_port}"
    nats_proc: Proc | None = None
    edge_args = ["edge", "--config", str(cfg)]
    if storage == "memory":
        nats_proc = start_memory_nats(owned, workdir, name, nats_port)
        edge_args += ["--nats", nats_url]
    edge = owned.start(f"{name}-edge", iop_argv(archive, *edge_args))
    url = f"http://127.0.0.1:{http_port}"
    node_list: list[Proc] = []
    if node_procs == "sim":
        node_list.append(
            owned.start(
                f"{name}-simnodes",
                [sys.executable, "-m", "bench.simnodes", "--config", str(cfg), "--nats", nats_url],
            )
        )
    else:
        for n in nodes:
            args = ["node", "--config", str(cfg), "--node", n["id"], "--nats", nats_url]
            node_list.append(owned.start(f"{name}-node-{n['id']}", iop_argv(archive, *args)))
    stack = Stack(owned, url, edge, node_list, None, cfg, 0.0, [nats_proc] if nats_proc else [])
    try:
        wait_until(
            f"{name}: edge and {len(nodes)} nodes ready",
            status_ready(url, headers=ready_headers),
            ready_timeout_s,
            [edge, *node_list],
        )
    except BaseException:
        stack.stop()
        raise
    if nats_proc is not None:
        stack.nats_pid = nats_proc.pid
    else:
        kids = [k for k in edge.note_children() if "nats" in comm(k)]
        stack.nats_pid = kids[0] if kids else None
    stack.started_s = round(time.monotonic() - t0, 2)
    log(f"{name}: ready in {stack.started_s}s ({url}, storage {storage})")
    return stack


def start_memory_nats(owned: Owned, workdir: Path, name: str, port: int) -> Proc:
    """A nats-server of our own with the work stream created in memory (iop keeps an existing stream)."""
    from iop.nats import connection, streams
    from iop.nats.bundle import nats_server_path
    from iop.nats.goruntime import server_env
    from iop.nats.server import MAX_PAYLOAD

    conf = workdir / f"{name}-nats.conf"
    store = workdir / f"{name}-nats-mem"
    conf.write_text(
        f'host: "127.0.0.1"\nport: {port}\nmax_payload: {MAX_PAYLOAD}\njetstream {{ store_dir: "{store}" }}\n'
    )
    # Go's collector as the edge sets it for its own server (iop/nats/server.py).
    proc = owned.start(f"{name}-nats", [nats_server_path(), "-c", str(conf)], server_env(os.environ))

    async def create() -> None:
        nc = await connection.connect(f"nats://127.0.0.1:{port}", "iop-bench", wait_s=15.0)
        try:
            await streams.ensure_work_stream(nc.jetstream(), memory=True)
        finally:
            await nc.close()

    asyncio.run(create())
    return proc
