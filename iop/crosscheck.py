"""The rules that relate one part of a deployment file to another: unique ids, references, capacity.

They read the raw YAML data (not Structs) so that they run even when the structural check failed
somewhere else, and the person fixing the file sees every problem at once.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from iop import tenancy
from iop.validate import FORMATS, is_loopback, suggest
from iop.yamldoc import Path, Problem, render


@dataclass(frozen=True)
class Defaults:
    """What the cross-check knows of the deployment Structs; config.py fills it, so no import runs back."""

    cli_type: str
    """The `type` tag of the cli adapter."""
    adapter_types: frozenset[str]
    edge_listen: str
    nats_url: str
    nats_listen: str


_LEGACY = (
    "legacy setting: it no longer gates admission (each provider's capacity does) and is kept as metadata for status"
)


def _is_open_address(listen: object) -> bool:
    """A well-formed listen address on a host other than loopback (malformed ones are reported elsewhere)."""
    if not isinstance(listen, str) or FORMATS["address"](listen) is not None:
        return False
    return not is_loopback(listen.rpartition(":")[0])


def _cluster_members(cluster: dict[Any, Any]) -> int:
    """Servers in an embedded cluster as the file names them: this member and its distinct routes."""
    routes = cluster.get("routes") or []
    names = {str(r) for r in routes if isinstance(r, str)} | {str(cluster.get("listen"))}
    return len(names)


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
    hint = suggest(word, choices)
    return f"; did you mean {hint!r}?" if hint else ""


@dataclass
class _Seen:
    """What the cross-reference pass learnt about one provider."""

    path: Path
    node: str
    adapter_type: str | None


class CrossCheck:
    """Rules relating one part of the file to another: unique ids, references, capacity.

    It reads the raw data (not Structs) so that it can run even when the structural check failed
    somewhere else, and the user sees every problem in one go.
    """

    def __init__(self, defaults: Defaults) -> None:
        self.defaults = defaults
        self.problems: list[Problem] = []
        self.warnings: list[Problem] = []
        self.nodes: dict[str, Path] = {}
        self.providers: dict[str, _Seen] = {}
        self.used: set[str] = set()

    def bad(self, path: Path, message: str) -> None:
        self.problems.append(Problem(path, message))

    def run(self, data: dict[Any, Any]) -> None:
        edge = data.get("edge")
        if isinstance(edge, dict):
            self.edge(edge)
        for i, node in _entries(data, "nodes"):
            self.node(("nodes", i), node)
        aliases: dict[str, Path] = {}
        for i, model in _entries(data, "models"):
            alias = _text(model, "alias")
            if alias in aliases:
                self.bad(("models", i, "alias"), f"duplicate alias {alias!r} (also {render(aliases[alias])})")
            elif alias is not None:
                aliases[alias] = ("models", i)
            self.model(("models", i), model)
        if isinstance(edge, dict):
            pools = {a for a in aliases if isinstance(data["models"][aliases[a][1]].get("pool"), list)}
            self.problems.extend(tenancy.cross_check(edge, pools))
        for provider_id, seen in self.providers.items():
            if provider_id not in self.used and seen.adapter_type is not None:
                how = "alias routes to it" if seen.adapter_type == self.defaults.cli_type else "pool lists it"
                self.warnings.append(Problem(seen.path, f"{provider_id!r} gets no work: no {how}"))

    def edge(self, edge: dict[Any, Any]) -> None:
        listen = edge.get("listen", self.defaults.edge_listen)
        if edge.get("api_keys_env") is None and _is_open_address(listen):
            if edge.get("allow_anonymous") is True:
                self.warnings.append(
                    Problem(
                        ("edge", "allow_anonymous"),
                        f"{listen} is not a loopback address and api_keys_env is not set: "
                        "anyone who reaches it can use every model",
                    )
                )
            else:
                self.bad(
                    ("edge", "listen"),
                    f"{listen} is not a loopback address and api_keys_env is not set: anyone who reaches it "
                    "could use every model; set api_keys_env, or allow_anonymous: true if that is meant",
                )
        nats = edge.get("nats")
        if isinstance(nats, dict):
            self.nats(("edge", "nats"), nats)

    def nats(self, at: Path, nats: dict[Any, Any]) -> None:
        """Credentials come as a pair or a token; the embedded server takes only per-node users."""
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
        replicas, cluster = nats.get("replicas", 1), nats.get("cluster")
        embedded = nats.get("url", self.defaults.nats_url) == "embedded"
        if cluster is not None and not embedded:
            self.bad((*at, "cluster"), "applies to the embedded server (url: embedded); an external cluster is its own")
        elif isinstance(replicas, int) and not isinstance(replicas, bool) and replicas > 1 and embedded:
            members = _cluster_members(cluster) if isinstance(cluster, dict) else 1
            if members < replicas:
                where = f"a cluster of {members} servers (cluster.listen and routes)" if cluster else "one server"
                self.bad(
                    (*at, "replicas"),
                    f"{replicas} replicas need at least {replicas} JetStream servers, and the embedded NATS is {where}"
                    + ("" if cluster else ": add edge.nats.cluster, or set replicas: 1"),
                )
        if not embedded:
            return
        for name in ("tls_ca", "tls_cert", "tls_key"):
            if nats.get(name) is not None:
                self.bad(
                    (*at, name),
                    "applies to an external NATS (url: tls://...); the embedded server does not serve TLS",
                )
        if token:
            # The embedded server always requires credentials, one user per node (iop/auth.py).
            self.bad(
                (*at, "token_env"),
                "the embedded server gives each node its own user, and one token cannot say which node: "
                "use user_env/password_env (each node's machine sets its own, see `iop nats-creds`)",
            )

    def node(self, at: Path, node: dict[Any, Any]) -> None:
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
                adapters[adapter_id] = kind if isinstance(kind, str) and kind in self.defaults.adapter_types else None
        for k, provider in _entries(node, "providers"):
            self.provider((*at, "providers", k), provider, name, adapters)
        self.servers(at, node)
        if node.get("concurrency") is not None:
            self.warnings.append(Problem((*at, "concurrency"), _LEGACY))
        runtime = node.get("runtime")
        if isinstance(runtime, dict) and runtime.get("concurrency") is not None:
            self.warnings.append(Problem((*at, "runtime", "concurrency"), _LEGACY))

    def servers(self, at: Path, node: dict[Any, Any]) -> None:
        """Each managed server says how it is ready; a group has one size, whichever member says it."""
        sizes: dict[str, tuple[object, Path]] = {}
        for j, adapter in _entries(node, "adapters"):
            server = adapter.get("server")
            if not isinstance(server, dict):
                continue
            where = (*at, "adapters", j, "server")
            url, line = server.get("ready_url") is not None, server.get("ready_log") is not None
            if url and line:
                self.bad((*where, "ready_log"), "use ready_url or ready_log, not both")
            elif not (url or line):
                self.bad(
                    where,
                    "needs ready_url (a URL answering 200 once the model is loaded) or ready_log "
                    "(a regular expression matching the server's ready line)",
                )
            group = _text(server, "group")
            if group is None:
                continue
            size = server.get("group_size", 1)
            first = sizes.setdefault(group, (size, (*where, "group_size")))
            if first[0] != size:
                self.bad(
                    (*where, "group_size"),
                    f"group {group!r} has group_size {first[0]!r} at {render(first[1])}; one group, one size",
                )

    def provider(self, at: Path, provider: dict[Any, Any], node: str, adapters: dict[str, str | None]) -> None:
        ref = provider.get("adapter")
        if not isinstance(ref, str):
            ref = None  # the structural check reports it
        if ref is not None and ref not in adapters:
            theirs = _listing(list(adapters))
            self.bad((*at, "adapter"), f"{ref!r} is not an adapter of node {node!r} (its adapters: {theirs})")
        kind = adapters.get(ref) if ref is not None else None
        has_capacity = provider.get("capacity") is not None
        if kind == self.defaults.cli_type and has_capacity:
            self.bad((*at, "capacity"), f"not allowed: {ref!r} is a cli adapter; CLI resources are unlimited")
        elif kind is not None and kind != self.defaults.cli_type and not has_capacity:
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

    def model(self, at: Path, model: dict[Any, Any]) -> None:
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
        if seen.adapter_type == self.defaults.cli_type:
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
        if seen.adapter_type is not None and seen.adapter_type != self.defaults.cli_type:
            return f"{provider_id!r} is not a CLI resource (it has a capacity); put it in a pool instead"
        return None
