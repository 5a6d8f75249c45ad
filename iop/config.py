"""The deployment file: one YAML document describing the edge, the model aliases and every node."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

import msgspec
import msgspec.inspect
from msgspec import Meta

from iop import crosscheck, policy, tenancy, tracingconf, validate, yamldoc
from iop.edgeconf import HttpSettings, LedgerSettings, QueueSettings, ResponsesSettings
from iop.errors import ConfigError
from iop.serverconf import ServerSettings

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


class ClusterSettings(_Strict):
    """The embedded nats-server as one member of a NATS cluster (one per edge machine)."""

    name: Annotated[
        Id, Meta(description="The cluster's name: the same on every member (a member with another is refused).")
    ]
    listen: Annotated[Address, Meta(description="host:port this member accepts routes from the others on.")]
    routes: Annotated[
        list[Address],
        Meta(description="host:port of the other members' cluster listen addresses (this one may be listed too)."),
    ] = msgspec.field(default_factory=list)
    server_name: Annotated[
        Id | None,
        Meta(description="This member's JetStream name, unique in the cluster (default: host name and route port)."),
    ] = None
    start_wait_s: Annotated[
        Seconds,
        Meta(description="How long the edge waits at start for the other members and a JetStream leader."),
    ] = 30.0


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
    replicas: Annotated[
        int,
        Meta(
            ge=1,
            le=5,
            description="Copies of the work stream, the KV buckets and the ledger kept by a NATS cluster "
            "(1: one server; 3 on a 3-server cluster survives losing one). Changed in place on restart.",
        ),
    ] = 1
    cluster: Annotated[
        ClusterSettings | None,
        Meta(description="Make the embedded server a member of a NATS cluster (url: embedded only)."),
    ] = None

    def has_credentials(self) -> bool:
        return bool(self.token_env or (self.user_env and self.password_env))


class EdgeSettings(_Strict):
    """The HTTP front: where it listens, how it reaches NATS, how pools queue."""

    listen: Annotated[Address, Meta(description="host:port of the OpenAI-compatible HTTP API.")] = "127.0.0.1:8080"
    nats: NatsSettings = msgspec.field(default_factory=NatsSettings)
    queue: QueueSettings = msgspec.field(default_factory=QueueSettings)
    http: HttpSettings = msgspec.field(default_factory=HttpSettings)
    api_keys_env: Annotated[
        EnvName | None,
        Meta(
            description="Environment variable holding comma-separated client keys (`key` or `name:key`), "
            "required on /v1/* and /status; the variable must hold at least one key. Not set here: no "
            "client auth, allowed only on a loopback listen address unless allow_anonymous is true."
        ),
    ] = None
    admin_keys_env: Annotated[
        EnvName | None,
        Meta(
            description="Environment variable holding comma-separated admin keys (`key` or `name:key`), "
            "required on /admin/*; client keys never open those. Not set here: /admin/* answers only "
            "requests from this machine (loopback)."
        ),
    ] = None
    allow_anonymous: Annotated[
        bool,
        Meta(description="Serve a non-loopback listen address without client keys (anyone there can use every model)."),
    ] = False
    allowed_hosts: Annotated[
        list[Annotated[str, Meta(min_length=1, max_length=253, pattern=r"^(\*|[A-Za-z0-9_.-]+)$")]],
        Meta(
            description="Host names clients reach the edge by (`iop.example.com`), besides its IP addresses, "
            "localhost and the listen address: a request whose Host is none of them gets 403 (what stops a "
            "page on a re-pointed name, DNS rebinding). `*` accepts any."
        ),
    ] = msgspec.field(default_factory=list)
    max_body_mb: Annotated[
        float,
        Meta(
            gt=0,
            le=1024,
            description="Largest request body accepted, in MiB (413 above it). Bodies larger than one NATS "
            "message are carried to the node in parts.",
        ),
    ] = 32.0
    ledger: LedgerSettings = msgspec.field(default_factory=LedgerSettings)
    responses: ResponsesSettings = msgspec.field(default_factory=ResponsesSettings)
    metrics_public: Annotated[
        bool, Meta(description="Serve /metrics without a client key (for a Prometheus that holds none).")
    ] = False
    tenants: tenancy.TenantsField = msgspec.field(default_factory=dict)
    tenant_defaults: tenancy.DefaultsField = msgspec.field(default_factory=tenancy.TenantPolicy)


class ModelAlias(_Strict):
    """A model name clients ask for, served by a pool of providers or routed to one CLI resource."""

    alias: Annotated[Alias, Meta(description="The `model` clients send.")]
    pool: Annotated[
        Annotated[list[str], Meta(min_length=1)] | None,
        Meta(description="Provider ids whose capacity serves this alias (a provider pool)."),
    ] = None
    route: Annotated[str | None, Meta(description="`node/provider`: a direct route to one CLI resource.")] = None
    affinity_wait_ms: Annotated[
        Millis,
        Meta(
            description="Pools: how long a request with a session key may wait for the provider that "
            "served its session last while another is free (prefix-cache affinity). 0: never waits."
        ),
    ] = 0.0
    routing: Annotated[policy.Routing, Meta(description=policy.ROUTING_HELP)] = "expected_finish"
    deadline_ms: Annotated[policy.Deadline | None, Meta(description=policy.DEADLINE_HELP)] = None


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


UpstreamApi = Literal["chat", "responses", "messages", "embeddings", "completions"]
"""An endpoint an upstream serves itself (iop/endpoints.py)."""


class OpenAIAdapter(_Strict, tag="openai", tag_field="type"):
    """An upstream OpenAI-compatible server (vLLM, MLX, llama.cpp, ...)."""

    id: Id
    base_url: Annotated[
        str, Meta(extra={"format": "http_url"}, description="The upstream's API root, e.g. http://h:8000/v1.")
    ]
    api: Annotated[
        Literal["chat", "responses", "both"] | Annotated[list[UpstreamApi], Meta(min_length=1)],
        Meta(
            description="What the upstream serves: /chat/completions, /responses, or both; or a list of "
            "the endpoints it serves (chat, responses, messages, embeddings, completions)."
        ),
    ] = "chat"
    api_key_env: Annotated[EnvName | None, Meta(description="Environment variable holding the upstream's API key.")] = (
        None
    )
    timeout_s: Annotated[
        Seconds, Meta(description="Upper bound on one upstream request, from sending it to its answer's last byte.")
    ] = 600.0
    idle_timeout_s: Annotated[
        Seconds,
        Meta(description="Longest silence from the upstream while it answers (before the head or between bytes)."),
    ] = 300.0
    vision: Annotated[
        bool,
        Meta(
            description="The model takes images: when translating Responses to chat, input_image parts pass "
            "as image_url parts (else they become a short text placeholder)."
        ),
    ] = False
    tokenize: Annotated[
        Literal["vllm", "llama.cpp"] | None,
        Meta(
            description="The upstream counts tokens for /v1/messages/count_tokens: vLLM's /tokenize, or "
            "llama.cpp's /apply-template and /tokenize (at the server's root); unset: iop's estimate."
        ),
    ] = None
    replay_reasoning: Annotated[
        bool,
        Meta(
            description="When translating Responses to chat, earlier reasoning items go back as the "
            "assistant's reasoning_content (for chat templates that interleave thinking with tool calls)."
        ),
    ] = False
    server: Annotated[
        ServerSettings | None,
        Meta(description="The model server this node starts on demand, stops when idle and swaps in a group."),
    ] = None


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
    policy: Annotated[policy.LifecyclePolicy | None, Meta(description=policy.POLICY_HELP)] = None


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
    tracing: tracingconf.TracingSettings = msgspec.field(default_factory=tracingconf.TracingSettings)

    def node(self, node_id: str) -> Node:
        return {n.id: n for n in self.nodes}[node_id]  # KeyError for an id the deployment does not have


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
    affinity_wait_s: dict[str, float] = field(default_factory=dict)
    """Pools whose `affinity_wait_ms` is not 0, in seconds."""

    @classmethod
    def of(cls, dep: Deployment) -> Catalog:
        providers = {
            p.id: ProviderRef(node=n, provider=p, adapter=n.adapter(p.adapter)) for n in dep.nodes for p in n.providers
        }
        pools: dict[str, list[str]] = {}
        routes: dict[str, tuple[str, str]] = {}
        waits: dict[str, float] = {}
        for m in dep.models:
            if m.pool is not None:
                pools[m.alias] = list(m.pool)
                if m.affinity_wait_ms:
                    waits[m.alias] = m.affinity_wait_ms / 1000
            elif m.route is not None:
                node_id, _, prov = m.route.partition("/")
                routes[m.alias] = (node_id, prov)
        return cls(providers=providers, pools=pools, routes=routes, affinity_wait_s=waits)


@dataclass
class Loaded:
    """A validated deployment and the warnings it raised."""

    deployment: Deployment
    warnings: list[str]
    path: Path | None = None


_CHECKER = validate.Checker(validate.FORMATS)
_DEPLOYMENT_TYPE = msgspec.inspect.type_info(Deployment)
_EDGE_DEFAULTS = EdgeSettings()
_CROSS_DEFAULTS = crosscheck.Defaults(
    cli_type=str(CliAdapter.__struct_config__.tag),
    adapter_types=frozenset(str(c.__struct_config__.tag) for c in (CliAdapter, OpenAIAdapter, MockAdapter)),
    edge_listen=_EDGE_DEFAULTS.listen,
    nats_url=_EDGE_DEFAULTS.nats.url,
    nats_listen=_EDGE_DEFAULTS.nats.listen,
)


def parse(text: str, source: str = "<config>") -> Loaded:
    """Validate the YAML text of a deployment file; raise ConfigError listing every problem."""
    try:
        doc = yamldoc.read_yaml(text)
    except yamldoc.YamlSyntaxError as exc:
        where = f"{source}: line {exc.line}, column {exc.column}" if exc.line else source
        raise ConfigError([f"{where}: not valid YAML: {exc.message}"]) from exc
    if doc is None or doc.data is None:
        raise ConfigError([f"{source}: the file is empty; a deployment needs at least models and nodes"])
    if not isinstance(doc.data, dict):
        kind = "a list" if isinstance(doc.data, list) else f"{type(doc.data).__name__} {doc.data!r}"
        raise ConfigError([f"{source}: the top level must be a mapping (edge, models, nodes), not {kind}"])
    cross = crosscheck.CrossCheck(_CROSS_DEFAULTS)
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
