"""Per-key bounds of what a Responses client holds open on an edge: WebSocket connections and
background responses in flight (`edge.responses.max_sockets_per_key`, `max_background_per_key`).

Each costs the edge for as long as it lasts, not per request: without a bound one client key
could open sockets or start background work until the edge's memory, its file descriptors or the
pools' queues are gone. Counted per edge (what each one holds is what it can bound) by the owner
id of the key (iop/responses/store.py); one over its bound is an OpenAI 429 `rate_limit_error`,
counted in `/metrics` as `iop_responses_refused{limit}`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from iop import edgeconf
from iop.errors import RequestError


class TooManyOpen(RequestError):
    """A client key holds as many sockets or background responses as its edge lets it."""

    status = 429
    type = "rate_limit_error"
    code = "too_many_open"


class PerKey:
    """What each owner holds of one kind, against a bound read on every take (a refresh applies)."""

    def __init__(self, kind: str, bound: Callable[[], int], what: str, setting: str) -> None:
        self.kind = kind
        self.bound = bound
        self.what = what
        self.setting = setting
        self.held: dict[str, int] = {}
        self.refused = 0
        self.changed = asyncio.Event()
        """Set each time one is given back (what a waiter for a free place rechecks on)."""

    def take(self, owner: str, bounded: bool = True) -> None:
        """Hold one more for `owner`; TooManyOpen when it holds its bound already (and `bounded`)."""
        n = self.held.get(owner, 0)
        limit = self.bound()
        if bounded and n >= limit:
            self.refused += 1
            raise TooManyOpen(
                f"this API key has {n} {self.what} open on this edge, the most it may ({self.setting} = {limit}); "
                "close one or wait for one to finish",
                code=f"too_many_{self.kind}",
                headers={"Retry-After": "1"},
            )
        self.held[owner] = n + 1

    def give(self, owner: str) -> None:
        n = self.held.get(owner, 0) - 1
        if n > 0:
            self.held[owner] = n
        else:
            self.held.pop(owner, None)
        self.changed.set()

    def total(self) -> int:
        return sum(self.held.values())


class ResponseCaps(Collector):
    """The edge's per-key bounds of sockets and background responses, and their metrics."""

    def __init__(self, settings: Callable[[], edgeconf.ResponsesSettings]) -> None:
        self.sockets = PerKey(
            "websockets",
            lambda: settings().max_sockets_per_key,
            "WebSocket connections",
            "edge.responses.max_sockets_per_key",
        )
        self.background = PerKey(
            "background_responses",
            lambda: settings().max_background_per_key,
            "background responses",
            "edge.responses.max_background_per_key",
        )

    def collect(self) -> Iterator[Metric]:
        refused = CounterMetricFamily(
            "iop_responses_refused",
            "Responses requests refused because their key held its bound of this kind (edge.responses).",
            labels=["limit"],
        )
        held = GaugeMetricFamily("iop_responses_open", "What client keys hold open on this edge.", labels=["kind"])
        for cap in (self.sockets, self.background):
            refused.add_metric([cap.kind], cap.refused)
            held.add_metric([cap.kind], cap.total())
        yield from (refused, held)
