"""What a refresh changes: the diff between two deployments, and the answer of `/admin/refresh`.

Read by the edge (which applies it), `iop refresh` and the client (which print it) and the node
(which names what the edge's section of it changes against its local file).
"""

from __future__ import annotations

import msgspec

from iop import config


class Change(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One line of a refresh: what kind of change, to what, and the values before and after."""

    kind: str
    """node_added, node_removed, legacy_concurrency (metadata only), provider_added,
    provider_removed, provider_moved, capacity, model, provider_adapter, adapter_added,
    adapter_removed, adapter_changed, pool_added, pool_removed, pool_members, affinity_wait, route_added,
    route_removed, route_changed, max_body, queue, restart_needed."""
    target: str
    before: str | None = None
    after: str | None = None

    def line(self) -> str:
        if self.before is not None and self.after is not None:
            return f"{self.kind} {self.target}: {self.before} → {self.after}"
        if self.after is not None:
            return f"{self.kind} {self.target}: {self.after}"
        if self.before is not None:
            return f"{self.kind} {self.target} (was {self.before})"
        return f"{self.kind} {self.target}"


def _opt(value: int | None) -> str:
    return "unset" if value is None else str(value)


def _enc(value: object) -> str:
    return msgspec.json.encode(value).decode()


def diff(old: config.Deployment, new: config.Deployment) -> list[Change]:
    """Every difference that matters to a running deployment, in a stable order."""
    changes: list[Change] = []
    old_nodes = {n.id: n for n in old.nodes}
    new_nodes = {n.id: n for n in new.nodes}
    for nid in sorted(new_nodes.keys() - old_nodes.keys()):
        changes.append(Change(kind="node_added", target=nid))
    for nid in sorted(old_nodes.keys() - new_nodes.keys()):
        changes.append(Change(kind="node_removed", target=nid))
    for nid in sorted(old_nodes.keys() & new_nodes.keys()):
        # Metadata only (never used for admission), but status shows it: a refresh must carry it.
        a_legacy, b_legacy = old_nodes[nid].legacy_concurrency(), new_nodes[nid].legacy_concurrency()
        if a_legacy != b_legacy:
            changes.append(Change(kind="legacy_concurrency", target=nid, before=_opt(a_legacy), after=_opt(b_legacy)))

    old_cat, new_cat = config.Catalog.of(old), config.Catalog.of(new)
    for pid in sorted(new_cat.providers.keys() - old_cat.providers.keys()):
        ref = new_cat.providers[pid]
        cap = "unlimited" if ref.provider.capacity is None else str(ref.provider.capacity)
        changes.append(Change(kind="provider_added", target=f"{ref.node.id}/{pid}", after=f"capacity {cap}"))
    for pid in sorted(old_cat.providers.keys() - new_cat.providers.keys()):
        ref = old_cat.providers[pid]
        changes.append(Change(kind="provider_removed", target=f"{ref.node.id}/{pid}"))
    for pid in sorted(old_cat.providers.keys() & new_cat.providers.keys()):
        a, b = old_cat.providers[pid], new_cat.providers[pid]
        target = f"{b.node.id}/{pid}"
        if a.node.id != b.node.id:
            changes.append(Change(kind="provider_moved", target=pid, before=a.node.id, after=b.node.id))
        if a.provider.capacity != b.provider.capacity:
            changes.append(
                Change(kind="capacity", target=target, before=str(a.provider.capacity), after=str(b.provider.capacity))
            )
        if a.provider.model != b.provider.model:
            changes.append(Change(kind="model", target=target, before=a.provider.model, after=b.provider.model))
        if a.provider.adapter != b.provider.adapter:
            changes.append(
                Change(kind="provider_adapter", target=target, before=a.provider.adapter, after=b.provider.adapter)
            )

    for nid in sorted(old_nodes.keys() & new_nodes.keys()):
        a_ad = {ad.id: ad for ad in old_nodes[nid].adapters}
        b_ad = {ad.id: ad for ad in new_nodes[nid].adapters}
        for aid in sorted(b_ad.keys() - a_ad.keys()):
            changes.append(Change(kind="adapter_added", target=f"{nid}/{aid}", after=_enc(b_ad[aid])))
        for aid in sorted(a_ad.keys() - b_ad.keys()):
            changes.append(Change(kind="adapter_removed", target=f"{nid}/{aid}"))
        for aid in sorted(a_ad.keys() & b_ad.keys()):
            if a_ad[aid] != b_ad[aid]:
                changes.append(
                    Change(kind="adapter_changed", target=f"{nid}/{aid}", before=_enc(a_ad[aid]), after=_enc(b_ad[aid]))
                )

    for alias in sorted(new_cat.pools.keys() - old_cat.pools.keys()):
        changes.append(Change(kind="pool_added", target=alias, after=", ".join(new_cat.pools[alias])))
    for alias in sorted(old_cat.pools.keys() - new_cat.pools.keys()):
        changes.append(Change(kind="pool_removed", target=alias))
    for alias in sorted(old_cat.pools.keys() & new_cat.pools.keys()):
        if old_cat.pools[alias] != new_cat.pools[alias]:
            changes.append(
                Change(
                    kind="pool_members",
                    target=alias,
                    before=", ".join(old_cat.pools[alias]),
                    after=", ".join(new_cat.pools[alias]),
                )
            )
    for alias in sorted(old_cat.pools.keys() & new_cat.pools.keys()):
        a_wait, b_wait = old_cat.affinity_wait_s.get(alias, 0.0), new_cat.affinity_wait_s.get(alias, 0.0)
        if a_wait != b_wait:
            before, after = f"{a_wait * 1000:g} ms", f"{b_wait * 1000:g} ms"
            changes.append(Change(kind="affinity_wait", target=alias, before=before, after=after))
    for alias in sorted(new_cat.routes.keys() - old_cat.routes.keys()):
        changes.append(Change(kind="route_added", target=alias, after="/".join(new_cat.routes[alias])))
    for alias in sorted(old_cat.routes.keys() - new_cat.routes.keys()):
        changes.append(Change(kind="route_removed", target=alias))
    for alias in sorted(old_cat.routes.keys() & new_cat.routes.keys()):
        if old_cat.routes[alias] != new_cat.routes[alias]:
            changes.append(
                Change(
                    kind="route_changed",
                    target=alias,
                    before="/".join(old_cat.routes[alias]),
                    after="/".join(new_cat.routes[alias]),
                )
            )

    if old.edge.max_body_mb != new.edge.max_body_mb:
        changes.append(
            Change(
                kind="max_body",
                target="edge.max_body_mb",
                before=str(old.edge.max_body_mb),
                after=str(new.edge.max_body_mb),
            )
        )
    if old.edge.queue != new.edge.queue:
        before, after = _enc(old.edge.queue), _enc(new.edge.queue)
        changes.append(Change(kind="queue", target="edge.queue", before=before, after=after))
    if old.edge.tenants != new.edge.tenants or old.edge.tenant_defaults != new.edge.tenant_defaults:
        for name in sorted(old.edge.tenants.keys() | new.edge.tenants.keys()):
            a_pol, b_pol = old.edge.tenants.get(name), new.edge.tenants.get(name)
            if a_pol != b_pol:
                before = _enc(a_pol) if a_pol is not None else "defaults"
                after = _enc(b_pol) if b_pol is not None else "defaults"
                changes.append(Change(kind="tenant", target=f"edge.tenants.{name}", before=before, after=after))
        if old.edge.tenant_defaults != new.edge.tenant_defaults:
            before, after = _enc(old.edge.tenant_defaults), _enc(new.edge.tenant_defaults)
            changes.append(Change(kind="tenant", target="edge.tenant_defaults", before=before, after=after))
    restart = ("listen", "nats", "api_keys_env", "admin_keys_env", "allow_anonymous", "allowed_hosts", "ledger")
    for name in (*restart, "responses", "metrics_public"):
        a_val, b_val = getattr(old.edge, name), getattr(new.edge, name)
        if a_val != b_val:
            changes.append(Change(kind="restart_needed", target=f"edge.{name}", before=_enc(a_val), after=_enc(b_val)))
    if old.tracing != new.tracing:  # read once at start, by the edge and by each node
        before, after = _enc(old.tracing), _enc(new.tracing)
        changes.append(Change(kind="restart_needed", target="tracing", before=before, after=after))
    return changes


class RefreshResult(msgspec.Struct, kw_only=True):
    """What a refresh found and did (the JSON answer of `/admin/refresh`); `error` set means it
    stopped and undid its broker changes."""

    changes: list[str]
    applied: list[str] = msgspec.field(default_factory=list)
    error: str | None = None
    rolled_back: bool = False
    drift: list[str] = msgspec.field(default_factory=list)
    """After it: how the running deployment differs from the edge's own file (undone by a restart)."""
