"""One entry of a node's catalog as the node serves it: its adapter, its workers and live counts."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from nats.aio.subscription import Subscription

from iop import config, wire
from iop.node.adapters.base import Adapter
from iop.node.servers import ManagedServer


@dataclass
class Resource:
    """One entry of the node's catalog with its adapter and live counts."""

    cfg: config.Provider
    adapter: Adapter
    kind: str  # "pool" or "cli"
    in_flight: int = 0
    peak_in_flight: int = 0
    by_edge: dict[str, int] = field(default_factory=dict)
    """Of `in_flight`, per edge that sent it (heartbeats carry it to every edge)."""
    served: int = 0
    failed: int = 0
    workers: list[asyncio.Task[None]] = field(default_factory=list)
    retired: bool = False
    """Taken out of the catalog: fetches no more work, finishes what it runs."""
    sub: Subscription | None = None
    server: ManagedServer | None = None
    """The model server its node runs for it (its adapter's `server:` block): started before work runs."""

    def live(self) -> wire.ProviderLive:
        return wire.ProviderLive(
            id=self.cfg.id,
            kind="pool" if self.kind == "pool" else "cli",
            capacity=self.cfg.capacity,
            in_flight=self.in_flight,
            peak_in_flight=self.peak_in_flight,
            served=self.served,
            failed=self.failed,
            by_edge=dict(self.by_edge),
            server=self.server.live() if self.server is not None else None,
        )


def kind_of(node: config.Node, p: config.Provider) -> str:
    """A provider's kind: "cli" on a cli adapter (a CLI resource), else "pool"."""
    return "cli" if isinstance(node.adapter(p.adapter), config.CliAdapter) else "pool"
