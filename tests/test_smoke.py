"""`iop smoke` as users run it: a real subprocess, from the built archive or `python -m iop`, passing and failing."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from iop import config
from iop.cli import main
from tests.fakes import fake_upstream
from tests.harness import BARE_PYTHON, deployment_running

ROOT = Path(__file__).resolve().parent.parent
SMOKE_YAML = ROOT / "configs" / "smoke.yaml"
RUN_S = 60.0
"""Bound on one smoke run in these tests; a pass takes about 6 s on a 2-core machine."""


def _env(tmp: Path, **extra: str) -> dict[str, str]:
    """The test's environment for `python -m iop`, with smoke's temporary folder under `tmp`."""
    env = {k: v for k, v in os.environ.items() if k != "IOP_ARCHIVE"}
    env["PYTHONPATH"] = str(ROOT)
    env["TMPDIR"] = str(tmp)
    return {**env, **extra}


def _tmpdir(tmp_path: Path) -> Path:
    t = tmp_path / "t"
    t.mkdir()
    return t


def _smoke(args: list[str], tmp: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "iop", "smoke", *args],
        cwd=cwd,
        env=_env(tmp),
        capture_output=True,
        text=True,
        timeout=RUN_S,
        check=False,
    )


async def _smoke_async(args: list[str], tmp: Path, cwd: Path) -> tuple[int, str, str]:
    """Run smoke while this test's event loop keeps serving (a fake upstream, an in-process edge)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "iop", "smoke", *args,
        cwd=cwd, env=_env(tmp), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        async with asyncio.timeout(RUN_S):
            out, err = await proc.communicate()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def _processes_mentioning(text: str) -> list[str]:
    """Live processes whose command line contains `text` (every child smoke starts names its folder)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmd:
                found.append(f"{entry.name}: {cmd}")
    return found


def _assert_nothing_left(tmp: Path, pids: list[int]) -> None:
    assert list(tmp.iterdir()) == [], "smoke left files behind"
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    if Path("/proc/self").exists():
        assert _processes_mentioning(str(tmp)) == []


def _pids(report: dict[str, Any]) -> list[int]:
    return [p["pid"] for p in report["processes"]] + [h for p in report["processes"] for h in p["helpers"]]


# --- passing ----------------------------------------------------------------------------------------


# The shared archive fixture may have to build first (a cold build downloads wheels).
@pytest.mark.timeout(600)
def test_smoke_from_archive_passes_and_leaves_nothing(built_archive: Path, tmp_path: Path) -> None:
    tmp, cwd = _tmpdir(tmp_path), tmp_path / "cwd"
    cwd.mkdir()
    venv_bin = str(Path(sys.executable).parent)
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep) if p and p != venv_bin)
    env = {
        "PATH": path,
        "HOME": str(tmp_path),
        "IOP_CACHE_DIR": str(tmp_path / "cache"),
        "LANG": "C.UTF-8",
        "TMPDIR": str(tmp),
    }
    # A bare Python (-S: no site-packages) from an empty folder: the archive alone must be enough.
    done = subprocess.run(
        [BARE_PYTHON, "-S", str(built_archive), "smoke"],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=RUN_S, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert out.startswith("iop smoke: PASS: self-contained run of iop/configs/smoke.yaml (built in)")
    assert re.search(r"^qwen-coder\s+3/3\s+10/10\s+10\s+\d+\s+0$", out, re.M), out
    for provider, capacity in (("mac-mlx-vllm", 2), ("gpu-a-vllm", 4), ("gpu-b-vllm", 4)):
        assert re.search(rf"^\S*\s+{provider}\s+pool\s+{capacity}\s+{capacity}\s", out, re.M), out
    assert re.search(r"^mac-codex-node\s+codex-cli\s+cli\s+unlimited\s+1\s+1\s+0$", out, re.M), out
    assert re.search(r"^qwen-coder\s+all\s+-\s+40\s+40\s", out, re.M), out
    for name in (
        "ready",
        "answers",
        "saturated",
        "direct route",
        "pool peak",
        "provider peaks",
        "provider errors",
        "drained",
        "counted",
    ):
        assert f"  ok    {name}: " in out
    assert "  FAIL  " not in out and "failed checks" not in out
    # Progress goes to stderr while it runs.
    for step in ("starting the edge", "ready: 3 nodes connected", "burst: 40 requests", "stopping 4 processes"):
        assert step in done.stderr
    pids = [int(p) for p in re.findall(r"\(pid (\d+)\)", out.splitlines()[1])]
    assert len(pids) == 4
    _assert_nothing_left(tmp, pids)
    assert list(cwd.iterdir()) == []


def test_smoke_json_reports_peaks_measured_on_the_nodes(tmp_path: Path) -> None:
    tmp = _tmpdir(tmp_path)
    done = _smoke(["--json", "--requests", "24"], tmp, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["ok"] is True and report["failed_checks"] == []
    assert (report["mode"], report["model"], report["direct"], report["requests_sent"]) == (
        "self-contained",
        "qwen-coder",
        "codex",
        24,
    )
    peaks = {p["provider"]: (p["capacity"], p["peak_in_flight"], p["served"]) for p in report["providers"]}
    assert peaks["codex-cli"] == (None, 1, 1)
    assert {k: v[:2] for k, v in peaks.items() if k != "codex-cli"} == {
        "mac-mlx-vllm": (2, 2),
        "gpu-a-vllm": (4, 4),
        "gpu-b-vllm": (4, 4),
    }
    assert sum(v[2] for k, v in peaks.items() if k != "codex-cli") == 24
    pool = report["pool"]
    assert (pool["peak_running"], pool["total_capacity"], pool["waiting_at_end"], pool["running_at_end"]) == (
        10,
        10,
        0,
        0,
    )
    rows = {(r["endpoint"], r["stream"]): r for r in report["requests"]}
    for endpoint in ("/v1/chat/completions", "/v1/responses"):
        for stream in (False, True):
            assert (rows[endpoint, stream]["requests"], rows[endpoint, stream]["ok"]) == (6, 6)
    assert rows["all", None]["queue_ms"]["p99"] > 0
    assert [p["exit_code"] for p in report["processes"]] == [0, 0, 0, 0], "a process did not stop cleanly"
    edge = report["processes"][0]
    assert edge["role"] == "edge" and len(edge["helpers"]) == 1, "the edge's nats-server was not found"
    _assert_nothing_left(tmp, _pids(report))


async def test_smoke_edge_mode_checks_a_running_deployment(nats_server: Any, tmp_path: Path) -> None:
    dep = config.load(SMOKE_YAML).deployment
    async with deployment_running(dep, nats_server.url) as handle:
        code, out, err = await _smoke_async(
            ["--edge", handle.url, "--expect-nodes", "3", "--expect-capacity", "10", "--requests", "20", "--json"],
            _tmpdir(tmp_path),
            tmp_path,
        )
    assert code == 0, out + err
    report = json.loads(out)
    assert report["mode"] == "edge" and report["processes"] == []
    assert {c["name"]: c["ok"] for c in report["checks"]} == dict.fromkeys(
        ("ready", "answers", "saturated", "direct route", "pool peak", "provider peaks", "provider errors", "drained"),
        True,
    )
    assert "since the edge started" in next(c["detail"] for c in report["checks"] if c["name"] == "pool peak")


# --- failing on purpose -----------------------------------------------------------------------------


def test_smoke_names_a_node_that_never_connects(tmp_path: Path) -> None:
    tmp = _tmpdir(tmp_path)
    done = _smoke(["--skip-node", "gpu-b-node", "--ready-timeout", "3"], tmp, tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    out = done.stdout
    assert out.startswith("iop smoke: FAIL (1 checks failed)")
    ready = next(line for line in out.splitlines() if line.startswith("  FAIL  ready: "))
    assert "not ready after 3s" in ready
    assert "node gpu-b-node is not connected (not started: --skip-node)" in ready
    # On a loaded machine another node may also still be connecting: only gpu-b's absence is certain.
    assert re.search(r"pool qwen-coder: [0-2] of 3 candidates connected \(missing [^)]*gpu-b-vllm on gpu-b-node", ready)
    assert re.search(r"capacity [0-6] of 10", ready)
    assert out.rstrip().endswith("failed checks: ready")
    assert "burst" not in done.stderr
    _assert_nothing_left(tmp, [])


def test_smoke_shows_why_a_process_it_started_died(tmp_path: Path) -> None:
    data = yaml.safe_load(SMOKE_YAML.read_text())
    data["edge"]["admin_keys_env"] = "IOP_TEST_SMOKE_UNSET_KEYS"
    deployment = tmp_path / "no-keys.yaml"
    deployment.write_text(yaml.safe_dump(data))
    tmp = _tmpdir(tmp_path)
    done = _smoke(["--config", str(deployment)], tmp, tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "the edge never listened; started and stopped: edge (pid " in done.stdout
    assert "  FAIL  ready: edge exited with status 2; last lines of its log:\n      | iop: edge.admin_keys_env:" in (
        done.stdout
    )
    _assert_nothing_left(tmp, [])


async def test_smoke_fails_when_a_providers_upstream_answers_errors(tmp_path: Path) -> None:
    async with fake_upstream(fail_status=500) as upstream:
        data = yaml.safe_load(SMOKE_YAML.read_text())
        gpu_b = next(n for n in data["nodes"] if n["id"] == "gpu-b-node")
        gpu_b["adapters"] = [{"id": "vllm", "type": "openai", "base_url": upstream.url, "api": "both"}]
        deployment = tmp_path / "broken.yaml"
        deployment.write_text(yaml.safe_dump(data))
        tmp = _tmpdir(tmp_path)
        code, out, err = await _smoke_async(["--config", str(deployment), "--json", "--requests", "20"], tmp, tmp_path)
    assert code == 1, out + err
    report = json.loads(out)
    # The edge retries a failure before the first byte on another provider: clients may all get
    # answers, but smoke must still name the provider that failed and why.
    assert report["ok"] is False and "provider errors" in report["failed_checks"]
    detail = next(c["detail"] for c in report["checks"] if c["name"] == "provider errors")
    assert re.match(r"gpu-b-vllm on gpu-b-node failed \d+ requests", detail), detail
    assert "upstream_error" in detail
    failed = {p["provider"]: p["failed"] for p in report["providers"]}
    assert failed["gpu-b-vllm"] > 0 and failed["gpu-a-vllm"] == failed["mac-mlx-vllm"] == 0
    assert upstream.total == failed["gpu-b-vllm"]
    answers = next(c for c in report["checks"] if c["name"] == "answers")
    if not answers["ok"]:
        assert "(provider gpu-b-vllm)" in answers["detail"] or "upstream" in answers["detail"]
    _assert_nothing_left(tmp, _pids(report))


async def test_smoke_ctrl_c_stops_every_process_and_removes_its_files(tmp_path: Path) -> None:
    tmp = _tmpdir(tmp_path)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "iop", "smoke",
        cwd=tmp_path, env=_env(tmp), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stderr is not None and proc.stdout is not None
    seen: list[str] = []
    try:
        async with asyncio.timeout(RUN_S):
            # Interrupt in the middle of the burst, with every process running and the pool full.
            while not any("burst: 40 requests" in line for line in seen):
                line = (await proc.stderr.readline()).decode()
                assert line, "".join(seen)
                seen.append(line)
            assert _processes_mentioning(str(tmp)), "smoke's processes should be running now"
            proc.send_signal(signal.SIGINT)
            rest, out = await asyncio.gather(proc.stderr.read(), proc.stdout.read())
            await proc.wait()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 130, "".join(seen) + rest.decode()
    assert "SIGINT: stopping everything smoke started" in rest.decode()
    assert out == b""
    _assert_nothing_left(tmp, [])


# --- options ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--requests", "10"], "--requests 10: the burst must be larger than the capacity of pool qwen-coder (10)"),
        (["--model", "codex"], "--model codex: not a pool alias of iop/configs/smoke.yaml (built in)"),
        (["--skip-node", "gpu-c-node"], "--skip-node gpu-c-node: not a node of iop/configs/smoke.yaml (built in)"),
        (["--edge", "http://127.0.0.1:1", "--config", "x.yaml"], "--edge checks a running deployment"),
    ],
)
def test_smoke_refuses_bad_options_before_starting_anything(args: list[str], message: str) -> None:
    # In process: these must fail before smoke starts anything.
    done = CliRunner().invoke(main, ["smoke", *args])
    assert done.exit_code == 2, done.output
    assert message in done.output
    assert "starting the edge" not in done.output


def test_smoke_edge_mode_says_when_the_edge_is_unreachable(tmp_path: Path) -> None:
    done = _smoke(["--edge", "http://127.0.0.1:9", "--ready-timeout", "0.5"], _tmpdir(tmp_path), tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FAIL  ready: cannot reach the edge at http://127.0.0.1:9: ConnectError" in done.stdout
