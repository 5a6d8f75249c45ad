"""The verdict of `iop smoke`: the checks, judged from /status and the client's outcomes, as a table or JSON."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from iop.contracts.status import PoolProviderStatus, Status
from iop.percentile import nearest_rank
from iop.smoke.burst import PATHS, BurstResult, Outcome
from iop.smoke.ready import Plan, describe_ready


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


@dataclass
class SmokeResult:
    """Everything smoke found; `checks` decide the exit code."""

    mode: str
    """`self-contained` (smoke started the deployment) or `edge` (a running deployment)."""
    edge: str
    config: str | None = None
    nats: str | None = None
    plan: Plan | None = None
    checks: list[Check] = field(default_factory=list)
    baseline: Status | None = None
    final: Status | None = None
    burst: BurstResult | None = None
    processes: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        return bool(self.checks) and all(c.ok for c in self.checks)

    def fail(self, name: str, detail: str) -> None:
        self.checks.append(Check(name, False, detail))


# --- judging ----------------------------------------------------------------------------------------


def _counts(status: Status | None) -> dict[str, tuple[int, int]]:
    if status is None:
        return {}
    return {pid: (p.served, p.failed) for pid, (_, p) in status.providers().items()}


def deltas(baseline: Status | None, final: Status | None) -> dict[str, tuple[int, int]]:
    """Served and failed per provider during the run (a node that restarted counts from 0 again)."""
    before, after = _counts(baseline), _counts(final)
    out = {}
    for pid, (served, failed) in after.items():
        s0, f0 = before.get(pid, (0, 0))
        out[pid] = (served - s0, failed - f0) if served >= s0 and failed >= f0 else (served, failed)
    return out


def unsettled(status: Status, plan: Plan, baseline: Status | None, burst: BurstResult) -> list[str]:
    """What still shows activity after the burst; [] once every count is back to 0 and fresh."""
    gaps: list[str] = []
    pool = status.pool(plan.model)
    if pool is not None:
        for count, what in (
            (pool.waiting, "requests still waiting"),
            (pool.running, "requests still running (counted at the edge)"),
            (pool.dispatched_in_flight, "slots still held by the edge"),
        ):
            if count:
                gaps.append(f"pool {plan.model}: {count} {what}")
    for pid, (node, p) in status.providers().items():
        if p.in_flight:
            gaps.append(f"provider {pid} on {node.id}: {p.in_flight} in flight")
    # Node counts travel in heartbeats: until they include every answer, the peaks are not final either.
    candidates = set(pool.candidates if pool is not None else [])
    served = sum(s for pid, (s, _) in deltas(baseline, status).items() if pid in candidates)
    answered = sum(1 for o in burst.pool if o.ok)
    if served < answered:
        gaps.append(f"the nodes have reported {served} of the {answered} answers the client received")
    return gaps


def judge(report: SmokeResult, settle_gaps: list[str], edge_log: list[str] | None = None) -> None:
    """Append every check of a run that got as far as the burst.

    `edge_log` (smoke's own edge only) explains provider failures the clients never saw.
    """
    plan, burst, final = report.plan, report.burst, report.final
    assert plan is not None and burst is not None and final is not None
    exact = report.mode == "self-contained"
    pool = final.pool(plan.model)
    total = pool.total_capacity if pool is not None else 0
    capacity = plan.expect_capacity if plan.expect_capacity is not None else total
    checks = report.checks

    failed = [o for o in burst.pool if not o.ok]
    if failed:
        checks.append(
            Check("answers", False, f"{len(failed)} of {len(burst.pool)} pool requests failed: " + _problems(failed))
        )
    else:
        checks.append(
            Check(
                "answers",
                True,
                f"{len(burst.pool)} of {len(burst.pool)} pool requests answered,"
                " each well-formed (chat and Responses, streamed and whole)",
            )
        )

    sat = burst.saturation
    if sat.seen:
        checks.append(
            Check(
                "saturated",
                True,
                f"the burst filled pool {plan.model}: {sat.running} slots taken,"
                f" {sat.waiting} waiting at +{sat.at_s:.2f}s",
            )
        )
    else:
        checks.append(
            Check(
                "saturated",
                False,
                f"pool {plan.model} never had waiting requests: the burst of"
                f" {plan.requests} did not exceed its free capacity",
            )
        )

    if plan.direct is not None:
        checks.append(_direct_check(plan.direct, burst))

    peak = pool.peak_running if pool is not None else 0
    since = "" if exact else " since the edge started"
    where = "counted at the edge from the nodes' Started messages"
    if peak > capacity:
        checks.append(
            Check(
                "pool peak",
                False,
                f"pool {plan.model} ran {peak} requests at once{since}, above its capacity {capacity} ({where})",
            )
        )
    elif exact and peak != capacity:
        checks.append(
            Check(
                "pool peak",
                False,
                f"pool {plan.model} ran at most {peak} requests at once, never its full capacity {capacity} ({where})",
            )
        )
    else:
        checks.append(
            Check(
                "pool peak",
                True,
                f"pool {plan.model} ran at most {peak} requests at once{since}, capacity {capacity} ({where})",
            )
        )
        if peak < capacity:
            report.notes.append(
                f"pool {plan.model} peaked at {peak} of {capacity}{since}: with real upstreams"
                " the peak depends on their speed and the load"
            )

    rows, over = [], []
    for pid, (_, p) in final.providers().items():
        if p.capacity is None:
            continue
        rows.append(f"{pid} {p.peak_in_flight}/{p.capacity}")
        if p.peak_in_flight > p.capacity:
            over.append(f"{pid} reached {p.peak_in_flight} with capacity {p.capacity}")
    measured = "measured on the nodes since they started or their capacity last changed"
    if over:
        checks.append(Check("provider peaks", False, "above capacity: " + "; ".join(over) + f" ({measured})"))
    else:
        checks.append(Check("provider peaks", True, "never above capacity: " + ", ".join(rows) + f" ({measured})"))

    checks.append(_provider_errors_check(report, edge_log or []))

    if settle_gaps:
        checks.append(Check("drained", False, "status did not return to idle: " + "; ".join(settle_gaps)))
    else:
        checks.append(Check("drained", True, "queue drained; waiting, running and in flight back to 0"))

    if exact:
        checks.append(_counted_check(report))


def _provider_errors_check(report: SmokeResult, edge_log: list[str]) -> Check:
    final = report.final
    d = deltas(report.baseline, final)
    found = []
    for pid, (node, p) in (final.providers() if final is not None else {}).items():
        failed = d.get(pid, (0, 0))[1]
        if not failed:
            continue
        text = f"{pid} on {node.id} failed {failed} requests"
        if isinstance(p, PoolProviderStatus) and p.breaker != "closed":
            text += f" (breaker {p.breaker})"
        # The edge logs why it took a request away from a provider; the node's own reason stays there.
        said = [line.split(": ", 1)[-1] for line in edge_log if f"provider {pid} " in line]
        if said:
            text += f"; edge log: {said[-1]}"
        found.append(text)
    if found:
        return Check(
            "provider errors",
            False,
            "; ".join(found) + " (a request that fails before its first byte is"
            " retried on another provider, so clients may not have seen these)",
        )
    return Check("provider errors", True, "no provider failed a request during the run")


def _direct_check(alias: str, burst: BurstResult) -> Check:
    d = burst.direct
    if d is None:
        return Check("direct route", False, f"no request was sent to {alias}")
    if not d.ok:
        return Check("direct route", False, f"{alias}: {d.problem}")
    # Had it queued behind the pool it would have started only after the last queued pool request.
    starts = [s for o in burst.pool if o.ok and (s := o.started_s) is not None]
    emptied = max(starts, default=0.0)
    started = d.started_s if d.started_s is not None else d.done_s
    if starts and started >= emptied:
        return Check(
            "direct route",
            False,
            f"{alias} started at +{started:.2f}s, after the pool's queue emptied"
            f" (+{emptied:.2f}s): it waited for the pool",
        )
    return Check(
        "direct route",
        True,
        f"{alias} answered in {d.latency_ms:.0f} ms while {burst.unanswered_at_direct}"
        f" pool requests were unanswered; the pool's queue emptied only at +{emptied:.2f}s",
    )


def _counted_check(report: SmokeResult) -> Check:
    plan, burst = report.plan, report.burst
    assert plan is not None and burst is not None
    pool = report.final.pool(plan.model) if report.final is not None else None
    d = deltas(report.baseline, report.final)
    served = sum(d.get(pid, (0, 0))[0] for pid in (pool.candidates if pool is not None else []))
    answered = sum(1 for o in burst.pool if o.ok)
    if served != answered:
        return Check(
            "counted", False, f"the providers served {served} pool requests, the client received {answered} answers"
        )
    return Check("counted", True, f"the providers served {served} pool requests, one per answer received")


def _problems(failed: list[Outcome], limit: int = 4) -> str:
    groups = Counter((o.problem, o.provider) for o in failed)
    parts = [
        f"{n}x {problem}" + (f" (provider {provider})" if provider else "")
        for (problem, provider), n in groups.most_common(limit)
    ]
    if len(groups) > limit:
        parts.append(f"and {len(groups) - limit} other kinds")
    return "; ".join(parts)


# --- figures ----------------------------------------------------------------------------------------


def _group_figures(label: str, endpoint: str, stream: bool | None, outcomes: list[Outcome]) -> dict[str, Any]:
    ok = [o for o in outcomes if o.ok]
    lat = [o.latency_ms for o in ok]
    queue = [o.queue_ms for o in ok if o.queue_ms is not None]
    return {
        "label": label,
        "endpoint": endpoint,
        "stream": stream,
        "requests": len(outcomes),
        "ok": len(ok),
        "failed": len(outcomes) - len(ok),
        "latency_ms": {"p50": _r(nearest_rank(lat, 0.50)), "p99": _r(nearest_rank(lat, 0.99))},
        "queue_ms": {"p50": _r(nearest_rank(queue, 0.50)), "p99": _r(nearest_rank(queue, 0.99))},
    }


def _r(v: float | None) -> float | None:
    return None if v is None else round(v, 1)


def request_groups(report: SmokeResult) -> list[dict[str, Any]]:
    burst = report.burst
    if burst is None or report.plan is None:
        return []
    groups = []
    for api, path in PATHS.items():
        for stream in (False, True):
            members = [o for o in burst.pool if o.api == api and o.stream == stream]
            if members:
                groups.append(_group_figures(report.plan.model, path, stream, members))
    groups.append(_group_figures(report.plan.model, "all", None, burst.pool))
    if burst.direct is not None:
        groups.append(_group_figures(burst.direct.alias, PATHS["chat"] + " (direct)", False, [burst.direct]))
    return groups


def provider_rows(report: SmokeResult) -> list[dict[str, Any]]:
    status = report.final or report.baseline
    if status is None:
        return []
    d = deltas(report.baseline, report.final) if report.final is not None else {}
    rows = []
    for n in status.nodes:
        for p in n.providers:
            served, failed = d.get(p.id, (0, 0))
            rows.append(
                {
                    "node": n.id,
                    "node_connected": n.connected,
                    "provider": p.id,
                    "kind": "pool" if isinstance(p, PoolProviderStatus) else "cli",
                    "capacity": p.capacity,
                    "peak_in_flight": p.peak_in_flight,
                    "served": served,
                    "failed": failed,
                }
            )
    return rows


def to_json(report: SmokeResult) -> dict[str, Any]:
    plan = report.plan
    status = report.final or report.baseline
    pool = status.pool(plan.model) if plan and status else None
    sat = report.burst.saturation if report.burst else None
    return {
        "ok": report.ok,
        "mode": report.mode,
        "config": report.config,
        "edge": report.edge,
        "nats": report.nats,
        "duration_s": round(report.duration_s, 2),
        "model": plan.model if plan else None,
        "direct": plan.direct if plan else None,
        "requests_sent": plan.requests if plan else 0,
        "providers": provider_rows(report),
        "peak_in_flight_since": "node start or the last capacity change",
        "pool": None
        if pool is None
        else {
            "alias": pool.alias,
            "candidates": pool.candidates,
            "connected_candidates": pool.connected_candidates,
            "total_capacity": pool.total_capacity,
            "connected_capacity": pool.connected_capacity,
            "peak_running": pool.peak_running,
            "max_waiting_seen": sat.max_waiting if sat else None,
            "waiting_at_end": pool.waiting,
            "running_at_end": pool.running,
        },
        "requests": request_groups(report),
        "checks": [{"name": c.name, "ok": c.ok, "detail": c.detail} for c in report.checks],
        "failed_checks": [c.name for c in report.checks if not c.ok],
        "notes": report.notes,
        "processes": report.processes,
    }


# --- text -------------------------------------------------------------------------------------------


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}" if v >= 10 else f"{v:.1f}"


def to_text(report: SmokeResult) -> str:
    verdict = "PASS" if report.ok else f"FAIL ({sum(not c.ok for c in report.checks)} checks failed)"
    what = f"self-contained run of {report.config}" if report.mode == "self-contained" else f"edge {report.edge}"
    out = [f"iop smoke: {verdict}: {what}, {report.duration_s:.1f}s"]
    if report.mode == "self-contained":
        started = ", ".join(
            f"{p['role']} (pid {p['pid']})" if p["role"] == p["name"] else f"{p['role']} {p['name']} (pid {p['pid']})"
            for p in report.processes
        )
        where = f"edge {report.edge}, nats {report.nats}" if report.edge else "the edge never listened"
        out.append(f"{where}; started and stopped: {started or 'nothing'}")

    rows = provider_rows(report)
    if rows:
        table = [["NODE", "PROVIDER", "KIND", "CAPACITY", "PEAK IN FLIGHT", "SERVED", "FAILED"]]
        last_node = None
        for r in rows:
            node = "" if r["node"] == last_node else r["node"] + ("" if r["node_connected"] else " (down)")
            last_node = r["node"]
            cap = "unlimited" if r["capacity"] is None else str(r["capacity"])
            table.append(
                [
                    node,
                    r["provider"],
                    r["kind"] or "",
                    cap,
                    str(r["peak_in_flight"]),
                    str(r["served"]),
                    str(r["failed"]),
                ]
            )
        out += [
            "",
            *_table(table),
            "(peak in flight: measured on each node since it started; served/failed: during this run)",
        ]

    status = report.final or report.baseline
    if report.plan is not None and status is not None and (pool := status.pool(report.plan.model)):
        sat = report.burst.saturation if report.burst else None
        table = [["POOL", "CANDIDATES", "CAPACITY", "PEAK RUNNING", "MOST WAITING SEEN", "WAITING NOW"]]
        table.append(
            [
                pool.alias,
                f"{pool.connected_candidates}/{len(pool.candidates)}",
                f"{pool.connected_capacity}/{pool.total_capacity}",
                str(pool.peak_running),
                str(sat.max_waiting) if sat and sat.samples else "-",
                str(pool.waiting),
            ]
        )
        out += ["", *_table(table)]

    groups = request_groups(report)
    if groups:
        table = [["MODEL", "ENDPOINT", "STREAM", "SENT", "OK", "LATENCY p50", "p99", "QUEUE WAIT p50", "p99"]]
        for g in groups:
            table.append(
                [
                    g["label"],
                    g["endpoint"],
                    "-" if g["stream"] is None else "yes" if g["stream"] else "no",
                    str(g["requests"]),
                    str(g["ok"]),
                    _ms(g["latency_ms"]["p50"]),
                    _ms(g["latency_ms"]["p99"]),
                    _ms(g["queue_ms"]["p50"]),
                    _ms(g["queue_ms"]["p99"]),
                ]
            )
        out += [
            "",
            *_table(table),
            "(milliseconds; latency measured by the client, queue wait reported by the edge in x-iop-queue-ms)",
        ]

    out += ["", "checks"]
    out += [f"  {'ok  ' if c.ok else 'FAIL'}  {c.name}: {c.detail}" for c in report.checks]
    out += [f"  note  {n}" for n in report.notes]
    failed = [c for c in report.checks if not c.ok]
    if failed:
        out += ["", "failed checks: " + ", ".join(c.name for c in failed)]
    return "\n".join(out)


def ready_check(status: Status, plan: Plan) -> Check:
    return Check("ready", True, describe_ready(status, plan))
