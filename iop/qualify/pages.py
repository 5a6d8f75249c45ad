"""Reports for people: a Markdown summary and one self-contained HTML file with the curves as inline SVG."""

from __future__ import annotations

import html
from collections.abc import Callable

from iop.qualify.schema import Level, Report

_MARK = {"pass": "pass", "fail": "FAIL", "warn": "warn", "skip": "skip", "info": "info"}


def _f(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown(reports: list[Report]) -> str:
    out = ["# iop qualification", ""]
    for r in reports:
        rec = r.recommendation
        out += [
            f"## {r.provider} — {r.model} on {r.device.summary}",
            "",
            f"node `{r.node}`, alias `{r.alias}`, adapter {r.adapter_type}; {r.started} → {r.finished} "
            f"({r.duration_s:.0f} s{', exclusive' if r.exclusive else ''}{', quick' if r.quick else ''})",
            "",
            f"**{rec.verdict}**",
            "",
            f"configured capacity {rec.configured_capacity}, recommended {rec.recommended_capacity or '-'}, "
            f"peak {_f(rec.peak_throughput_tok_s, 1)} tok/s at {rec.peak_concurrency or '-'}, swept to {rec.swept_to}",
            "",
            "| check | group | result | detail |",
            "|---|---|---|---|",
        ]
        out += [f"| {c.id} | {c.group} | {_MARK[c.status]} | {c.reason.replace('|', '/')} |" for c in r.checks]
        if r.context_tokens is not None:
            out += ["", f"context window: {r.context_tokens} prompt tokens accepted"]
        out += [
            "",
            "| concurrency | ok/requests | tok/s (aggregate) | TTFT p50 ms | TTFT p95 ms | ITL p50 ms | TPOT p50 ms "
            "| E2E p50 ms | decode tok/s p50 |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        out += [
            f"| {lv.concurrency} | {lv.ok}/{lv.requests} | {lv.throughput_tok_s:.1f} | {_f(lv.ttft_ms_p50)} "
            f"| {_f(lv.ttft_ms_p95)} | {_f(lv.itl_ms_p50, 1)} | {_f(lv.tpot_ms_p50, 1)} | {_f(lv.e2e_ms_p50)} "
            f"| {_f(lv.decode_tok_s_p50, 1)} |"
            for lv in r.sweep
        ]
        out.append("")
    return "\n".join(out)


W, H, PAD = 420, 240, 44


def svg_chart(
    title: str, levels: list[Level], value: Callable[[Level], float | None], unit: str, marks: dict[int, str]
) -> str:
    """A line chart of `value` over concurrency; each point a <circle> carrying its data (tests read them)."""
    pts = [(lv.concurrency, v) for lv in levels if (v := value(lv)) is not None]
    e = html.escape
    head = (
        f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" data-title="{e(title)}" '
        f'width="{W}" height="{H}" viewBox="0 0 {W} {H}">'
    )
    parts = [head, f'<text x="{W / 2}" y="16" text-anchor="middle" font-size="13">{e(title)}</text>']
    if not pts:
        parts += [f'<text x="{W / 2}" y="{H / 2}" text-anchor="middle">no data</text>', "</svg>"]
        return "".join(parts)
    xmax = max(c for c, _ in pts)
    ymax = max(v for _, v in pts) * 1.1 or 1.0

    def x(c: float) -> float:
        return PAD + (c - 1) / max(xmax - 1, 1) * (W - 2 * PAD) if xmax > 1 else W / 2

    def y(v: float) -> float:
        return H - PAD - v / ymax * (H - 2 * PAD)

    parts.append(f'<line x1="{PAD}" y1="{H - PAD}" x2="{W - PAD}" y2="{H - PAD}" stroke="#888"/>')
    parts.append(f'<line x1="{PAD}" y1="{PAD}" x2="{PAD}" y2="{H - PAD}" stroke="#888"/>')
    parts.append(f'<text x="{W / 2}" y="{H - 8}" text-anchor="middle" font-size="11">concurrency</text>')
    parts.append(f'<text x="6" y="{PAD - 8}" font-size="11">{e(unit)} (max {ymax / 1.1:.1f})</text>')
    for c, label in marks.items():
        if 1 <= c <= xmax:
            parts.append(
                f'<line class="mark" data-mark="{e(label)}" x1="{x(c):.1f}" y1="{PAD}" x2="{x(c):.1f}" y2="{H - PAD}" '
                f'stroke="#c60" stroke-dasharray="4 3"/>'
                f'<text x="{x(c) + 3:.1f}" y="{PAD + 10}" font-size="10">{e(label)}</text>'
            )
    line = " ".join(f"{x(c):.1f},{y(v):.1f}" for c, v in pts)
    parts.append(f'<polyline fill="none" stroke="#2563eb" stroke-width="2" points="{line}"/>')
    for c, v in pts:
        parts.append(
            f'<circle class="point" data-concurrency="{c}" data-value="{v}" cx="{x(c):.1f}" cy="{y(v):.1f}" r="4" '
            f'fill="#2563eb"><title>{c}: {v:g} {e(unit)}</title></circle>'
        )
        parts.append(f'<text x="{x(c):.1f}" y="{H - PAD + 14}" text-anchor="middle" font-size="10">{c}</text>')
    parts.append("</svg>")
    return "".join(parts)


_STYLE = """body{font-family:system-ui,sans-serif;margin:2em;max-width:1000px}
table{border-collapse:collapse;margin:1em 0}
td,th{border:1px solid #ccc;padding:3px 8px;font-size:13px;text-align:left}.fail{color:#b00;font-weight:bold}
.pass{color:#070}.warn{color:#a60}.verdict{font-size:1.1em;font-weight:bold}.charts{display:flex;flex-wrap:wrap;gap:12px}"""


def html_report(reports: list[Report]) -> str:
    e = html.escape
    body = ["<h1>iop qualification</h1>"]
    for r in reports:
        rec = r.recommendation
        marks = {rec.configured_capacity: "configured"}
        if rec.recommended_capacity is not None:
            marks[rec.recommended_capacity] = (
                "recommended" if rec.recommended_capacity != rec.configured_capacity else "configured = recommended"
            )
        body += [
            f'<section class="provider" data-provider="{e(r.provider)}">',
            f"<h2>{e(r.provider)} — {e(r.model)} on {e(r.device.summary)}</h2>",
            f"<p>node {e(r.node)}, alias {e(r.alias)}, adapter {e(r.adapter_type)}; "
            f"{e(r.started)} → {e(r.finished)}</p>",
            f'<p class="verdict">{e(rec.verdict)}</p>',
            '<div class="charts">',
            svg_chart("aggregate output tokens/s", r.sweep, lambda lv: lv.throughput_tok_s, "tok/s", marks),
            svg_chart("TTFT p50", r.sweep, lambda lv: lv.ttft_ms_p50, "ms", marks),
            svg_chart("ITL p50", r.sweep, lambda lv: lv.itl_ms_p50, "ms", marks),
            "</div>",
            "<table><tr><th>check</th><th>group</th><th>result</th><th>detail</th></tr>",
        ]
        body += [
            f'<tr><td>{e(c.id)}</td><td>{c.group}</td><td class="{c.status}">{_MARK[c.status]}</td>'
            f"<td>{e(c.reason)}</td></tr>"
            for c in r.checks
        ]
        body.append(
            "</table><table><tr><th>concurrency</th><th>ok</th><th>tok/s</th><th>TTFT p50</th>"
            "<th>ITL p50</th><th>E2E p50</th></tr>"
        )
        body += [
            f"<tr><td>{lv.concurrency}</td><td>{lv.ok}/{lv.requests}</td><td>{lv.throughput_tok_s:.1f}</td>"
            f"<td>{_f(lv.ttft_ms_p50)}</td><td>{_f(lv.itl_ms_p50, 1)}</td><td>{_f(lv.e2e_ms_p50)}</td></tr>"
            for lv in r.sweep
        ]
        body.append("</table></section>")
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8"><title>iop qualification</title>'
        f"<style>{_STYLE}</style></head><body>{''.join(body)}</body></html>\n"
    )
