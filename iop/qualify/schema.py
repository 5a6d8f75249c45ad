"""The qualification report as Structs: one document per provider x device x model (schema `iop.qualify/1`).

The schema is stable: fields are only ever added, each with a default, so a reader of version 1
reads every later document. docs/qualification.md describes every field.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from iop.contracts.status import QualificationSummary

SCHEMA = "iop.qualify/1"

CheckStatus = Literal["pass", "fail", "warn", "skip", "info"]
"""pass/fail: the provider did or did not do what the check asks; warn: it answered, but not in a
way the check can call right or wrong; skip: not run (an earlier failure or an option); info: a fact."""


Group = Literal["protocol", "capability"]


class Check(msgspec.Struct, kw_only=True):
    """One probe: what was asked and what came back, with the reason when it is not a pass."""

    id: str
    group: Group
    status: CheckStatus
    reason: str = ""
    duration_ms: float = 0.0


class Level(msgspec.Struct, kw_only=True):
    """One concurrency level of the sweep: `concurrency` streams kept in flight for `requests` requests.

    Latencies are from the qualifier's send to what it received (through the edge and the node):
    TTFT = time to the first content token; ITL = mean gap between tokens after the first
    ((end - first token) / (tokens - 1)); TPOT = end-to-end time per output token, first token
    included (end / tokens); E2E = whole request. p50/p95 over the level's requests.
    """

    concurrency: int
    requests: int
    ok: int
    errors: int
    output_tokens: int
    """Completion tokens of the level's successful requests, from each answer's usage."""
    wall_s: float
    throughput_tok_s: float
    """Aggregate output tokens per second: `output_tokens / wall_s`."""
    ttft_ms_p50: float | None = None
    ttft_ms_p95: float | None = None
    itl_ms_p50: float | None = None
    tpot_ms_p50: float | None = None
    e2e_ms_p50: float | None = None
    e2e_ms_p95: float | None = None
    decode_tok_s_p50: float | None = None
    """Per request: tokens after the first / (end - first token)."""
    usage_missing: int = 0
    """Successful requests whose stream reported no usage (their tokens were counted from the chunks)."""
    first_error: str = ""


class Recommendation(msgspec.Struct, kw_only=True):
    """The knee of the curve and the verdict against the configured capacity."""

    configured_capacity: int
    swept_to: int
    """The highest concurrency measured (capacity, or up to twice it with --exclusive)."""
    knee_fraction: float = 0.9
    peak_throughput_tok_s: float | None = None
    peak_concurrency: int | None = None
    recommended_capacity: int | None = None
    """The smallest concurrency whose aggregate throughput is ≥ knee_fraction x the peak (with ≥ 95 % ok)."""
    throughput_at_configured_tok_s: float | None = None
    throughput_at_recommended_tok_s: float | None = None
    e2e_ratio: float | None = None
    """E2E p50 at the larger of the two capacities over E2E p50 at the smaller one."""
    verdict: str = ""


class Device(msgspec.Struct, kw_only=True):
    """The node's machine as its hello described it (None fields: not reported)."""

    summary: str = "unknown"
    facts: dict[str, object] = msgspec.field(default_factory=dict)


class Report(msgspec.Struct, kw_only=True):
    """One provider x device x model."""

    schema: str = SCHEMA
    provider: str
    node: str
    alias: str
    """The pool alias the probes named as `model` (what the node sees)."""
    model: str
    """The model name sent upstream (the provider's `model`, else the alias)."""
    adapter_type: str
    device: Device = msgspec.field(default_factory=Device)
    configured_capacity: int
    exclusive: bool
    quick: bool
    started: str
    finished: str
    duration_s: float
    iop_version: str
    checks: list[Check] = msgspec.field(default_factory=list)
    sweep: list[Level] = msgspec.field(default_factory=list)
    recommendation: Recommendation
    context_tokens: int | None = None
    """With --context: the largest prompt (in prompt tokens) the provider accepted."""
    summary: QualificationSummary
    """What /status and `iop status` show (the edge reads only this and `provider`)."""

    def key(self) -> str:
        """`provider--device--model`, usable as a file name."""
        return "--".join(_slug(s) for s in (self.provider, self.device.summary, self.model))


def _slug(text: str) -> str:
    out = "".join(c if c.isalnum() or c in "._" else "-" for c in text.lower()).strip("-")
    while "--" in out:
        out = out.replace("--", "-")
    return out[:60] or "unknown"


encode_report = msgspec.json.Encoder(order="deterministic").encode
_reports = msgspec.json.Decoder(Report)


class Kept(msgspec.Struct):
    """`GET /admin/qualify/results`: the latest report of each provider."""

    reports: list[Report]


_kept = msgspec.json.Decoder(Kept)


def decode_report(raw: bytes) -> Report:
    return _reports.decode(raw)


def decode_kept(raw: bytes) -> list[Report]:
    return _kept.decode(raw).reports
