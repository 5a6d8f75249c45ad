"""`iop smoke`: start a deployment (or reach a running one), saturate a pool, judge it, report, clean up."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.resources
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import httpx
import yaml

from iop import config, wire
from iop.client import EdgeClient
from iop.contracts.status import PoolStatus, Status
from iop.errors import ConfigError, IopError, PlanError, UsageError
from iop.smoke.burst import run_burst
from iop.smoke.procs import Children, child_env, iop_command
from iop.smoke.ready import Plan, describe_ready, make_plan, missing
from iop.smoke.verdict import SmokeResult, judge, ready_check, to_json, to_text, unsettled

READY_LINE = re.compile(r"iop edge listening on (http://\S+) nats=(\S+)")
EDGE_START_S = 30.0
"""Bound on the edge's own start (it gives its embedded nats-server 15 s, and NATS 15 s more)."""
SETTLE_S = wire.HEARTBEAT_INTERVAL_S * wire.HEARTBEATS_MISSED + 3.0
"""After the burst: long enough for every node's next heartbeat to bring its final counts."""
BUILT_IN = "iop/configs/smoke.yaml"
_POLL_S = 0.1


@dataclass(frozen=True)
class Options:
    config: str | None = None
    """Deployment file to start (None: the built-in smoke.yaml); ignored with `edge`."""
    edge: str | None = None
    """Base URL of a running edge (as `iop.client.edge_url` gives it): check it instead of starting anything."""
    model: str | None = None
    direct: str | None = None
    expect_nodes: int | None = None
    expect_capacity: int | None = None
    requests: int | None = None
    ready_timeout_s: float = 20.0
    request_timeout_s: float | None = None
    skip_nodes: tuple[str, ...] = ()
    as_json: bool = False
    api_key: str | None = None


class Progress:
    """Progress lines on stderr, so that stdout holds only the report (or its JSON)."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.t0 = time.monotonic()

    def say(self, message: str) -> None:
        print(f"iop smoke [{time.monotonic() - self.t0:4.1f}s] {message}", file=self.stream, flush=True)


def run(opts: Options, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Run smoke: progress on `err`, the report on `out`. Returns the exit code: 0 pass, 1 fail,
    2 bad options or config, 130 interrupted."""
    out = out or sys.stdout
    err = err or sys.stderr
    try:
        return asyncio.run(_main(opts, out, err))
    except ConfigError as exc:
        for line in exc.problems:
            print(f"error: {line}", file=err)
        return 2
    except (UsageError, PlanError) as exc:
        print(f"iop smoke: {exc}", file=err)
        return 2


async def _main(opts: Options, out: TextIO, err: TextIO) -> int:
    ui = Progress(err)
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()
    assert main is not None
    spawned: list[Children] = []
    caught: list[int] = []

    def on_signal(sig: int) -> None:
        stopping = any(c.stopping for c in spawned)
        first = not caught
        caught.append(sig)
        if first and not stopping:
            ui.say(f"{signal.Signals(sig).name}: stopping everything smoke started (again to kill at once)")
            main.cancel()
        else:
            # Never cancel the clean-up itself: a signal while it runs makes it kill at once instead.
            ui.say(f"{signal.Signals(sig).name}: killing what is still running")
            for children in spawned:
                children.kill_now()

    handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    for sig in handled:
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        if opts.edge is not None:
            report = await _against_edge(opts, ui)
        else:
            report = await _self_contained(opts, ui, spawned)
    except asyncio.CancelledError:
        if not caught:
            raise
        ui.say("interrupted; every process smoke started has stopped and its files are gone")
        return 128 + caught[0]
    finally:
        for sig in handled:
            loop.remove_signal_handler(sig)
    report.duration_s = time.monotonic() - ui.t0
    ui.say("PASS" if report.ok else "FAIL")
    print(json.dumps(to_json(report), indent=2) if opts.as_json else to_text(report), file=out, flush=True)
    if caught:
        return 128 + caught[0]  # interrupted while stopping: the run was complete, the user still said stop
    return 0 if report.ok else 1


# --- self-contained ---------------------------------------------------------------------------------


def _config_text(path: str | None) -> tuple[str, str]:
    if path is None:
        return BUILT_IN + " (built in)", (importlib.resources.files("iop") / "configs" / "smoke.yaml").read_text(
            encoding="utf-8"
        )
    try:
        return path, Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError([f"{path}: no such file"]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([f"{path}: cannot read: {exc}"]) from None


def _isolated(text: str, work: Path) -> str:
    """The deployment with everything that would touch the machine moved into smoke's own folder:
    ports chosen by the OS, the JetStream store in `work`, no client keys (the edge is smoke's alone)."""
    data: dict[str, Any] = yaml.safe_load(text)
    edge = data.setdefault("edge", {}) or {}
    data["edge"] = edge
    edge["listen"] = "127.0.0.1:0"
    edge.pop("api_keys_env", None)
    edge["nats"] = {
        **(edge.get("nats") or {}),
        "url": "embedded",
        "listen": "127.0.0.1:0",
        "store_dir": str(work / "nats"),
    }
    return yaml.safe_dump(data, sort_keys=False)


def _precheck(opts: Options, dep: config.Deployment, source: str) -> None:
    """Refuse unknown names before starting anything."""
    catalog = config.Catalog.of(dep)
    nodes = [n.id for n in dep.nodes]
    for node in opts.skip_nodes:
        if node not in nodes:
            raise UsageError(f"--skip-node {node}: not a node of {source} (its nodes: {', '.join(nodes)})")
    if opts.model is not None and opts.model not in catalog.pools:
        raise UsageError(
            f"--model {opts.model}: not a pool alias of {source} (its pools: {', '.join(catalog.pools) or 'none'})"
        )
    if opts.direct is not None and opts.direct not in catalog.routes:
        raise UsageError(
            f"--direct {opts.direct}: not a direct route of {source} (its routes: "
            f"{', '.join(catalog.routes) or 'none'})"
        )
    if not catalog.pools:
        raise UsageError(f"{source} has no pool alias, so there is no capacity to check")
    alias = opts.model or next(iter(catalog.pools))
    capacity = opts.expect_capacity or sum(catalog.providers[p].provider.capacity or 0 for p in catalog.pools[alias])
    if opts.requests is not None and opts.requests <= capacity:
        raise UsageError(
            f"--requests {opts.requests}: the burst must be larger than the capacity of pool {alias}"
            f" ({capacity}) to fill it"
        )


async def _self_contained(opts: Options, ui: Progress, spawned: list[Children]) -> SmokeResult:
    source, text = _config_text(opts.config)
    dep = config.parse(text, source).deployment
    _precheck(opts, dep, source)
    report = SmokeResult("self-contained", edge="", config=source)
    work = Path(tempfile.mkdtemp(prefix="iop-smoke-"))
    children: Children | None = None
    try:
        deployment = work / "deployment.yaml"
        deployment.write_text(_isolated(text, work), encoding="utf-8")
        (work / "tmp").mkdir()
        children = Children(work, child_env(work / "tmp"), os.getcwd())
        spawned.append(children)
        command = iop_command()
        ui.say(f"starting the edge with its embedded nats-server, deployment {source}")
        edge = await children.start(
            "edge", "edge", [*command, "edge", "--config", str(deployment), "--listen", "127.0.0.1:0"]
        )
        m = await children.wait_for_line(edge, READY_LINE, EDGE_START_S)
        if m is None:
            if edge.exit_code is not None:
                report.fail("ready", edge.describe_exit())
            else:
                report.fail(
                    "ready",
                    f"the edge did not say where it listens within {EDGE_START_S:g}s; last lines"
                    " of its log:" + "".join(f"\n      | {line}" for line in edge.tail()),
                )
            return report
        report.edge, report.nats = m.group(1), m.group(2)
        children.adopt_helpers(edge)
        started = [n.id for n in dep.nodes if n.id not in opts.skip_nodes]
        ui.say(f"edge listening on {report.edge}, nats {report.nats}; starting nodes {', '.join(started)}")
        for node in started:
            await children.start(
                node, "node", [*command, "node", "--config", str(deployment), "--node", node, "--nats", report.nats]
            )
        await _exercise(report, opts, ui, children)
        return report
    finally:
        if children is not None:
            await children.stop(ui.say)
            report.processes = [
                {
                    "role": c.role,
                    "name": c.name,
                    "pid": c.pid,
                    "exit_code": c.exit_code,
                    "helpers": [h.pid for h in c.helpers],
                }
                for c in children.children
            ]
        shutil.rmtree(work, ignore_errors=True)


# --- against a running edge -------------------------------------------------------------------------


async def _against_edge(opts: Options, ui: Progress) -> SmokeResult:
    report = SmokeResult("edge", edge=opts.edge.rstrip("/") if opts.edge else "")
    ui.say(f"checking the deployment behind {report.edge}")
    await _exercise(report, opts, ui, None)
    return report


# --- the run itself ---------------------------------------------------------------------------------


async def _exercise(report: SmokeResult, opts: Options, ui: Progress, children: Children | None) -> None:
    """Wait for readiness, send the burst, let status settle, judge; failures become checks."""
    mine = children is not None
    headers = {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}
    # Smoke's own edge is on loopback: a proxy from the environment must not stand in between.
    async with EdgeClient(report.edge, api_key=opts.api_key, trust_env=not mine) as reader:
        status = await _first_status(reader, opts.ready_timeout_s, children)
        if isinstance(status, str):
            report.fail("ready", status)
            return
        report.nats = report.nats or status.edge.nats
        plan = make_plan(
            status,
            model=opts.model,
            direct=opts.direct,
            expect_nodes=opts.expect_nodes,
            expect_capacity=opts.expect_capacity,
            requests=opts.requests,
        )
        report.plan = plan
        ui.say(f"waiting for the deployment to be ready (up to {opts.ready_timeout_s:g}s)")
        status, gaps = await _wait_ready(reader, status, plan, opts, children)
        report.baseline = status
        if gaps:
            report.fail("ready", f"not ready after {opts.ready_timeout_s:g}s: " + "; ".join(gaps))
            return
        report.checks.append(ready_check(status, plan))
        ui.say(f"ready: {describe_ready(status, plan)}")

        timeout = opts.request_timeout_s or (30.0 if mine else 300.0)
        limits = httpx.Limits(max_connections=plan.requests + 8, max_keepalive_connections=plan.requests + 8)
        async with httpx.AsyncClient(
            base_url=report.edge, timeout=timeout, limits=limits, headers=headers, trust_env=not mine
        ) as burst_client:

            async def read_pool() -> PoolStatus | None:
                try:
                    return (await reader.status()).pool(plan.model)
                except IopError:
                    return None

            ui.say(f"burst: {plan.requests} requests to {plan.model} (chat and Responses, streamed and whole)")
            burst = await run_burst(burst_client, read_pool, plan.model, plan.direct, plan.requests, ui.say)
        report.burst = burst
        ok = sum(1 for o in burst.pool if o.ok)
        ui.say(
            f"burst: {ok}/{plan.requests} answered well-formed in {burst.duration_s:.1f}s; waiting for status to settle"
        )
        report.final, gaps = await _settle(reader, plan, report)
        edge = next((c for c in children.children if c.role == "edge"), None) if children else None
        judge(report, gaps, edge.lines() if edge else None)


async def _first_status(reader: EdgeClient, timeout_s: float, children: Children | None) -> Status | str:
    """The first /status, or why there is none."""
    loop = asyncio.get_running_loop()
    until = loop.time() + timeout_s
    while True:
        try:
            return await reader.status()
        except IopError as exc:
            if children is not None and (dead := children.exited()):
                return dead[0].describe_exit()
            if loop.time() >= until:
                return str(exc)
        await asyncio.sleep(_POLL_S)


async def _wait_ready(
    reader: EdgeClient, status: Status, plan: Plan, opts: Options, children: Children | None
) -> tuple[Status, list[str]]:
    """Poll /status until nothing is missing; the last status and what is still missing at the bound."""
    loop = asyncio.get_running_loop()
    until = loop.time() + opts.ready_timeout_s
    not_started = frozenset(opts.skip_nodes)
    gaps = ["no /status yet"]
    while True:
        with contextlib.suppress(IopError):
            status = await reader.status()
            gaps = missing(status, plan, not_started)
        if not gaps:
            return status, []
        if children is not None and (dead := children.exited()):
            # A process that died will not connect later: say so now, with its last words.
            return status, [c.describe_exit() for c in dead]
        if loop.time() >= until:
            return status, gaps + _silent_nodes(status, children)
        await asyncio.sleep(_POLL_S)


def _silent_nodes(status: Status, children: Children | None) -> list[str]:
    """The log tails of nodes smoke started that are running but not connected."""
    if children is None:
        return []
    connected = status.connected_nodes()
    out = []
    for c in children.children:
        if c.role == "node" and c.name not in connected and c.exit_code is None:
            tail = "".join(f"\n      | {line}" for line in c.tail(5)) or " (empty)"
            out.append(f"node {c.name} is running but not connected; its log:{tail}")
    return out


async def _settle(reader: EdgeClient, plan: Plan, report: SmokeResult) -> tuple[Status, list[str]]:
    assert report.burst is not None and report.baseline is not None
    loop = asyncio.get_running_loop()
    until = loop.time() + SETTLE_S
    status = report.baseline
    gaps = ["no /status after the burst"]
    while True:
        with contextlib.suppress(IopError):
            status = await reader.status()
            gaps = unsettled(status, plan, report.baseline, report.burst)
        if not gaps or loop.time() >= until:
            return status, gaps
        await asyncio.sleep(_POLL_S)
