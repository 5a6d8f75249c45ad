"""Tenants in the deployment file: who a client key belongs to and what that tenant may use.

The Structs here are the `edge.tenants` / `edge.tenant_defaults` sections; config.py embeds them.
The edge resolves a request's tenant and its limits with them (iop/edge/tenants.py); the pool
scheduler reads `priority`, `weight` and `max_concurrent`, admission the rest (iop/edge/limits.py).
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from iop.yamldoc import Path, Problem

Priority = Literal["interactive", "standard", "batch"]
"""A tenant's class in the pool queues: interactive before standard before batch."""

TENANT_PATTERN = r"^[A-Za-z0-9_.@-]{1,64}$"
"""A tenant's name: what a client key's name may be (iop/edge/keys.py), so a key can name its tenant."""

TenantName = Annotated[str, Meta(pattern=TENANT_PATTERN)]
Count = Annotated[int, Meta(ge=1)]


class PoolLimits(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """A tenant's limits on one pool alias, besides (never instead of) its tenant-wide ones."""

    max_concurrent: Annotated[
        Count | None, Meta(description="The tenant's requests in flight on this pool (more wait in its queue).")
    ] = None
    rpm: Annotated[Count | None, Meta(description="Requests admitted to this pool in any 60 s.")] = None
    tpm: Annotated[Count | None, Meta(description="Input + output tokens on this pool in any 60 s.")] = None


class TenantPolicy(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """What one tenant may use. Every limit is optional; unset means unlimited."""

    max_concurrent: Annotated[
        Count | None,
        Meta(description="The tenant's requests in flight on any one pool; more wait in that pool's queue."),
    ] = None
    rpm: Annotated[
        Count | None, Meta(description="Requests admitted in any 60 s, every model together; 429 above.")
    ] = None
    tpm: Annotated[
        Count | None,
        Meta(description="Input + output tokens in any 60 s (estimated at admission, corrected by usage); 429 above."),
    ] = None
    tokens_per_day: Annotated[
        Count | None, Meta(description="Input + output tokens per UTC day; 429 insufficient_quota above.")
    ] = None
    tokens_per_month: Annotated[
        Count | None, Meta(description="Input + output tokens per UTC calendar month; 429 insufficient_quota above.")
    ] = None
    models: Annotated[
        list[Annotated[str, Meta(min_length=1)]] | None,
        Meta(description="Model aliases the tenant may use: exact names or globs (`qwen-*`); unset: all."),
    ] = None
    priority: Annotated[Priority, Meta(description="Class in the pool queues.")] = "standard"
    weight: Annotated[float, Meta(gt=0, le=1000, description="Share of a saturated pool against other tenants.")] = 1.0
    pools: Annotated[
        dict[Annotated[str, Meta(min_length=1)], PoolLimits],
        Meta(description="Per pool alias: max_concurrent, rpm, tpm on that pool, besides the tenant-wide ones."),
    ] = msgspec.field(default_factory=dict)
    keys: Annotated[
        list[TenantName],
        Meta(description="Names of client keys (`name:key`) that belong to this tenant besides the one named like it."),
    ] = msgspec.field(default_factory=list)

    def allows(self, alias: str) -> bool:
        """The tenant may use model `alias` (exact name or a glob of `models`)."""
        return self.models is None or any(alias == m or fnmatchcase(alias, m) for m in self.models)

    def pool(self, alias: str) -> PoolLimits | None:
        return self.pools.get(alias)

    def max_concurrent_on(self, alias: str) -> int | None:
        """The tenant's in-flight bound on pool `alias`: the pool's own, else the tenant's."""
        own = self.pools.get(alias)
        if own is not None and own.max_concurrent is not None:
            return own.max_concurrent
        return self.max_concurrent

    @property
    def limited(self) -> bool:
        """Any rate or budget applies (the answers then carry x-ratelimit-* headers)."""
        return any(v is not None for v in (self.rpm, self.tpm, self.tokens_per_day, self.tokens_per_month)) or any(
            p.rpm is not None or p.tpm is not None for p in self.pools.values()
        )


UNLIMITED = TenantPolicy()

TenantsField = Annotated[
    dict[TenantName, TenantPolicy],
    Meta(description="Tenant name → its policy (limits, models, priority); a key's tenant is its name."),
]
DefaultsField = Annotated[
    TenantPolicy, Meta(description="The policy of every tenant not listed in tenants, each on its own.")
]


def cross_check(edge: dict[Any, Any], aliases: set[str]) -> list[Problem]:
    """The tenant rules relating one part of the file to another (raw data, as crosscheck.py reads it)."""
    problems: list[Problem] = []
    tenants = edge.get("tenants")
    owners: dict[str, str] = {}
    if isinstance(tenants, dict):
        for name, policy in tenants.items():
            if not isinstance(policy, dict):
                continue
            at: Path = ("edge", "tenants", str(name))
            problems.extend(_pools(at, policy, aliases))
            keys = policy.get("keys")
            for i, key in enumerate(keys if isinstance(keys, list) else []):
                if not isinstance(key, str):
                    continue
                other = owners.get(key) or (key if key in tenants and key != name else None)
                if other is not None and other != name:
                    problems.append(Problem((*at, "keys", i), f"key {key!r} already belongs to tenant {other!r}"))
                owners.setdefault(key, str(name))
    defaults = edge.get("tenant_defaults")
    if isinstance(defaults, dict):
        problems.extend(_pools(("edge", "tenant_defaults"), defaults, aliases))
        if defaults.get("keys"):
            problems.append(
                Problem(("edge", "tenant_defaults", "keys"), "the defaults belong to no key; list keys under a tenant")
            )
    return problems


def _pools(at: Path, policy: dict[Any, Any], aliases: set[str]) -> list[Problem]:
    pools = policy.get("pools")
    if not isinstance(pools, dict):
        return []
    known = ", ".join(sorted(aliases)) or "none"
    return [
        Problem((*at, "pools", str(alias)), f"no pool alias {alias!r} (pools: {known})")
        for alias in pools
        if alias not in aliases
    ]
