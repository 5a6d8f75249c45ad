"""The tables a run prints, and every target of issue #19 (issue #7's, tightened) judged PASS or MISS."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Any

LITELLM = {
    "added_p50_c1_ms": 12.8,
    "added_p99_c1_ms": 19.0,
    "added_p50_c32_ms": 318.0,
    "rps_c1": 74.0,
    "rps_c32": 93.0,
    "cpu_s_per_1k": 13.0,
}
"""The shared yardstick's figures for LiteLLM proxy (one worker) on this machine, from the issue."""


@dataclass
class Target:
    name: str
    goal: str
    value: float | None
    unit: str
    passed: bool | None
    gap: str

    def row(self) -> list[str]:
        shown = "n/a" if self.value is None else f"{self.value:g} {self.unit}".strip()
        verdict = "n/a" if self.passed is None else ("PASS" if self.passed else "MISS")
        return [self.name, self.goal, shown, verdict, self.gap]


def at_most(name: str, value: float | None, limit: float, unit: str) -> Target:
    if value is None:
        return Target(name, f"<= {limit:g} {unit}", None, unit, None, "not measured")
    ok = value <= limit
    times = f" ({value / limit:.1f}x the goal)" if limit > 0 else ""
    gap = "" if ok else f"{value - limit:+.3g} {unit} over{times}"
    return Target(name, f"<= {limit:g} {unit}", round(value, 3), unit, ok, gap)


def at_least(name: str, value: float | None, floor: float, unit: str) -> Target:
    if value is None:
        return Target(name, f">= {floor:g} {unit}", None, unit, None, "not measured")
    ok = value >= floor
    gap = "" if ok else f"{floor - value:.3g} {unit} short ({100 * value / floor:.0f}% of the goal)"
    return Target(name, f">= {floor:g} {unit}", round(value, 4), unit, ok, gap)


def _cell(ab: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((c for c in ab.get("cells", []) if c["cell"] == name), None)


def _med(d: dict[str, Any] | None, *path: str) -> float | None:
    v: Any = d
    for k in path:
        v = v.get(k) if isinstance(v, dict) else None
    return v.get("median") if isinstance(v, dict) else None


def targets(result: dict[str, Any]) -> list[Target]:
    sc = result.get("scenarios", {})
    ab = sc.get("ab", {})
    out: list[Target] = []
    tc = sc.get("tracing")
    if tc:
        out.append(at_most("tracing at 10 %: added CPU per request", tc["cost"]["10%"]["added_us"], 30.0, "us"))
    ch = next(
        (
            r
            for r in (sc.get("chain") or {}).get("lengths", [])
            if r["turns"] == 50 and r.get("cache", "warm") == "warm"
        ),
        None,
    )
    if ch:
        out.append(at_most("50-turn chain expansion p50", ch["wall_p50_ms"], 1.0, "ms"))
    wt = sc.get("wsturns")
    if wt:
        # Issue 30: a WebSocket-mode turn adds no more than the same turn over HTTP.
        http, ws = wt["added_p50_ms"]["http"], wt["added_p50_ms"]["ws"]
        out.append(at_most("WebSocket turn added p50, against HTTP's", ws, http, "ms"))
    for api in ("chat", "responses"):
        c1 = _cell(ab, f"{api}/nonstream/c1")
        if c1:
            out.append(at_most(f"added p50, c=1, {api}", _med(c1, "added_p50_ms"), 1.0, "ms"))
            out.append(at_most(f"added p99, c=1, {api}", _med(c1, "added_p99_ms"), 3.0, "ms"))
    for api in ("chat", "responses"):
        s1 = _cell(ab, f"{api}/stream/c1")
        if s1:
            out.append(at_most(f"added first byte p50, c=1 stream, {api}", _med(s1, "added_ttfb_p50_ms"), 1.2, "ms"))
    for api in ("chat", "responses"):
        c32 = _cell(ab, f"{api}/nonstream/c32")
        if c32:
            out.append(at_least(f"req/s at c=32, {api}", _med(c32, "iop_rps"), 2500, "req/s"))
    c32 = _cell(ab, "chat/nonstream/c32") or _cell(ab, "responses/nonstream/c32")
    if c32:
        cpu = _med(c32, "cpu_s_per_1k", "edge+node+nats")
        out.append(at_most("CPU-s per 1k req, edge+node+nats", cpu, 0.6, "s"))
    # Issue 30: against the floor measured in the same rounds.
    c1, c32 = _cell(ab, "chat/nonstream/c1"), _cell(ab, "chat/nonstream/c32")
    if c1 and c1.get("floor"):
        out.append(at_most("c=1 chat: added p50 above the floor's p50", _med(c1, "floor", "above_p50_ms"), 0.3, "ms"))
        margin = _med(c1, "floor", "p99_margin_ms")
        out.append(at_most("c=1 chat: added p99 - (2 x floor p99 + 1 ms)", margin, 0.0, "ms"))
    if c32 and c32.get("floor"):
        share = _med(c32, "floor", "rps_share")
        out.append(at_least("c=32 chat req/s, share of the floor's", None if share is None else 100 * share, 40.0, "%"))
        out.append(at_most("c=32 chat CPU-ms per request, edge+node+nats", cpu, 0.45, "ms"))
    for c in ab.get("cells", []):
        if c["kind"] == "relay":
            out.append(at_least(f"chunks/s, {c['cell']}", _med(c, "iop_events_per_s"), 20_000, "chunks/s"))
    cap = sc.get("capacity")
    if cap:
        over = cap["over_cap_events"]
        out.append(Target("over-cap events", "0", over, "", over == 0, "" if over == 0 else f"{over} over"))
        u = cap.get("utilisation")
        out.append(at_least("slot utilisation while work waits", None if u is None else round(100 * u, 2), 98.0, "%"))
    aff = ((sc.get("affinity") or {}).get("runs") or {}).get("on")
    if aff:
        warm = aff.get("warm_rate")
        out.append(
            at_least("warm turns with prefix-cache affinity", None if warm is None else round(100 * warm, 1), 90.0, "%")
        )
    fair = ((sc.get("fairness") or {}).get("runs") or {}).get("fair")
    if fair:
        # Issue 26: the quiet tenant waits at most one service time while the pool stays busy.
        wait, u = (fair.get("quiet_queue_wait_ms") or {}).get("p99"), fair.get("utilisation")
        out.append(at_most("quiet tenant's p99 queue wait beside a flooder", wait, sc["fairness"]["service_ms"], "ms"))
        out.append(at_least("slot utilisation with fair queueing", None if u is None else round(100 * u, 2), 97.0, "%"))
    adm = ((sc.get("fairness") or {}).get("admission") or {}).get("1000")
    if adm:
        # Issue 30: a request's admission (its key, its tenant, the fair queue) with 1,000 tenants.
        out.append(at_most("admission CPU per request, 1,000 tenants, pool saturated", adm["admission_us"], 20.0, "us"))
    for c in (sc.get("bodies") or {}).get("cells", []):
        goal = {800_000: 3.0, 3_000_000: 8.0}.get(c["bytes_asked"])
        if goal is not None:
            out.append(at_most(f"added p50, {c['cell']}", c["added_p50_ms"], goal, "ms"))
    levels = (sc.get("scale") or {}).get("levels") or []
    if len(levels) >= 2:
        lo, hi = levels[0], levels[-1]
        span = f"{lo['providers']}->{hi['providers']} providers"
        d_lo, d_hi = _med(lo, "dispatch_p50_ms"), _med(hi, "dispatch_p50_ms")
        if d_lo and d_hi:
            out.append(at_most(f"dispatch p50 growth, {span}", round(d_hi / d_lo, 2), 2.0, "x"))
        if lo.get("summary_ms_p50") and hi.get("summary_ms_p50"):
            # Issue 19's target is the summary view's; the full document grows with the catalog by design.
            ratio = round(hi["summary_ms_p50"] / lo["summary_ms_p50"], 2)
            out.append(at_most(f"/status?view=summary time growth, {span}", ratio, 2.0, "x"))
        elif lo["status_ms_p50"] and hi["status_ms_p50"]:
            out.append(
                at_most(f"/status time growth, {span}", round(hi["status_ms_p50"] / lo["status_ms_p50"], 2), 2.0, "x")
            )
        s_lo, s_hi = lo["status_us_per_provider"], hi["status_us_per_provider"]
        if s_lo and s_hi:
            out.append(at_most(f"/status time per provider growth, {span}", round(s_hi / s_lo, 2), 2.0, "x"))
    return out


# --- tables -----------------------------------------------------------------------------------------


def table(header: list[str], rows: list[list[str]]) -> str:
    """A Markdown table (it also reads well in a terminal)."""
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *(line(r) for r in rows)])


def fmt(s: dict[str, Any] | None, digits: int = 2) -> str:
    """median [min..max] of a spread()."""
    if not s:
        return "n/a"
    if s.get("n", 1) <= 1:
        return f"{s['median']:.{digits}f}"
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}..{s['max']:.{digits}f}]"


def _num(v: float | None, digits: int = 2) -> str:
    return "n/a" if v is None else f"{v:.{digits}f}"


def render(result: dict[str, Any]) -> str:
    sc = result.get("scenarios", {})
    meta = result.get("meta", {})
    parts: list[str] = []
    m = meta.get("machine", {})
    g = meta.get("git", {})
    dirty = f" + uncommitted changes in {len(g.get('iop_dirty', []))} iop files" if g.get("iop_dirty") else ""
    parts.append(
        f"iop benchmarks, {meta.get('started', '?')}: {m.get('nproc')} x {m.get('cpu_model')},"
        f" Python {m.get('python')};"
        f" iop at {g.get('commit')}{dirty}; storage {meta.get('options', {}).get('storage')},"
        f" event loop {meta.get('options', {}).get('loop')};"
        f" load average {meta.get('loadavg_start')} -> {meta.get('loadavg_end')}"
    )
    ab = sc.get("ab") or {}
    lat = [c for c in ab.get("cells", []) if c["kind"] == "latency"]
    if lat:
        rows = []
        for c in lat:
            rows.append(
                [
                    c["cell"],
                    fmt(c["direct_p50_ms"], 3),
                    fmt(c["iop_p50_ms"]),
                    fmt(c["added_p50_ms"]),
                    fmt(c["added_p99_ms"]),
                    fmt(c.get("added_ttfb_p50_ms")) if c["stream"] else "",
                    fmt(c["direct_rps"], 0),
                    fmt(c["iop_rps"], 0),
                    fmt(c["cpu_s_per_1k"]["edge+node"]),
                    fmt(c["other_cores_iop_arm"]),
                ]
            )
        parts.append(
            "Added latency and throughput (ms; median over rounds [min..max]; added = iop - direct, paired per round)\n"
            + table(
                [
                    "cell",
                    "direct p50",
                    "iop p50",
                    "added p50",
                    "added p99",
                    "added TTFB p50",
                    "direct req/s",
                    "iop req/s",
                    "edge+node CPU-s/1k",
                    "foreign cores",
                ],
                rows,
            )
        )
    budget = [c for c in lat if c["concurrency"] > 1]
    if budget:
        ncpu = int(meta.get("machine", {}).get("nproc") or 2)
        rows = []
        for c in budget:
            per = cpu_per_request(c)
            total = sum(per.values())
            rows.append(
                [
                    c["cell"],
                    fmt(c["iop_rps"], 0),
                    *(f"{per[k]:.3f}" for k in PROCESSES),
                    f"{total:.3f}",
                    f"{1000 * ncpu / total:.0f}" if total else "n/a",
                    fmt(c["other_cores_iop_arm"]),
                ]
            )
        parts.append(
            f"Throughput and CPU per request (ms, medians over rounds) of every process on the path; the ceiling is"
            f" {ncpu} idle cores divided by the total\n"
            + table(
                ["cell", "iop req/s", *PROCESSES, "total", "ceiling req/s", "foreign cores"],
                rows,
            )
        )
    floored = [c for c in lat if c.get("floor")]
    if floored:
        rows = [
            [
                c["cell"],
                fmt(c["floor"]["p50_ms"]),
                fmt(c["added_p50_ms"]),
                fmt(c["floor"]["above_p50_ms"]),
                fmt(c["floor"]["p99_ms"]),
                fmt(c["added_p99_ms"]),
                fmt(c["floor"]["p99_margin_ms"]),
                fmt(c["floor"]["rps"], 0),
                fmt(c["floor"]["rps_share"], 2),
                fmt(c["floor"]["cpu_ms"]),
                fmt(c["floor"]["cpu_ratio"], 2),
            ]
            for c in floored
        ]
        parts.append(
            "Against the floor of the same rounds (bench/floor.py; ms; paired per round, median [min..max]):"
            " above = iop's added p50 - the floor's p50; p99 margin = iop's added p99 - (2 x the floor's p99 + 1);"
            " share = iop req/s / the floor's; CPU = edge+node+nats per request / the floor's client+worker+nats\n"
            + table(
                [
                    "cell",
                    "floor p50",
                    "added p50",
                    "above floor",
                    "floor p99",
                    "added p99",
                    "p99 margin",
                    "floor req/s",
                    "share",
                    "floor CPU-ms",
                    "CPU x floor",
                ],
                rows,
            )
        )
    relay = [c for c in ab.get("cells", []) if c["kind"] == "relay"]
    if relay:
        rows = [
            [
                c["cell"],
                fmt(c["direct_events_per_s"], 0),
                fmt(c["iop_events_per_s"], 0),
                fmt(c["events_per_answer"], 0),
                fmt(c["iop_reads_per_answer"], 0),
                fmt(c["iop_ttfb_p50_ms"]),
                fmt(c["cpu_s_per_1k"]["edge+node"], 1),
            ]
            for c in relay
        ]
        parts.append(
            "Streaming relay (SSE events/s received by the client)\n"
            + table(
                [
                    "cell",
                    "direct events/s",
                    "iop events/s",
                    "events/answer",
                    "client reads/answer (iop)",
                    "iop TTFB p50 ms",
                    "edge+node CPU-s per 1k answers",
                ],
                rows,
            )
        )
    cap = sc.get("capacity")
    if cap:
        q = cap.get("queue_wait_ms") or {}
        rows = [
            ["requests (completed / errors)", f"{cap['completed']} / {sum(cap['errors'].values())}"],
            ["upstream latency, streams", f"{cap['latency']} ms (seed {cap['seed']}), {cap['streams']}"],
            ["client connections", str(cap["concurrency"])],
            ["over-cap events", str(cap["over_cap_events"])],
            [
                "peak in flight per provider",
                ", ".join(f"{p['peak_in_flight']}/{p['capacity']}" for p in cap["providers"]),
            ],
            ["served per provider", ", ".join(str(p["served"]) for p in cap["providers"])],
            ["slot utilisation while work waits", _pct(cap.get("utilisation"))],
            ["per provider", ", ".join(_pct(p["utilisation"]) for p in cap["providers"])],
            ["time all slots busy at once", _pct(cap.get("all_busy_fraction"))],
            ["idle slot time per handover (mean)", f"{_num(cap.get('idle_gap_ms'))} ms"],
            [
                "handover gap p50 / p90 / p99",
                " / ".join(_num((cap.get("handover_gap_ms") or {}).get(k)) for k in ("p50", "p90", "p99")) + " ms",
            ],
            ["queue wait p50 / p99 (x-iop-queue-ms)", f"{_num(q.get('p50'), 1)} / {_num(q.get('p99'), 1)} ms"],
            ["throughput", f"{cap['rps']:.1f} req/s over {cap['window_s']} s of waiting work"],
        ]
        parts.append("Capacity fidelity: one pool, capacities 2, 4, 4\n" + table(["figure", "value"], rows))
    scale = sc.get("scale")
    if scale and scale.get("levels"):
        rows = [
            [
                str(lv["providers"]),
                f"{lv['nodes_connected']}/{lv['nodes']}",
                fmt(lv["dispatch_p50_ms"]),
                fmt(lv["dispatch_p99_ms"]),
                fmt(lv.get("one_node_p50_ms")),
                _num(lv["status_ms_p50"]),
                str(lv["status_bytes"]),
                _num(lv["status_us_per_provider"], 1),
                _num(lv.get("summary_ms_p50")),
                str(lv.get("summary_bytes", "")),
                _num(lv.get("models_ms_p50")),
                " / ".join(_num(v) for v in (lv.get("idle_cores") or {}).values()),
            ]
            for lv in scale["levels"]
        ]
        parts.append(
            "Scale (simulated nodes, 3 mock providers each; c=1 through the edge)\n"
            + table(
                [
                    "providers",
                    "nodes connected",
                    "dispatch p50 ms (all)",
                    "dispatch p99 ms (all)",
                    "p50 ms, one node's pool",
                    "/status ms",
                    "/status bytes",
                    "/status us per provider",
                    "summary ms",
                    "summary bytes",
                    "/v1/models ms",
                    "idle cores edge / sim / nats",
                ],
                rows,
            )
        )
    mem = sc.get("memory")
    if mem:
        parts.append(
            "Edge memory per waiting request\n"
            + table(
                [
                    "waiting",
                    "edge RSS idle MB",
                    "with them MB",
                    "after release MB",
                    "bytes per waiting request",
                    "/status ms while full",
                ],
                [
                    [
                        str(mem["waiting"]),
                        _num(mem["edge_rss_idle_mb"], 1),
                        _num(mem["edge_rss_full_mb"], 1),
                        _num(mem["edge_rss_after_release_mb"], 1),
                        str(mem["bytes_per_waiting"]),
                        _num(mem["status_ms_while_full"], 1),
                    ]
                ],
            )
        )
    aff = sc.get("affinity")
    if aff and aff.get("runs"):
        rows = [
            [
                name,
                r["alias"],
                "yes" if r["session_key"] else "no",
                str(r["requests"]),
                _pct(r["warm_rate"]),
                _pct(r["cached_token_rate"]),
                _num((r["ttft_ms"] or {}).get("mean"), 1),
                _num((r["ttft_ms"] or {}).get("p90"), 1),
                f"{r['affinity_hits']} / {r['affinity_misses']}",
                ", ".join(str(v) for v in r["per_provider"].values()),
                _num(r["wall_s"], 1),
            ]
            for name, r in aff["runs"].items()
        ]
        parts.append(
            f"Prefix-cache affinity: {aff['sessions']} sessions x {aff['turns']} turns, pool 2/4/4, "
            f"cache {aff['cache_tokens_per_provider']} tokens per provider, "
            f"on_wait: affinity_wait_ms {aff['wait_ms']:g}\n"
            + table(
                [
                    "run",
                    "alias",
                    "session key",
                    "requests",
                    "warm turns",
                    "cached tokens",
                    "TTFT mean ms",
                    "TTFT p90 ms",
                    "affinity hits / misses",
                    "requests per provider",
                    "wall s",
                ],
                rows,
            )
        )
    if sc.get("fairness", {}).get("runs"):
        parts.append(render_fairness(sc["fairness"]))
    bodies = sc.get("bodies")
    if bodies:
        parts.append(render_bodies(bodies))
    st = sc.get("startup")
    if st:
        parts.append(
            f"Start-up to the first served request (edge + node + mock; archive {st['archive_mb']} MB)\n"
            + table(
                ["start", "seconds"],
                [
                    ["archive, first start (empty IOP_CACHE_DIR)", fmt(st["first_start_s"])],
                    ["archive, warm start", fmt(st["warm_start_s"])],
                    ["source tree (python -m iop)", fmt(st["source_start_s"])],
                ],
            )
        )
    lc = sc.get("lifecycle")
    if lc:
        parts.append(
            f"Model servers the node runs (fake servers loading {lc['load_s']:g} s, one group of size 1)\n"
            + table(
                ["request", "seconds", "of which the server's own start"],
                [
                    ["cold start (server stopped)", _num(lc["cold_start_s"]), _num(lc["cold_server_ready_s"])],
                    ["warm", fmt(lc["warm_s"], 4), "-"],
                    ["swap (drain + stop one, start the other)", fmt(lc["swap_s"]), "-"],
                    ["iop's share of a swap", fmt(lc["swap_iop_share_s"], 3), "-"],
                ],
            )
            + f"\ncold starts {lc['cold_starts_counted']}, swaps {lc['swaps_counted']}, "
            f"server processes left after the node's SIGTERM: {lc['orphans_after_node_sigterm']}"
        )
    if sc.get("chain"):
        from bench.chain import render_chain  # here: bench.chain imports this module

        parts.append(render_chain(sc["chain"]))
    wt = sc.get("wsturns")
    if wt:
        parts.append(
            f"One agent session of {wt['turns']} turns ({wt['output_bytes']} B of tool output each, streamed"
            f" answers), {wt['rounds']} rounds; ms per turn, added = the arm - direct for the same turn\n"
            + table(
                ["arm", "turn p50 (rounds)", "added p50", "added p90", "added p50, last quarter of turns"],
                [["direct", fmt(wt["turn_p50_ms"]["direct"]), "-", "-", "-"]]
                + [
                    [
                        {"http": "HTTP through iop", "ws": "WebSocket through iop"}[arm],
                        fmt(wt["turn_p50_ms"][arm]),
                        _num(wt["added_p50_ms"][arm], 3),
                        _num(wt["added_p90_ms"][arm], 3),
                        _num(wt["added_late_p50_ms"][arm], 3),
                    ]
                    for arm in ("http", "ws")
                ],
            )
            + (
                f"\nWebSocket - HTTP, the same turn of the same round: p50 {_num(wt['ws_minus_http_p50_ms'], 3)} ms"
                if "ws_minus_http_p50_ms" in wt
                else ""
            )
            + f"\nthe edge's CPU per turn (us, all rounds): HTTP {wt['edge_cpu_us_per_turn']['http']},"
            f" WebSocket {wt['edge_cpu_us_per_turn']['ws']}; foreign cores {fmt(wt['foreign_cores'])}"
        )
    tc = sc.get("tracing")
    if tc:
        parts.append(
            f"Traces: edge + node CPU per request (chat, c={tc['concurrency']}), against tracing off\n"
            + table(
                ["tracing", "CPU us/request", "edge", "node", "added us", "req/s", "p50 ms", "foreign cores"],
                [
                    [
                        arm,
                        _num(v["cpu_us_per_request"], 0),
                        _num(v["edge_us"], 0),
                        _num(v["node_us"], 0),
                        _num(v["added_us"], 1),
                        _num(v["rps"], 0),
                        _num(v["p50_ms"], 3),
                        _num(v["foreign_cores"], 2),
                    ]
                    for arm, v in tc["arms"].items()
                ],
            )
            + "\nthe spans alone, in process (edge and node spans of a pool request, their export), CPU us/request: "
            + ", ".join(f"{arm} {v['cpu_us_per_request']:.1f} (+{v['added_us']:.1f})" for arm, v in tc["cost"].items())
        )
    beside = litellm_rows(ab)
    if beside:
        parts.append(
            "Beside LiteLLM proxy (one worker), the yardstick's figures on this machine as quoted in issue #7\n"
            + table(["figure", "LiteLLM", "iop"], beside)
        )
    ts = [Target(**t) for t in result.get("targets", [])]
    if ts:
        parts.append("Targets\n" + table(["target", "goal", "measured", "verdict", "gap"], [t.row() for t in ts]))
    return "\n\n".join(parts)


def _size(n: int) -> str:
    return f"{n / 1_000_000:g} MB" if n >= 1_000_000 else f"{n // 1000} KB"


def render_fairness(fr: dict[str, Any]) -> str:
    def ms(d: dict[str, float] | None, k: str) -> str:
        return "n/a" if not d else f"{d[k]:.1f}"

    rows = [
        [name, str(r["quiet_requests"])]
        + [ms(r[f], k) for f in ("quiet_queue_wait_ms", "quiet_ttft_ms") for k in ("p50", "p99")]
        + [_num(r["flood_rps"], 1), _pct(r["utilisation"]), str(r["errors"]), _num(r["other_cores"], 2)]
        for name, r in fr["runs"].items()
    ]
    for r in rows:
        gaps = fr["runs"][r[0]].get("handover_gap_ms")
        r.insert(-2, "n/a" if not gaps else f"{gaps['p50']:.1f} / {gaps['p99']:.1f}")
    head = ["run", "quiet reqs", "quiet wait p50 ms", "quiet wait p99 ms", "quiet TTFT p50 ms", "quiet TTFT p99 ms"]
    out = (
        f"Fairness: pool capacity {fr['capacity']}, {fr['service_ms']:g} ms answers; a flooder sends "
        f"{fr['flood_requests']} requests at {fr['flood_rate_per_s']:g}/s, a quiet tenant one at a time\n"
        + table([*head, "flooder req/s", "utilisation", "handover p50 / p99 ms", "errors", "other cores"], rows)
    )
    adm = fr.get("admission") or {}
    if adm:
        parts = ["key_us", "queued_us", "python_gc_us", "grant_us", "floor_us", "free_us", "admission_us"]
        parts += ["limits_one_us", "limits_burst_us", "other_cores"]
        out += "\nAdmission CPU per request in one process (us; queued: against the asyncio floor)\n" + table(
            ["tenants", *parts], [[n, *(_num(a.get(k), 2) for k in parts)] for n, a in adm.items()]
        )
    return out


def render_bodies(bodies: dict[str, Any]) -> str:
    rows = [
        [
            c["cell"],
            _num(c["direct_p50_ms"]),
            _num(c["iop_p50_ms"]),
            _num(c["added_p50_ms"]),
            _num(c["added_p90_ms"]),
            _num(c.get("floor_p50_ms")),
            _num(c.get("above_floor_p50_ms")),
            " / ".join(_num(c["cpu_ms_per_request"][k]) for k in ("edge", "node", "nats")),
            _num(c["other_cores"]),
        ]
        for c in bodies.get("cells", [])
    ]
    out = "Agent-sized bodies, c=1, a connection per request, arms interleaved (ms)\n" + table(
        [
            "cell",
            "direct p50",
            "iop p50",
            "added p50",
            "added p90",
            "floor p50",
            "above floor",
            "CPU-ms edge / node / nats",
            "foreign cores",
        ],
        rows,
    )
    floors = bodies.get("floor") or {}
    if floors:
        out += (
            "\n\nThe floor: publish to a work-queue stream, a pull consumer answers on core NATS (ms, CPU-ms)\n"
            + table(
                ["body", "p50", "p99", "CPU-ms client+worker", "CPU-ms nats"],
                [
                    [
                        _size(int(name)),
                        _num(f["latency_ms"]["p50"]),
                        _num(f["latency_ms"]["p99"]),
                        _num(f.get("cpu_ms_per_request", {}).get("client+worker")),
                        _num(f.get("cpu_ms_per_request", {}).get("nats")),
                    ]
                    for name, f in floors.items()
                ],
            )
        )
    waits = bodies.get("waiting") or []
    if waits:
        out += "\n\nRequests waiting on a saturated pool\n" + table(
            ["body", "sent", "waiting", "refused 503", "budget MiB", "edge RSS idle / full / after MB", "nats MB"],
            [
                [
                    _size(w["size"]),
                    str(w["sent"]),
                    str(w["waiting"]),
                    str(w["refused_503"]),
                    str(w["budget_mib"]),
                    f"{w['edge_rss_idle_mb']} / {w['edge_rss_full_mb']} / {w['edge_rss_after_mb']}",
                    str(w["nats_rss_mb"]),
                ]
                for w in waits
            ],
        )
    return out


PROCESSES = ("edge", "node", "nats", "upstream", "client")


def cpu_per_request(cell: dict[str, Any]) -> dict[str, float]:
    """Median over rounds of each process's CPU milliseconds per request in the iop arm."""
    out = {}
    for k in PROCESSES:
        vals = [1000 * r["iop"]["cpu_s"].get(k, 0.0) / r["iop"]["count"] for r in cell["runs"] if r["iop"]["count"]]
        out[k] = statistics.median(vals) if vals else 0.0
    return out


def litellm_rows(ab: dict[str, Any]) -> list[list[str]]:
    c1, c32 = _cell(ab, "chat/nonstream/c1"), _cell(ab, "chat/nonstream/c32")
    if not c1 or not c32:
        return []
    return [
        ["added p50, c=1 (ms)", f"{LITELLM['added_p50_c1_ms']:g}", fmt(c1["added_p50_ms"])],
        ["added p99, c=1 (ms)", f"{LITELLM['added_p99_c1_ms']:g}", fmt(c1["added_p99_ms"])],
        ["added p50, c=32 (ms)", f"{LITELLM['added_p50_c32_ms']:g}", fmt(c32["added_p50_ms"])],
        ["req/s, c=1", f"{LITELLM['rps_c1']:g}", fmt(c1["iop_rps"], 0)],
        ["req/s, c=32", f"{LITELLM['rps_c32']:g}", fmt(c32["iop_rps"], 0)],
        [
            "gateway CPU-s per 1,000 requests, c=32",
            f"{LITELLM['cpu_s_per_1k']:g}",
            fmt(c32["cpu_s_per_1k"]["edge+node"]),
        ],
    ]


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{100 * v:.2f} %"


def judge(result: dict[str, Any]) -> None:
    """Add the targets to the result (JSON-ready)."""
    result["targets"] = [asdict(t) for t in targets(result)]
