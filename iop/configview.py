"""What `iop config check` and `iop config schema` print: a deployment summed up, and its JSON Schema."""

from __future__ import annotations

import json
import shlex

import msgspec

from iop import config


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def _what(ref: config.ProviderRef, alias_model: str) -> str:
    adapter, model = ref.adapter, ref.provider.model or alias_model
    if isinstance(adapter, config.CliAdapter):
        return shlex.join(adapter.command)
    if isinstance(adapter, config.OpenAIAdapter):
        api = adapter.api if isinstance(adapter.api, str) else ", ".join(adapter.api)
        managed = ""
        if (srv := adapter.server) is not None:
            idle = f"stopped after {srv.idle_stop_s:g}s idle" if srv.idle_stop_s else "always on"
            group = f", group {srv.group} ({srv.group_size} at once)" if srv.group else ""
            managed = f"; server run by the node: {shlex.join(srv.command)}, {idle}{group}"
        return f"{model} at {adapter.base_url} ({api}){managed}"
    return f"{model} ({adapter.tokens} tokens, first after {adapter.latency_ms:g} ms)"


def summary(loaded: config.Loaded) -> str:
    """What `iop config check` prints for a valid file: counts, nodes, providers, pools, routes, warnings."""
    dep = loaded.deployment
    catalog = config.Catalog.of(dep)
    pooled = {p for members in catalog.pools.values() for p in members}
    total = sum(catalog.providers[p].provider.capacity or 0 for p in pooled)
    lines = [
        f"{_plural(len(dep.nodes), 'node')}, {_plural(len(catalog.providers), 'provider')} "
        f"({len(pooled)} in pools, total capacity {total}), "
        f"{_plural(len(catalog.pools), 'pool')}, {_plural(len(catalog.routes), 'direct route')}"
    ]
    edge, nats = dep.edge, dep.edge.nats
    bus = f"embedded nats on {nats.listen}" if nats.url == "embedded" else f"nats {nats.url}"
    if nats.token_env:
        bus += f" (token from ${nats.token_env})"
    elif nats.user_env:
        bus += f" (user from ${nats.user_env}, password from ${nats.password_env})"
    if nats.tls_ca:
        bus += f", CA {nats.tls_ca}"
    auth = f"client keys from ${edge.api_keys_env}" if edge.api_keys_env else "no client auth"
    auth += f", admin keys from ${edge.admin_keys_env}" if edge.admin_keys_env else ", admin from loopback only"
    lines.append(
        f"edge on {edge.listen}, {bus}, queue {edge.queue.timeout_s:g} s / "
        f"{edge.queue.max_waiting} waiting per pool, {auth}"
    )

    refs = list(catalog.providers.values())
    id_width = max((len(r.provider.id) for r in refs), default=0)
    kind_width = max((len(f"{r.adapter.id} ({_kind(r)})") for r in refs), default=0)
    lines += ["", "nodes"]
    for node in dep.nodes:
        legacy = node.legacy_concurrency()
        note = f", legacy concurrency {legacy} (metadata only)" if legacy is not None else ""
        lines.append(f"  {node.id}: {_plural(len(node.providers), 'provider')}{note}")
        for p in node.providers:
            ref = catalog.providers[p.id]
            limit = "unlimited" if ref.is_cli else f"capacity {p.capacity}"
            kind = f"{ref.adapter.id} ({_kind(ref)})"
            lines.append(f"    {p.id:<{id_width}}  {kind:<{kind_width}}  {limit:<11}  {_what(ref, 'alias')}")

    if catalog.pools:
        lines += ["", "pools"]
        for alias, members in catalog.pools.items():
            caps = [catalog.providers[m].provider.capacity or 0 for m in members]
            each = ", ".join(f"{m} {c}" for m, c in zip(members, caps, strict=True))
            lines.append(f"  {alias}: {_plural(len(members), 'candidate')}, total capacity {sum(caps)} ({each})")
    if catalog.routes:
        lines += ["", "direct routes"]
        lines += [f"  {alias} -> {node}/{prov}" for alias, (node, prov) in catalog.routes.items()]
    if loaded.warnings:
        lines += ["", "warnings"]
        lines += [f"  {w}" for w in loaded.warnings]
    return "\n".join(lines)


def _kind(ref: config.ProviderRef) -> str:
    return str(type(ref.adapter).__struct_config__.tag)


def json_schema_text() -> str:
    """The JSON Schema of the deployment file, for editors (e.g. yaml-language-server)."""
    schema = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "iop deployment file",
        **msgspec.json.schema(config.Deployment),
    }
    return json.dumps(schema, indent=2)
