"""The deployment this edge serves now, and the few values every request reads from it.

One object, shared by every part that reads the deployment (requests, status, refresh, the ledger's
endpoints): a refresh changes it in place, in one synchronous step, so each of them sees the old
deployment or the new one, never a mix, and nobody holds a stale copy.
"""

from __future__ import annotations

from iop import config
from iop.edge.tenants import Tenants


class CurrentDeployment:
    """The running deployment, its catalog, and the request limits derived from them."""

    def __init__(self, deployment: config.Deployment) -> None:
        self.deployment = deployment
        self.catalog = config.Catalog.of(deployment)
        self.queue_timeout_s = deployment.edge.queue.timeout_s
        self.max_body_bytes = int(deployment.edge.max_body_mb * 1024 * 1024)
        self.tenants = Tenants(deployment.edge)

    def replace(self, new: config.Deployment, catalog: config.Catalog | None = None) -> None:
        """Serve `new` from now on (`catalog` when the caller has built it already)."""
        self.deployment = new
        self.catalog = catalog if catalog is not None else config.Catalog.of(new)
        self.queue_timeout_s = new.edge.queue.timeout_s
        self.max_body_bytes = int(new.edge.max_body_mb * 1024 * 1024)
        self.tenants = Tenants(new.edge)

    def capacities(self) -> dict[str, int]:
        """Provider id → capacity of every pool provider (the ones with a work-queue consumer)."""
        return {
            pid: ref.provider.capacity
            for pid, ref in self.catalog.providers.items()
            if ref.provider.capacity is not None
        }
