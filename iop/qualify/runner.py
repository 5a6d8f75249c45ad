"""`iop qualify`: drive each provider through the edge's pinned admin path, then write and keep the reports.

Per provider: open a lease (exclusive: drained out of its pools, capacity raised to twice the
configured one for the sweep), keep renewing it, run the probes and the sweep, end the lease in a
`finally` (also on Ctrl-C or SIGTERM; a SIGKILL leaves the edge to end it when the renewals stop),
then hand the report to the edge and write the files.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from iop import __version__, wire
from iop.client import EdgeClient
from iop.contracts.status import NodeStatus, PoolProviderStatus, QualificationSummary, Status
from iop.errors import IopError
from iop.qualify.pages import html_report, markdown
from iop.qualify.probes import Target, context_window, run_checks
from iop.qualify.schema import Device, Report, decode_kept, encode_report
from iop.qualify.sweep import SweepSettings, recommend, sweep

DRAIN_WAIT_S = 60.0
"""How long an exclusive run waits for the user requests a provider still runs to finish."""


@dataclass
class Options:
    edge: str
    admin_key: str | None = None
    providers: tuple[str, ...] = ()
    pool: str | None = None
    exclusive: bool = False
    quick: bool = False
    out: Path | None = None
    context: int | None = None
    output_tokens: int | None = None
    lease_ttl_s: float = 6.0

    def sweep_settings(self, ceiling: int, configured: int) -> SweepSettings:
        if self.quick:
            s = SweepSettings(
                ceiling, configured, output_tokens=32, prompt_words=32, rounds=2, budget_s=35.0, level_timeout_s=15.0
            )
        else:
            s = SweepSettings(ceiling, configured, output_tokens=128, prompt_words=64, rounds=3, budget_s=420.0)
        if self.output_tokens is not None:
            s.output_tokens = self.output_tokens
        return s

    @property
    def checks_budget_s(self) -> float:
        return 20.0 if self.quick else 120.0

    @property
    def request_timeout_s(self) -> float:
        return 20.0 if self.quick else 120.0


@dataclass
class Chosen:
    node: NodeStatus
    provider: PoolProviderStatus


def choose(status: Status, opts: Options) -> list[Chosen]:
    """The providers to qualify: those named, else every provider of --pool, else every pool provider."""
    everyone = {p.id: Chosen(n, p) for n in status.nodes for p in n.providers if isinstance(p, PoolProviderStatus)}
    unknown = [pid for pid in opts.providers if pid not in everyone]
    if unknown:
        raise IopError(f"no provider with a capacity is called {', '.join(unknown)} (iop status lists them)")
    if opts.pool is not None and status.pool(opts.pool) is None:
        raise IopError(f"no pool is called {opts.pool!r} (iop status lists them)")
    chosen = [everyone[pid] for pid in opts.providers] if opts.providers else list(everyone.values())
    if opts.pool is not None:
        chosen = [c for c in chosen if opts.pool in c.provider.pools]
    if not chosen:
        raise IopError("no provider to qualify")
    offline = [c.provider.id for c in chosen if not c.node.connected]
    if offline:
        raise IopError(f"not connected, cannot be qualified: {', '.join(offline)}")
    return chosen


def device_name(d: wire.Device) -> str:
    """What the device is called in a report's key and heading: its accelerators, else its CPU."""
    if d.accelerators:
        names = [a.name for a in d.accelerators]
        return ", ".join(f"{names.count(n)}x {n}" if names.count(n) > 1 else n for n in dict.fromkeys(names))
    return f"{d.cpu_model or d.arch or 'unknown CPU'} ({d.cpu_cores} cores)"


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


@contextlib.asynccontextmanager
async def lease(client: EdgeClient, body: dict[str, Any], ttl_s: float) -> AsyncIterator[dict[str, Any]]:
    """A lease renewed every third of its ttl while the block runs, and ended when it leaves."""
    grant = await client.qualify_lease({**body, "ttl_s": ttl_s})
    lost: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    main = asyncio.current_task()

    async def renew() -> None:
        while True:
            await asyncio.sleep(ttl_s / 3)  # a renewal period, not synchronisation
            try:
                await client.qualify_renew(grant["id"])
            except IopError as exc:
                if not lost.done():
                    lost.set_result(str(exc))
                if main is not None:
                    main.cancel()
                return

    renewer = asyncio.create_task(renew())
    try:
        yield grant
    except asyncio.CancelledError:
        if lost.done():
            if main is not None:
                main.uncancel()
            raise IopError(f"the qualification lease was lost: {lost.result()}") from None
        raise
    finally:
        renewer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await renewer
        with contextlib.suppress(IopError):  # expired already: the edge put everything back itself
            await client.qualify_end(grant["id"])


async def _wait_user_work_gone(client: EdgeClient, provider: str, echo: Callable[[str], None]) -> None:
    until = time.monotonic() + DRAIN_WAIT_S
    while True:
        found = (await client.qualify_status()).providers().get(provider)
        busy = found[1].dispatched_in_flight if found and isinstance(found[1], PoolProviderStatus) else 0
        if busy == 0:
            return
        if time.monotonic() > until:
            raise IopError(f"{provider}: {busy} user requests still run after {DRAIN_WAIT_S:g}s of draining")
        echo(f"{provider}: drained, waiting for {busy} running user requests")
        await asyncio.sleep(0.5)  # the condition lives at the edge: polled


async def qualify_one(client: EdgeClient, chosen: Chosen, opts: Options, echo: Callable[[str], None]) -> Report:
    p, node = chosen.provider, chosen.node
    capacity = p.capacity or 1
    ceiling = 2 * capacity if opts.exclusive else capacity
    alias = opts.pool if opts.pool in p.pools else (p.pools[0] if p.pools else p.id)
    target = Target(client, p.id, alias, opts.request_timeout_s)
    started, t0 = _now(), time.monotonic()
    body: dict[str, Any] = {"providers": [p.id], "exclusive": opts.exclusive}
    if opts.exclusive and ceiling != capacity:
        body["ceiling"] = ceiling
    context_tokens = None
    async with lease(client, body, opts.lease_ttl_s):
        if opts.exclusive:
            echo(f"{p.id}: drained out of {', '.join(p.pools)}; capacity {capacity} -> {ceiling} for the sweep")
            await _wait_user_work_gone(client, p.id, echo)
        echo(f"{p.id}: protocol and capability probes")
        checks = await run_checks(target, opts.checks_budget_s)
        if opts.context:
            echo(f"{p.id}: context window, binary search up to {opts.context} tokens")
            context_tokens = await context_window(target, opts.context, opts.checks_budget_s)
        echo(f"{p.id}: sweep, concurrency 1 .. {ceiling}")
        levels = await sweep(target, opts.sweep_settings(ceiling, capacity))
    rec = recommend(levels, capacity, max((lv.concurrency for lv in levels), default=0))
    device = Device()
    if node.device is not None:
        device = Device(summary=device_name(node.device), facts=msgspec.to_builtins(node.device))
    model = p.model or alias
    finished = _now()
    return Report(
        provider=p.id,
        node=node.id,
        alias=alias,
        model=model,
        adapter_type=p.type,
        device=device,
        configured_capacity=capacity,
        exclusive=opts.exclusive,
        quick=opts.quick,
        started=started,
        finished=finished,
        duration_s=round(time.monotonic() - t0, 1),
        iop_version=__version__,
        checks=checks,
        sweep=levels,
        recommendation=rec,
        context_tokens=context_tokens,
        summary=QualificationSummary(
            date=finished,
            verdict=rec.verdict,
            recommended_capacity=rec.recommended_capacity,
            configured_capacity=capacity,
            checks_passed=sum(c.status == "pass" for c in checks),
            checks_failed=sum(c.status == "fail" for c in checks),
            device=device.summary,
            model=model,
        ),
    )


async def run(opts: Options, echo: Callable[[str], None]) -> list[Report]:
    """Qualify every chosen provider in turn; each report is kept at the edge and written to --out."""
    reports: list[Report] = []
    async with EdgeClient(opts.edge, api_key=opts.admin_key, timeout_s=10.0, max_connections=None) as client:
        chosen = choose(await client.qualify_status(), opts)
        for c in chosen:
            report = await qualify_one(client, c, opts, echo)
            await client.qualify_keep(report.provider, encode_report(report))
            reports.append(report)
            echo(f"{report.provider}: {report.recommendation.verdict}")
            if opts.out is not None:
                write(opts.out, reports)
    return reports


async def show(opts: Options) -> list[Report]:
    async with EdgeClient(opts.edge, api_key=opts.admin_key, timeout_s=10.0) as client:
        raw = await client.qualify_results()
    try:
        reports = decode_kept(raw)
    except msgspec.DecodeError as exc:
        raise IopError(f"the edge's qualification results are unreadable: {exc}") from None
    if opts.providers:
        reports = [r for r in reports if r.provider in opts.providers]
    if opts.pool:
        reports = [r for r in reports if r.alias == opts.pool]
    return reports


def write(out: Path, reports: list[Report]) -> list[Path]:
    """One JSON per provider x device x model, the Markdown summary and the HTML file."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for r in reports:
        path = out / f"{r.key()}.json"
        path.write_bytes(msgspec.json.format(encode_report(r), indent=2) + b"\n")
        written.append(path)
    (out / "qualification.md").write_text(markdown(reports))
    (out / "qualification.html").write_text(html_report(reports))
    return [*written, out / "qualification.md", out / "qualification.html"]


def capacity_change(reports: list[Report]) -> str:
    """The YAML to put in the deployment file for every recommendation that differs (nothing is written)."""
    changes = [
        r
        for r in reports
        if r.recommendation.recommended_capacity is not None
        and r.recommendation.recommended_capacity != r.configured_capacity
    ]
    if not changes:
        return "# every qualified provider's capacity matches its recommendation: nothing to change"
    out = ["# Change these capacities in the deployment file, then run `iop refresh FILE` (iop writes nothing):"]
    by_node: dict[str, list[Report]] = {}
    for r in changes:
        by_node.setdefault(r.node, []).append(r)
    out.append("nodes:")
    for node, rs in by_node.items():
        out += [f"  - id: {node}", "    providers:"]
        for r in rs:
            rec = r.recommendation
            out += [
                f"      - id: {r.provider}",
                f"        capacity: {rec.recommended_capacity}  # was {r.configured_capacity}: {rec.verdict}",
            ]
    return "\n".join(out)
