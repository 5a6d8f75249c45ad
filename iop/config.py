"""The deployment file: one YAML document describing the edge, the model aliases and every node."""

from __future__ import annotations

import ipaddress
import json
import shlex
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import msgspec.inspect
from msgspec import Meta

from iop import validate
from iop.errors import ConfigError
from iop.validate import Problem, render

Id = Annotated[str, Meta(min_length=1, pattern=validate.ID_PATTERN, extra={"format": "id"})]
Alias = Annotated[str, Meta(min_length=1, pattern=r"^\S+$", extra={"format": "alias"})]
Address = Annotated[str, Meta(pattern=r"^\S+:[0-9]{1,5}$", extra={"format": "address"})]
EnvName = Annotated[str, Meta(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", extra={"format": "env"})]
FilePath = Annotated[str, Meta(min_length=1)]
Seconds = Annotated[float, Meta(gt=0)]
Millis = Annotated[float, Meta(ge=0)]
LegacyConcurrency = Annotated[
    int | None, Meta(description="Legacy: accepted with a warning, shown in status, never gates admission.")
]


class _Strict(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class NatsSettings(_Strict):
    """How the edge and the nodes reach NATS."""

    url: Annotated[
        str,
        Meta(
            extra={"format": "nats_url"},
            description="`embedded` starts the bundled nats-server; otherwise nats:// or tls:// URLs, comma-separated.",
        ),
    ] = "embedded"
    listen: Annotated[Address, Meta(description="The embedded server's client address (nodes connect here).")] = (
        "127.0.0.1:4222"
    )
    store_dir: Annotated[str, Meta(min_length=1, description="The embedded server's JetStream file store.")] = (
        ".iop/nats"
    )
    user_env: Annotated[
        EnvName | None,
        Meta(description="Environment variable holding the NATS user name (with password_env)."),
    ] = None
    password_env: Annotated[
        EnvName | None,
        Meta(description="Environment variable holding the NATS password (with user_env)."),
    ] = None
    token_env: Annotated[
        EnvName | None,
        Meta(description="Environment variable holding a NATS token (instead of user_env/password_env)."),
    ] = None
    tls_ca: Annotated[
        FilePath | None,
        Meta(description="CA certificate file (PEM) that signed an external NATS server's certificate."),
    ] = None
    tls_cert: Annotated[
        FilePath | None, Meta(description="Client certificate (PEM) for NATS servers that verify clients.")
    ] = None
    tls_key: Annotated[FilePath | None, Meta(description="The private key (PEM) of tls_cert.")] = None

    def has_credentials(self) -> bool:
        return bool(self.token_env or (self.user_env and self.password_env))


class QueueSettings(_Strict):
    """The wait queue in front of each pool."""

    timeout_s: Annotated[Seconds, Meta(description="How long a pool request may wait for a free slot (then 503).")] = (
        60.0
    )
    max_waiting: Annotated[int, Meta(ge=1, description="How many requests may wait per pool; one more gets 429.")] = (
        1000
    )


class HttpSettings(_Strict):
    """Limits on client connections, enforced before a request reaches authentication."""

    max_head_kb: Annotated[
        int, Meta(ge=1, le=1024, description="Largest request head (line + headers), KiB; 431 above.")
    ] = 64
    max_headers: Annotated[int, Meta(ge=8, le=1000, description="Most headers in one request; 431 above.")] = 100
    head_timeout_s: Annotated[
        float, Meta(gt=0, le=600, description="Time a client has to send a request head, from connect; 408 after.")
    ] = 10.0
    body_idle_timeout_s: Annotated[
        float, Meta(gt=0, le=3600, description="Longest silence while a request body is being received; 408 after.")
    ] = 30.0
    keepalive_s: Annotated[
        int, Meta(ge=1, le=3600, description="An idle kept-alive connection is closed after this many seconds.")
    ] = 5
    max_connections: Annotated[
        int, Meta(ge=16, le=1_000_000, description="Open client connections; a newcomer past it gets 503.")
    ] = 4096


class EdgeSettings(_Strict):
    """The HTTP front: where it listens, how it reaches NATS, how pools queue."""

    listen: Annotated[Address, Meta(description="host:port of the OpenAI-compatible HTTP API.")] = "127.0.0.1:8080"
    nats: NatsSettings = msgspec.field(default_factory=NatsSettings)
    queue: QueueSettings = msgspec.field(default_factory=QueueSettings)
    http: HttpSettings = msgspec.field(default_factory=HttpSettings)
    api_keys_env: Annotated[
        EnvName | None,
        Meta(
            description="Environment variable holding comma-separated client keys, required on /v1/* and "
            "/status (and /metrics); unset = no client auth."
        ),
    ] = None
    max_body_mb: Annotated[
        float,
        Meta(
            gt=0,
            le=1024,
            description="Largest request body accepted, in MiB (413 above it). Bodies larger than one NATS "
            "message are carried to the node in parts.",
        ),
    ] = 32.0


class ModelAlias(_Strict):
    """A model name clients ask for, served by a pool of providers or routed to one CLI resource."""

    alias: Annotated[Alias, Meta(description="The `model` clients send.")]
    pool: Annotated[
        Annotated[list[str], Meta(min_length=1)] | None,
        Meta(description="Provider ids whose capacity serves this alias (a provider pool)."),
    ] = None
    route: Annotated[str | None, Meta(description="`node/provider`: a direct route to one CLI resource.")] = None


class CliAdapter(_Strict, tag="cli", tag_field="type"):
    """Runs a command per request: prompt on stdin, stdout streamed back. Unlimited, never queued."""

    id: Id
    command: Annotated[
        list[Annotated[str, Meta(min_length=1)]],
        Meta(min_length=1, description="Program and arguments, run directly (no shell)."),
    ]
    timeout_s: Annotated[Seconds, Meta(description="The process is killed after this long.")] = 600.0
    env: Annotated[
        list[EnvName],
        Meta(
            description="Names of environment variables passed to the command, besides PATH, HOME, LANG, "
            "LC_ALL, TMPDIR and USER; no other variable reaches it."
        ),
    ] = msgspec.field(default_factory=list)


class OpenAIAdapter(_Strict, tag="openai", tag_field="type"):
    """An upstream OpenAI-compatible server (vLLM, MLX, llama.cpp, ...)."""

    id: Id
    base_url: Annotated[
        str, Meta(extra={"format": "http_url"}, description="The upstream's API root, e.g. http://h:8000/v1.")
    ]
    api: Annotated[
        Literal["chat", "responses", "both"],
        Meta(description="What the upstream serves: /chat/completions, /responses, or both."),
    ] = "chat"
    api_key_env: Annotated[EnvName | None, Meta(description="Environment variable holding the upstream's API key.")] = (
        None
    )
    timeout_s: Annotated[Seconds, Meta(description="Upper bound on one upstream request.")] = 600.0


class MockAdapter(_Strict, tag="mock", tag_field="type"):
    """A fake model streaming canned tokens, for smoke tests and demos."""

    id: Id
    latency_ms: Annotated[Millis, Meta(description="Delay before the first token.")] = 50.0
    tokens: Annotated[int, Meta(ge=0, description="How many tokens each answer has.")] = 32
    token_interval_ms: Annotated[Millis, Meta(description="Delay between tokens.")] = 5.0


Adapter = CliAdapter | OpenAIAdapter | MockAdapter


class Provider(_Strict):
    """A model endpoint or CLI resource hosted by a node, on one of that node's adapters."""

    id: Annotated[Id, Meta(description="Unique across the whole deployment.")]
    adapter: Annotated[str, Meta(description="The id of an adapter of the same node.")]
    model: Annotated[
        Annotated[str, Meta(min_length=1)] | None,
        Meta(description="The model name sent upstream (defaults to the client's alias)."),
    ] = None
    capacity: Annotated[
        Annotated[int, Meta(ge=1)] | None,
        Meta(description="Requests served at once; required on openai/mock adapters, absent on cli."),
    ] = None


class RuntimeSettings(_Strict):
    """Legacy node runtime settings."""

    concurrency: LegacyConcurrency = None


class Node(_Strict):
    """A machine (or process) that connects to NATS and hosts providers."""

    id: Id
    adapters: list[Adapter] = msgspec.field(default_factory=list)
    providers: list[Provider] = msgspec.field(default_factory=list)
    runtime: RuntimeSettings | None = None
    concurrency: LegacyConcurrency = None

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
    """An iop deployment: the edge, the model aliases and every node."""

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
            p.id: ProviderRef(node=n, provider=p, adapter=n.adapter(p.adapter)) for n in dep.nodes for p in n.providers
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


# --- validation ---------------------------------------------------------------------------------


_CHECKER = validate.Checker(validate.FORMATS)
_DEPLOYMENT_TYPE = msgspec.inspect.type_info(Deployment)
_CLI_TYPE = str(CliAdapter.__struct_config__.tag)
_ADAPTER_TYPES = {str(c.__struct_config__.tag) for c in (CliAdapter, OpenAIAdapter, MockAdapter)}
_EDGE_DEFAULTS = EdgeSettings()
_NATS_DEFAULTS = _EDGE_DEFAULTS.nats
_LEGACY = (
    "legacy setting: it no longer gates admission (each provider's capacity does) and is kept as metadata for status"
)


def is_loopback(host: str) -> bool:
    """Whether `host` (of a listen address) is only reachable from this machine."""
    host = host.removeprefix("[").removesuffix("]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # another host name: it may resolve to anything


def _is_open_address(listen: object) -> bool:
    """A well-formed listen address on a host other than loopback (malformed ones are reported elsewhere)."""
    if not isinstance(listen, str) or validate.FORMATS["address"](listen) is not None:
        return False
    return not is_loopback(listen.rpartition(":")[0])


def _entries(parent: object, key: str) -> list[tuple[int, dict[Any, Any]]]:
    """The mapping items of `parent[key]`, skipping whatever the structural check already rejected."""
    items = parent.get(key) if isinstance(parent, dict) else None
    return [(i, x) for i, x in enumerate(items) if isinstance(x, dict)] if isinstance(items, list) else []


def _text(entry: dict[Any, Any], key: str) -> str | None:
    value = entry.get(key)
    return value if isinstance(value, str) and value else None


def _listing(names: list[str]) -> str:
    return ", ".join(names) if names else "none"


def _near(word: str, choices: Iterable[str]) -> str:
    hint = validate.suggest(word, choices)
    return f"; did you mean {hint!r}?" if hint else ""


@dataclass
class _Seen:
    """What the cross-reference pass learnt about one provider."""

    path: validate.Path
    node: str
    adapter_type: str | None


class _CrossCheck:
    """Rules relating one part of the file to another: unique ids, references, capacity.

    It reads the raw data (not Structs) so that it can run even when the structural check failed
    somewhere else, and the user sees every problem in one go.
    """

    def __init__(self) -> None:
        self.problems: list[Problem] = []
        self.warnings: list[Problem] = []
        self.nodes: dict[str, validate.Path] = {}
        self.providers: dict[str, _Seen] = {}
        self.used: set[str] = set()

    def bad(self, path: validate.Path, message: str) -> None:
        self.problems.append(Problem(path, message))

    def run(self, data: dict[Any, Any]) -> None:
        edge = data.get("edge")
        if isinstance(edge, dict):
            self.edge(edge)
        for i, node in _entries(data, "nodes"):
            self.node(("nodes", i), node)
        aliases: dict[str, validate.Path] = {}
        for i, model in _entries(data, "models"):
            alias = _text(model, "alias")
            if alias in aliases:
                self.bad(("models", i, "alias"), f"duplicate alias {alias!r} (also {render(aliases[alias])})")
            elif alias is not None:
                aliases[alias] = ("models", i)
            self.model(("models", i), model)
        for provider_id, seen in self.providers.items():
            if provider_id not in self.used and seen.adapter_type is not None:
                how = "alias routes to it" if seen.adapter_type == _CLI_TYPE else "pool lists it"
                self.warnings.append(Problem(seen.path, f"{provider_id!r} gets no work: no {how}"))

    def edge(self, edge: dict[Any, Any]) -> None:
        listen = edge.get("listen", _EDGE_DEFAULTS.listen)
        if edge.get("api_keys_env") is None and _is_open_address(listen):
            self.warnings.append(
                Problem(
                    ("edge", "listen"),
                    f"{listen} is not a loopback address and api_keys_env is not set: "
                    "anyone who reaches it can use every model",
                )
            )
        nats = edge.get("nats")
        if isinstance(nats, dict):
            self.nats(("edge", "nats"), nats)

    def nats(self, at: validate.Path, nats: dict[Any, Any]) -> None:
        """Credentials come as a pair or a token; an embedded server beyond loopback needs them."""
        user, password, token = (nats.get(k) is not None for k in ("user_env", "password_env", "token_env"))
        if token and (user or password):
            self.bad((*at, "token_env"), "use user_env/password_env or token_env, not both")
        elif user and not password:
            self.bad((*at, "password_env"), "missing: user_env is set, so a password_env is needed too")
        elif password and not user:
            self.bad((*at, "user_env"), "missing: password_env is set, so a user_env is needed too")
        cert, key = nats.get("tls_cert") is not None, nats.get("tls_key") is not None
        if cert and not key:
            self.bad((*at, "tls_key"), "missing: tls_cert is set, so its private key tls_key is needed too")
        elif key and not cert:
            self.bad((*at, "tls_cert"), "missing: tls_key is set, so the certificate tls_cert is needed too")
        if nats.get("url", _NATS_DEFAULTS.url) != "embedded":
            return
        for name in ("tls_ca", "tls_cert", "tls_key"):
            if nats.get(name) is not None:
                self.bad(
                    (*at, name),
                    "applies to an external NATS (url: tls://...); the embedded server does not serve TLS",
                )
        listen = nats.get("listen", _NATS_DEFAULTS.listen)
        if not (user or password or token) and _is_open_address(listen):
            self.bad(
                (*at, "listen"),
                f"{listen} is not a loopback address, and the embedded NATS server would let anyone "
                "there in: set user_env and password_env, or token_env (environment variables holding "
                "the secret)",
            )

    def node(self, at: validate.Path, node: dict[Any, Any]) -> None:
        node_id = _text(node, "id")
        if node_id in self.nodes:
            self.bad((*at, "id"), f"duplicate node id {node_id!r} (also {render(self.nodes[node_id])})")
        elif node_id is not None:
            self.nodes[node_id] = at
        name = node_id or render(at)
        adapters: dict[str, str | None] = {}
        for j, adapter in _entries(node, "adapters"):
            adapter_id, kind = _text(adapter, "id"), adapter.get("type")
            if adapter_id in adapters:
                self.bad((*at, "adapters", j, "id"), f"duplicate adapter id {adapter_id!r} in node {name!r}")
            elif adapter_id is not None:
                adapters[adapter_id] = kind if isinstance(kind, str) and kind in _ADAPTER_TYPES else None
        for k, provider in _entries(node, "providers"):
            self.provider((*at, "providers", k), provider, name, adapters)
        if node.get("concurrency") is not None:
            self.warnings.append(Problem((*at, "concurrency"), _LEGACY))
        runtime = node.get("runtime")
        if isinstance(runtime, dict) and runtime.get("concurrency") is not None:
            self.warnings.append(Problem((*at, "runtime", "concurrency"), _LEGACY))

    def provider(self, at: validate.Path, provider: dict[Any, Any], node: str, adapters: dict[str, str | None]) -> None:
        ref = provider.get("adapter")
        if not isinstance(ref, str):
            ref = None  # the structural check reports it
        if ref is not None and ref not in adapters:
            theirs = _listing(list(adapters))
            self.bad((*at, "adapter"), f"{ref!r} is not an adapter of node {node!r} (its adapters: {theirs})")
        kind = adapters.get(ref) if ref is not None else None
        has_capacity = provider.get("capacity") is not None
        if kind == _CLI_TYPE and has_capacity:
            self.bad((*at, "capacity"), f"not allowed: {ref!r} is a cli adapter; CLI resources are unlimited")
        elif kind is not None and kind != _CLI_TYPE and not has_capacity:
            self.bad(
                (*at, "capacity"),
                f"missing: a provider on {kind} adapter {ref!r} needs a capacity "
                "(how many requests it serves at once, at least 1)",
            )
        provider_id = _text(provider, "id")
        if provider_id is None:
            return
        first = self.providers.get(provider_id)
        if first is not None:
            self.bad(
                (*at, "id"),
                f"duplicate provider id {provider_id!r}, also {render(first.path)} on node "
                f"{first.node!r} (provider ids are unique across the deployment)",
            )
        else:
            self.providers[provider_id] = _Seen(at, node, kind)

    def model(self, at: validate.Path, model: dict[Any, Any]) -> None:
        pool, route = model.get("pool"), model.get("route")
        if pool is None and route is None:
            self.bad(at, "needs a pool (provider ids) or a route (node/provider)")
        elif pool is not None and route is not None:
            self.bad((*at, "route"), "an alias has a pool or a route, not both")
        if isinstance(pool, list):
            for k, member in enumerate(pool):
                if isinstance(member, str):
                    message = self.pool_member_problem(member, pool[:k])
                    if message:
                        self.bad((*at, "pool", k), message)
                    self.used.add(member)
        if isinstance(route, str):
            message = self.route_problem(route)
            if message:
                self.bad((*at, "route"), message)
            self.used.add(route.partition("/")[2])

    def pool_member_problem(self, member: str, before: list[Any]) -> str | None:
        seen = self.providers.get(member)
        if seen is None:
            return f"no provider {member!r}{_near(member, self.providers)}"
        if seen.adapter_type == _CLI_TYPE:
            return (
                f"{member!r} is a CLI resource (unlimited, no capacity) and cannot be in a pool; "
                f"route an alias to it instead: route: {seen.node}/{member}"
            )
        return f"{member!r} is listed twice" if member in before else None

    def route_problem(self, route: str) -> str | None:
        node_id, sep, provider_id = route.partition("/")
        if not (sep and node_id and provider_id) or "/" in provider_id:
            return f"expected node/provider, got {route!r}"
        if node_id not in self.nodes:
            return f"no node {node_id!r}{_near(node_id, self.nodes)}"
        seen = self.providers.get(provider_id)
        if seen is None or seen.node != node_id:
            on_node = [p for p, s in self.providers.items() if s.node == node_id]
            hint = f"; {provider_id!r} is on node {seen.node!r}" if seen else _near(provider_id, on_node)
            return f"node {node_id!r} has no provider {provider_id!r} (its providers: {_listing(on_node)}){hint}"
        if seen.adapter_type is not None and seen.adapter_type != _CLI_TYPE:
            return f"{provider_id!r} is not a CLI resource (it has a capacity); put it in a pool instead"
        return None


def parse(text: str, source: str = "<config>") -> Loaded:
    """Validate the YAML text of a deployment file; raise ConfigError listing every problem."""
    try:
        doc = validate.read_yaml(text)
    except validate.YamlSyntaxError as exc:
        where = f"{source}: line {exc.line}, column {exc.column}" if exc.line else source
        raise ConfigError([f"{where}: not valid YAML: {exc.message}"]) from exc
    if doc is None or doc.data is None:
        raise ConfigError([f"{source}: the file is empty; a deployment needs at least models and nodes"])
    if not isinstance(doc.data, dict):
        kind = "a list" if isinstance(doc.data, list) else f"{type(doc.data).__name__} {doc.data!r}"
        raise ConfigError([f"{source}: the top level must be a mapping (edge, models, nodes), not {kind}"])
    cross = _CrossCheck()
    cross.run(doc.data)
    structural = _CHECKER.check(doc.data, _DEPLOYMENT_TYPE)
    problems = list(dict.fromkeys([*doc.duplicate_keys, *structural, *cross.problems]))
    if problems:
        raise ConfigError([str(p) for p in doc.in_order(problems)])
    try:
        dep = msgspec.convert(doc.data, Deployment)
    except msgspec.ValidationError as exc:  # the walker missed a rule msgspec knows: still one clear line
        raise ConfigError([f"{source}: {exc}"]) from exc
    return Loaded(deployment=dep, warnings=[str(w) for w in doc.in_order(cross.warnings)])


def load(path: str | Path) -> Loaded:
    """Read and validate a deployment file."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except FileNotFoundError as exc:
        raise ConfigError([f"{p}: no such file"]) from exc
    except OSError as exc:
        raise ConfigError([f"{p}: cannot read: {exc.strerror or exc}"]) from exc
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise ConfigError([f"{p}: line {line}: not UTF-8 text"]) from exc
    loaded = parse(text, str(p))
    loaded.path = p
    return loaded


# --- presentation --------------------------------------------------------------------------------


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def _what(ref: ProviderRef, alias_model: str) -> str:
    adapter, model = ref.adapter, ref.provider.model or alias_model
    if isinstance(adapter, CliAdapter):
        return shlex.join(adapter.command)
    if isinstance(adapter, OpenAIAdapter):
        return f"{model} at {adapter.base_url} ({adapter.api})"
    return f"{model} ({adapter.tokens} tokens, first after {adapter.latency_ms:g} ms)"


def summary(loaded: Loaded) -> str:
    """What `iop config check` prints for a valid file: counts, nodes, providers, pools, routes, warnings."""
    dep = loaded.deployment
    catalog = Catalog.of(dep)
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


def _kind(ref: ProviderRef) -> str:
    return str(type(ref.adapter).__struct_config__.tag)


def json_schema_text() -> str:
    """The JSON Schema of the deployment file, for editors (e.g. yaml-language-server)."""
    schema = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "iop deployment file",
        **msgspec.json.schema(Deployment),
    }
    return json.dumps(schema, indent=2)
