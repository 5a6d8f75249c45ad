"""`iop status`: the /status document as tables."""

from __future__ import annotations

import time

from iop.contracts.status import PoolProviderStatus, PoolStatus, StateCounts, Status, StatusSummary
from iop.wire import Device, ServerLive


def describe_device(d: Device) -> str:
    """One line: OS and arch, CPU, memory, accelerators, Python and iop versions."""
    gpus = ", ".join(
        f"{a.name} {a.memory_mb / 1024:.0f} GiB{' unified' if a.unified else ''}" if a.memory_mb else a.name
        for a in d.accelerators
    )
    return (
        f"{d.os} {d.arch}; {d.cpu_model} ({d.cpu_cores} cores); {d.memory_mb / 1024:.1f} GiB; "
        f"accelerators: {gpus or 'none'}; Python {d.python}; iop {d.iop}"
    )


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def _ago(since: float) -> str:
    """How long ago a wall-clock time was, for a table cell."""
    if not since:
        return "-"
    s = max(0.0, time.time() - since)
    return f"{s:.0f}s ago" if s < 120 else f"{s / 60:.0f}m ago"


def _ms(s: ServerLive) -> str:
    return f"{s.last_cold_start_ms / 1000:.1f}s" if s.last_cold_start_ms else "-"


def _pool_capacity(pool: PoolStatus) -> str:
    # Usable, not merely connected: a connected provider whose breaker is open takes no request.
    cap = f"{pool.usable_capacity}/{pool.total_capacity}"
    if pool.retry_after_s is not None:
        cap += f" (unavailable, retry in {pool.retry_after_s:.0f}s)"
    return cap


def render_status(status: Status) -> str:
    edge = status.edge
    out = [f"edge {edge.id} v{edge.version} up {edge.uptime_s:.0f}s nats={edge.nats}"]
    if edge.storage_error:
        out.append(f"error: pool requests cannot be queued: {edge.storage_error}")
    if edge.drift:
        out.append(
            f"warning: the running deployment differs from the edge's file ({len(edge.drift)} changes, "
            "undone by a restart or SIGHUP):"
        )
        out += [f"  {line}" for line in edge.drift]
    header = "NODE CONNECTED PROVIDER KIND TYPE CAPACITY IN-FLIGHT QUEUED PEAK SERVED FAILED"
    rows = [header.split()]
    for n in status.nodes:
        seen = n.last_seen_s_ago
        conn = ("yes" if n.connected else "no") + (f" ({seen:.1f}s)" if seen is not None else "")
        if n.legacy_concurrency is not None:
            conn += f" legacy-concurrency={n.legacy_concurrency}"
        if not n.providers:
            rows.append([n.id, conn, "-", "", "", "", "", "-", "", "", ""])
        for i, p in enumerate(n.providers):
            cap = "unlimited" if p.unlimited else str(p.capacity)
            queued = "-"
            if isinstance(p, PoolProviderStatus):
                queued = str(p.queued)
                if p.breaker in ("open", "half_open"):
                    cap += f" ({p.breaker.replace('_', '-')})"
                if p.drained:
                    cap += f" (drained: {p.drained})"
                elif p.qualifying:
                    cap += " (qualifying)"
            if p.refused:
                cap += f" (refused: {p.refused})"
            rows.append(
                [
                    n.id if i == 0 else "",
                    conn if i == 0 else "",
                    p.id,
                    "pool" if isinstance(p, PoolProviderStatus) else "cli",
                    p.type,
                    cap,
                    str(p.in_flight),
                    queued,
                    str(p.peak_in_flight),
                    str(p.served),
                    str(p.failed),
                ]
            )
    out += ["", _table(rows)]
    servers = [
        [p.id, s.state, _ago(s.since), s.group or "-", str(s.cold_starts), str(s.swaps), str(s.crashes), _ms(s)]
        for n in status.nodes
        for p in n.providers
        if isinstance(p, PoolProviderStatus) and (s := p.server) is not None
    ]
    if servers:
        head = ["SERVER", "STATE", "SINCE", "GROUP", "COLD-STARTS", "SWAPS", "CRASHES", "LAST-COLD-START"]
        out += ["", _table([head, *servers])]
    devices = [[n.id, describe_device(n.device)] for n in status.nodes if n.device is not None]
    if devices:
        out += ["", _table([["NODE", "DEVICE"], *devices])]
    qualified = [
        [p.id, str(q.configured_capacity or "-"), str(q.recommended_capacity or "-"), q.date, q.verdict]
        for n in status.nodes
        for p in n.providers
        if isinstance(p, PoolProviderStatus) and (q := p.qualification) is not None
    ]
    if qualified:
        out += ["", _table([["QUALIFIED", "CAPACITY", "RECOMMENDED", "DATE", "VERDICT"], *qualified])]
    if status.pools:
        prow = [["POOL", "CANDIDATES", "CONNECTED", "USABLE/TOTAL", "IN FLIGHT", "WAITING"]]
        for pool in status.pools:
            prow.append(
                [
                    pool.alias,
                    str(len(pool.candidates)),
                    str(pool.connected_candidates),
                    _pool_capacity(pool),
                    str(pool.in_flight),
                    str(pool.waiting),
                ]
            )
        out += ["", _table(prow)]
    if status.routes:
        rrow = [["ROUTE", "NODE", "RESOURCE", "CONNECTED"]]
        for r in status.routes:
            rrow.append([r.alias, r.node, r.resource, "yes" if r.connected else "no"])
        out += ["", _table(rrow)]
    return "\n".join(out)


def _states(counts: StateCounts) -> str:
    """`ready 280, full 17, breaker-open 3`: the states that have any, in the order of the struct."""
    parts = [f"{name.replace('_', '-')} {n}" for name in counts.__struct_fields__ if (n := getattr(counts, name))]
    return ", ".join(parts) or "none"


def render_summary(summary: StatusSummary) -> str:
    """`iop status --summary`: totals, pools, and only what is not healthy."""
    edge = summary.edge
    out = [f"edge {edge.id} v{edge.version} up {edge.uptime_s:.0f}s nats={edge.nats}"]
    if edge.storage_error:
        out.append(f"error: pool requests cannot be queued: {edge.storage_error}")
    if edge.drift:
        out.append(f"warning: the running deployment differs from the edge's file ({len(edge.drift)} changes)")
    out.append(
        f"nodes {summary.nodes_connected}/{summary.nodes} connected; capacity {summary.usable_capacity}/"
        f"{summary.total_capacity} usable; {summary.in_flight} in flight, {summary.waiting} waiting"
    )
    out.append(f"providers: {_states(summary.providers)}")
    if summary.cli_resources != StateCounts():
        out.append(f"CLI resources: {_states(summary.cli_resources)}")
    if summary.routes:
        out.append(f"routes: {summary.routes_connected}/{summary.routes} connected")
    if summary.pools:
        rows = [["POOL", "PROVIDERS", "USABLE/TOTAL", "IN FLIGHT", "WAITING", "WAIT P50 MS", "STATES"]]
        for pool in summary.pools:
            cap = f"{pool.usable_capacity}/{pool.total_capacity}"
            if pool.retry_after_s is not None:
                cap += f" (unavailable, retry in {pool.retry_after_s:.0f}s)"
            p50 = "-" if pool.queue_wait_p50_ms is None else f"{pool.queue_wait_p50_ms:g}"
            rows.append(
                [
                    pool.alias,
                    str(pool.providers),
                    cap,
                    str(pool.in_flight),
                    str(pool.waiting),
                    p50,
                    _states(pool.states),
                ]
            )
        out += ["", _table(rows)]
    if not summary.attention:
        out += ["", "every node connected, every provider healthy"]
        return "\n".join(out)
    rows = [["NODE", "CONNECTED", "PROVIDER", "STATE", "DETAIL"]]
    for n in summary.attention:
        seen = f" ({n.last_seen_s_ago:.1f}s)" if n.last_seen_s_ago is not None else ""
        conn = ("yes" if n.connected else "no") + seen
        if not n.unhealthy:
            rows.append([n.id, conn, f"all {n.providers}", "disconnected", ""])
        for i, p in enumerate(n.unhealthy):
            detail = p.refused or p.drained or ""
            if p.breaker_open_for_s is not None:
                detail = f"trial in {p.breaker_open_for_s:g}s, {p.consecutive_failures} failures"
            rows.append([n.id if i == 0 else "", conn if i == 0 else "", p.id, p.state.replace("_", "-"), detail])
    out += ["", _table(rows)]
    return "\n".join(out)
