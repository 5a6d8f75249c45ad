"""Scenario 6: start-up of the single-file archive, to the first served request.

An edge and a node (mock adapter) are launched together from `iop.pyz`; the clock runs from the
launch until the first `POST /v1/chat/completions` answered 200. First start = an empty
`IOP_CACHE_DIR` (the archive unpacks itself and Python compiles what it imports); warm start = the
same cache again. The source tree (`python -m iop`) is timed the same way for comparison. Rounds
alternate first and warm starts.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.measure import spread
from bench.procs import REPO, Owned, free_port, http, iop_argv, log
from bench.stack import mock_node


@dataclass
class StartupOptions:
    rounds: int = 3
    archive: Path | None = None
    timeout_s: float = 60.0


def build_archive(workdir: Path) -> tuple[Path, float]:
    """`python build.py --out <workdir>/iop.pyz` from this tree; the archive and the build's seconds."""
    out = workdir / "iop.pyz"
    t0 = time.monotonic()
    p = subprocess.run(
        [sys.executable, "build.py", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if p.returncode != 0:
        raise RuntimeError(f"build.py failed ({p.returncode}): {p.stderr[-2000:]}")
    return out, round(time.monotonic() - t0, 2)


def run_startup(owned: Owned, workdir: Path, opts: StartupOptions) -> dict[str, Any]:
    built_s = None
    archive = opts.archive
    if archive is None:
        archive, built_s = build_archive(workdir)
        log(f"startup: built {archive} in {built_s}s")
    times: dict[str, list[float]] = {"first": [], "warm": [], "source": []}
    for r in range(opts.rounds):
        cache = workdir / f"cache-{r}"
        shutil.rmtree(cache, ignore_errors=True)
        times["first"].append(_time_to_served(owned, workdir, f"first{r}", archive, cache, opts.timeout_s))
        times["warm"].append(_time_to_served(owned, workdir, f"warm{r}", archive, cache, opts.timeout_s))
        times["source"].append(_time_to_served(owned, workdir, f"source{r}", None, cache, opts.timeout_s))
        shutil.rmtree(cache, ignore_errors=True)
        log(
            f"startup r{r}: first {times['first'][-1]:.2f}s, warm {times['warm'][-1]:.2f}s,"
            f" source tree {times['source'][-1]:.2f}s"
        )
    return {
        "archive": str(archive),
        "archive_mb": round(archive.stat().st_size / 1e6, 1),
        "built_s": built_s,
        "first_start_s": spread([*times["first"]], 2),
        "warm_start_s": spread([*times["warm"]], 2),
        "source_start_s": spread([*times["source"]], 2),
        "rounds": opts.rounds,
    }


def _time_to_served(
    owned: Owned, workdir: Path, name: str, archive: Path | None, cache: Path, timeout_s: float
) -> float:
    http_port, nats_port = free_port(), free_port()
    deployment = {
        "edge": {
            "listen": f"127.0.0.1:{http_port}",
            "nats": {"listen": f"127.0.0.1:{nats_port}", "store_dir": str(workdir / f"{name}-nats")},
        },
        "models": [{"alias": "m", "pool": ["p"]}],
        "nodes": [mock_node("n1", ["p"], capacity=2, latency_ms=0, tokens=4)],
    }
    cfg = workdir / f"start-{name}.yaml"
    cfg.write_text(json.dumps(deployment))
    env = {"IOP_CACHE_DIR": str(cache)}
    url = f"http://127.0.0.1:{http_port}/v1/chat/completions"
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    t0 = time.monotonic()
    edge = owned.start(f"start-{name}-edge", iop_argv(archive, "edge", "--config", str(cfg)), env)
    node = owned.start(f"start-{name}-node", iop_argv(archive, "node", "--config", str(cfg), "--node", "n1"), env)
    try:
        while True:
            try:
                status, _ = http("POST", url, body, timeout=10)
                if status == 200:
                    return round(time.monotonic() - t0, 3)
            except OSError:
                pass  # not listening yet
            if not edge.alive() or not node.alive():
                raise RuntimeError(f"{name}: edge or node exited during start:\n{edge.tail()}\n{node.tail()}")
            if time.monotonic() - t0 > timeout_s:
                raise RuntimeError(f"{name}: no served request within {timeout_s:g}s")
            time.sleep(0.01)
    finally:
        owned.stop(node)
        owned.stop(edge)
