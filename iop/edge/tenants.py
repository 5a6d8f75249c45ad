"""Which tenant a request belongs to, and the policy that tenant has.

A client key belongs to the tenant its name names (`alice:sk-…` → tenant `alice`), unless a
tenant lists the key's name under `keys`; a managed key carries its tenant (iop/edge/managed.py).
A tenant the file does not list gets `tenant_defaults`, counted on its own (each unlisted
tenant has its own windows and budgets, not one shared by all of them). Without client keys
every request is the one tenant "" with the defaults.
"""

from __future__ import annotations

from dataclasses import dataclass

from iop import config
from iop.tenancy import UNLIMITED, PoolLimits, Priority, TenantPolicy

__all__ = ["UNLIMITED", "PoolLimits", "Priority", "Tenant", "TenantPolicy", "Tenants"]


@dataclass(frozen=True, slots=True)
class Tenant:
    """A request's tenant: its name (what the ledger and metrics say) and its policy."""

    name: str
    policy: TenantPolicy

    @property
    def priority(self) -> Priority:
        return self.policy.priority

    @property
    def weight(self) -> float:
        return self.policy.weight


class Tenants:
    """The tenants of one deployment; a refresh builds a new one (iop/edge/current.py)."""

    def __init__(self, edge: config.EdgeSettings) -> None:
        self.policies: dict[str, TenantPolicy] = dict(edge.tenants)
        self.defaults = edge.tenant_defaults
        self._of_key = {key: name for name, policy in edge.tenants.items() for key in policy.keys}
        self._cache: dict[str, Tenant] = {}

    def tenant_of_key(self, key_name: str) -> str:
        """The tenant of the client key named `key_name` (env keys; "" without keys)."""
        return self._of_key.get(key_name, key_name)

    def get(self, name: str) -> Tenant:
        """Tenant `name` with its policy (the defaults when the file does not list it)."""
        tenant = self._cache.get(name)
        if tenant is None:
            tenant = Tenant(name, self.policies.get(name, self.defaults))
            if len(self._cache) < 65_536:  # names come from keys, not clients: bounded anyway
                self._cache[name] = tenant
        return tenant

    def of_key(self, key_name: str) -> Tenant:
        return self.get(self.tenant_of_key(key_name))

    @property
    def any_limited(self) -> bool:
        return self.defaults.limited or any(p.limited for p in self.policies.values())
