"""The deployment file's rules for routing a pool and for taking a provider out of it on its own.

Read by iop/config.py (`ModelAlias.routing`, `ModelAlias.deadline_ms`, `Provider.policy`); the edge
applies them (iop/edge/routing.py, iop/edge/lifecycle.py). docs/config.md describes each field.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

Routing = Literal["expected_finish", "free_slots"]
"""How a pool picks among its free providers."""

ROUTING_HELP = (
    "Pools: which free provider a request gets: the one expected to finish it first (qualification "
    "curve, live TTFT and decode rate, the request's size), or the one with the most free slots."
)
Deadline = Annotated[float, Meta(gt=0)]
DEADLINE_HELP = (
    "Pools: the deadline (ms from arrival to the answer's end) of a request without an x-iop-deadline-ms "
    "header; one nobody can meet is refused at once (504 deadline_unmeetable). None: no deadline."
)
POLICY_HELP = "Pool providers: when the edge drains it out of its pools by itself (live figures, failed checks)."


class LifecyclePolicy(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """When the edge drains a provider out of its pools by itself; it comes back after a passing
    `iop qualify` of it or `iop provider enable`."""

    window_s: Annotated[float, Meta(gt=0, description="The live figures are over this window's requests.")] = 60.0
    min_requests: Annotated[
        int, Meta(ge=1, description="Requests the window needs before its figures can drain the provider.")
    ] = 10
    max_error_rate: Annotated[
        Annotated[float, Meta(gt=0, le=1)] | None,
        Meta(description="Drain when more than this share of the window's requests failed on the provider."),
    ] = None
    max_ttft_ms: Annotated[
        Annotated[float, Meta(gt=0)] | None,
        Meta(description="Drain when the median time to first byte (at the node) over the window passes this."),
    ] = None
    drain_on_failed_checks: Annotated[
        bool, Meta(description="Drain when a qualification run of the provider fails a protocol check.")
    ] = True
