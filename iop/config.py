"""The deployment file: one YAML document describing the edge, the model aliases and every node."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import msgspec
import yaml

from iop.errors import ConfigError


class _Strict(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class NatsSettings(_Strict):
    url: str = "embedded"
    """`embedded` starts the bundled nats-server; otherwise `nats://host:port[,nats://host2:port2]`."""
    listen: str = "127.0.0.1:4222"
    """The embedded server's client address (nodes connect here)."""
    store_dir: str = ".iop/nats"
    """The embedded server's JetStream file store."""


class QueueSettings(_Strict):
    timeout_s: float = 60.0
    """How long a pool request may wait for a free slot before it fails with 503."""
    max_waiting: int = 1000
    """How many requests may wait per pool; one more gets 429."""


class EdgeSettings(_Strict):
    listen: str = "127.0.0.1:8080"
    nats: NatsSettings = msgspec.field(default_factory=NatsSettings)
    queue: QueueSettings = msgspec.field(default_factory=QueueSettings)
    api_keys_env: str | None = None
    """Name of an environment variable holding comma-separated client keys; unset = no client auth."""


class ModelAlias(_Strict):
    alias: str
    pool: list[str] | None = None
    """Provider ids whose capacity serves this alias (a provider pool)."""
    route: str | None = None
    """`node/provider`: a direct route to one CLI resource."""


class CliAdapter(_Strict, tag="cli", tag_field="type"):
    id: str
    command: list[str]
    timeout_s: float = 600.0
    env: list[str] = msgspec.field(default_factory=list)
    """Names of environment variables passed to the command (besides PATH, HOME, LANG)."""


class OpenAIAdapter(_Strict, tag="openai", tag_field="type"):
    id: str
    base_url: str
    api: Literal["chat", "responses", "both"] = "chat"
    api_key_env: str | None = None
    timeout_s: float = 600.0


class MockAdapter(_Strict, tag="mock", tag_field="type"):
    id: str
    latency_ms: float = 50.0
    tokens: int = 32
    token_interval_ms: float = 5.0


Adapter = CliAdapter | OpenAIAdapter | MockAdapter


class Provider(_Strict):
    id: str
    adapter: str
    model: str | None = None
    """The model name sent upstream (defaults to the client's alias)."""
    capacity: int | None = None


class RuntimeSettings(_Strict):
    concurrency: int | None = None
    """Legacy: accepted with a warning, shown in status, never used for admission."""


class Node(_Strict):
    id: str
    adapters: list[Adapter] = msgspec.field(default_factory=list)
    providers: list[Provider] = msgspec.field(default_factory=list)
    runtime: RuntimeSettings | None = None
    concurrency: int | None = None
    """Legacy: accepted with a warning, shown in status, never used for admission."""

    def legacy_concurrency(self) -> int | None:
        if self.concurrency is not None:
            return self.concurrency
        return self.runtime.concurrency if self.runtime else None

    def adapter(self, adapter_id: str) -> Adapter:
        for a in self.adapters:
            if a.id == adapter_id:
                return a
        raise KeyError(adapter_id)


class Deployment(_Strict):
    edge: EdgeSettings = msgspec.field(default_factory=EdgeSettings)
    models: list[ModelAlias] = msgspec.field(default_factory=list)
    nodes: list[Node] = msgspec.field(default_factory=list)

    def node(self, node_id: str) -> Node:
        for n in self.nodes:
            if n.id == node_id:
                return n
        raise KeyError(node_id)


@dataclass(frozen=True)
class ProviderRef:
    """A provider with the node and adapter it belongs to."""

    node: Node
    provider: Provider
    adapter: Adapter

    @property
    def is_cli(self) -> bool:
        return isinstance(self.adapter, CliAdapter)


@dataclass(frozen=True)
class Catalog:
    """Lookups derived from a valid deployment: providers by id, pools and routes by alias."""

    providers: dict[str, ProviderRef] = field(default_factory=dict)
    pools: dict[str, list[str]] = field(default_factory=dict)
    routes: dict[str, tuple[str, str]] = field(default_factory=dict)

    @classmethod
    def of(cls, dep: Deployment) -> Catalog:
        providers = {
            p.id: ProviderRef(node=n, provider=p, adapter=n.adapter(p.adapter))
            for n in dep.nodes
            for p in n.providers
        }
        pools: dict[str, list[str]] = {}
        routes: dict[str, tuple[str, str]] = {}
        for m in dep.models:
            if m.pool is not None:
                pools[m.alias] = list(m.pool)
            elif m.route is not None:
                node_id, _, prov = m.route.partition("/")
                routes[m.alias] = (node_id, prov)
        return cls(providers=providers, pools=pools, routes=routes)


@dataclass
class Loaded:
    """A validated deployment and the warnings it raised."""

    deployment: Deployment
    warnings: list[str]
    path: Path | None = None


def parse(text: str, source: str = "<config>") -> Loaded:
    """Validate the YAML text of a deployment file; raise ConfigError listing every problem."""
    try:
        raw: Any = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError([f"{source}: not valid YAML: {exc}"]) from exc
    if raw is None:
        raw = {}
    try:
        dep = msgspec.convert(raw, Deployment)
    except msgspec.ValidationError as exc:
        raise ConfigError([str(exc)]) from exc
    return Loaded(deployment=dep, warnings=[])


def load(path: str | Path) -> Loaded:
    """Read and validate a deployment file."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError([f"{p}: cannot read: {exc.strerror or exc}"]) from exc
    loaded = parse(text, str(p))
    loaded.path = p
    return loaded
