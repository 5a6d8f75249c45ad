"""Check YAML data against msgspec types, collecting every problem with its path and position.

msgspec stops at the first invalid value; a person fixing a deployment file wants the whole list at
once. So the walker here reads the Struct definitions (`msgspec.inspect`) and the raw YAML data side
by side, and `msgspec.convert` runs only once the data is known to be clean. The rules that relate
one part of the file to another (unique ids, references, capacity, credentials) are `CrossCheck`.
"""

from __future__ import annotations

import difflib
import ipaddress
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import msgspec.inspect as mi
import yaml

ID_PATTERN = r"^[A-Za-z0-9_-]+$"
"""Node, adapter and provider ids: they become NATS subject tokens."""

Path = tuple[str | int, ...]
Position = tuple[int, int]

Format = Callable[[str], str | None]
"""A named check of a string value (`Meta(extra={"format": name})`): a problem message or None."""


def render(path: Path) -> str:
    """`("nodes", 0, "id")` → `nodes[0].id`."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


@dataclass(frozen=True)
class Problem:
    """One thing wrong (or worth a warning) at one place in the document."""

    path: Path
    message: str

    def __str__(self) -> str:
        return f"{render(self.path)}: {self.message}" if self.path else self.message


@dataclass
class Document:
    """Parsed YAML plus where each path starts, so problems can be reported in document order."""

    data: Any
    positions: dict[Path, Position] = field(default_factory=dict)
    duplicate_keys: list[Problem] = field(default_factory=list)

    def position(self, path: Path) -> Position:
        # A missing field has no position of its own; its parent mapping's is the next best thing.
        for end in range(len(path), -1, -1):
            pos = self.positions.get(path[:end])
            if pos is not None:
                return pos
        return (0, 0)

    def in_order(self, problems: Iterable[Problem]) -> list[Problem]:
        return sorted(problems, key=lambda p: self.position(p.path))


class YamlSyntaxError(Exception):
    """The text is not YAML; `line` and `column` are 1-based when known."""

    def __init__(self, message: str, line: int | None, column: int | None) -> None:
        super().__init__(message)
        self.message = message
        self.line = line
        self.column = column


def read_yaml(text: str) -> Document | None:
    """Parse one YAML document keeping positions; None for a document with no content at all."""
    loader = yaml.SafeLoader(text)
    try:
        root = loader.get_single_node()
        if root is None:
            return None
        doc = Document(data=None)
        # Index before constructing: construction flattens `<<` merge keys into their mapping,
        # which would look like duplicate keys.
        _index(root, (), doc, set())
        doc.data = loader.construct_document(root)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        what = exc.problem or exc.context or "not valid YAML"
        if exc.problem and exc.context:
            what += f" ({exc.context})"
        raise YamlSyntaxError(what, mark.line + 1 if mark else None, mark.column + 1 if mark else None) from exc
    except yaml.YAMLError as exc:
        raise YamlSyntaxError(str(exc), None, None) from exc
    finally:
        loader.dispose()
    return doc


def _index(node: yaml.Node, path: Path, doc: Document, active: set[int]) -> None:
    if id(node) in active:
        mark = node.start_mark
        raise YamlSyntaxError("an alias refers to a node that contains it", mark.line + 1, mark.column + 1)
    doc.positions.setdefault(path, (node.start_mark.line, node.start_mark.column))
    if not isinstance(node, yaml.MappingNode | yaml.SequenceNode):
        return
    active.add(id(node))
    if isinstance(node, yaml.MappingNode):
        seen: dict[object, int] = {}
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            line = key_node.start_mark.line + 1
            if key is None:
                continue
            child = (*path, key)
            if key in seen:
                doc.duplicate_keys.append(Problem(child, f"duplicate key (also on line {seen[key]})"))
            seen[key] = line
            doc.positions[child] = (key_node.start_mark.line, key_node.start_mark.column)
            _index(value_node, child, doc, active)
    else:
        for i, item in enumerate(node.value):
            _index(item, (*path, i), doc, active)
    active.discard(id(node))


def suggest(word: str, choices: Iterable[str]) -> str | None:
    """The closest of `choices` to a misspelt `word`, if any is close."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return close[0] if close else None


def _got(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        text = repr(value)
        return text if len(text) <= 40 else text[:37] + "...'"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return f"a {type(value).__name__}"


class Checker:
    """Walks data against a `msgspec.inspect` type; `formats` name extra checks for strings."""

    def __init__(self, formats: Mapping[str, Format]) -> None:
        self.formats = formats

    def check(self, value: object, t: mi.Type, path: Path = ()) -> list[Problem]:
        out: list[Problem] = []
        self._check(value, t, path, out)
        return out

    def _check(self, value: object, t: mi.Type, path: Path, out: list[Problem]) -> None:
        fmt: str | None = None
        while isinstance(t, mi.Metadata):
            if t.extra and "format" in t.extra:
                fmt = t.extra["format"]
            t = t.type
        if isinstance(t, mi.UnionType):
            self._union(value, t, path, out, fmt)
        elif isinstance(t, mi.StructType):
            if not isinstance(value, dict):
                out.append(Problem(path, f"expected a mapping, got {_got(value)}"))
            else:
                self._struct(value, t, path, out)
        elif isinstance(t, mi.ListType):
            if not isinstance(value, list):
                out.append(Problem(path, f"expected a list, got {_got(value)}"))
                return
            if t.min_length and len(value) < t.min_length:
                need = "must not be empty" if t.min_length == 1 else f"needs at least {t.min_length} items"
                out.append(Problem(path, need))
            for i, item in enumerate(value):
                self._check(item, t.item_type, (*path, i), out)
        elif isinstance(t, mi.StrType):
            self._str(value, t, path, out, fmt)
        elif isinstance(t, mi.IntType | mi.FloatType):
            self._number(value, t, path, out)
        elif isinstance(t, mi.LiteralType):
            if value not in t.values:
                allowed = ", ".join(str(v) for v in t.values)
                near = suggest(value, map(str, t.values)) if isinstance(value, str) else None
                hint = f"; did you mean {near!r}?" if near else ""
                out.append(Problem(path, f"expected one of {allowed}, got {_got(value)}{hint}"))
        elif isinstance(t, mi.BoolType):
            if not isinstance(value, bool):
                out.append(Problem(path, f"expected true or false, got {_got(value)}"))
        elif isinstance(t, mi.NoneType):
            if value is not None:
                out.append(Problem(path, f"expected null, got {_got(value)}"))
        elif not isinstance(t, mi.AnyType):
            raise TypeError(f"the config checker does not handle {t!r} yet")

    def _union(self, value: object, t: mi.UnionType, path: Path, out: list[Problem], fmt: str | None) -> None:
        if value is None and t.includes_none:
            return
        members = [m for m in t.types if not isinstance(m, mi.NoneType)]
        if members and all(isinstance(m, mi.StructType) and m.tag is not None for m in members):
            self._tagged(value, [m for m in members if isinstance(m, mi.StructType)], path, out)
        elif len(members) == 1:
            self._check(value, _with_format(members[0], fmt), path, out)
        else:
            attempts = [self.check(value, m, path) for m in members]
            if all(attempts):
                # A list is told what is wrong inside it, not that it should have been a string.
                same_kind = [
                    a for m, a in zip(members, attempts, strict=True) if _is_list(m) == isinstance(value, list)
                ]
                out.extend(same_kind[0] if same_kind else attempts[0])

    def _tagged(self, value: object, members: list[mi.StructType], path: Path, out: list[Problem]) -> None:
        if not isinstance(value, dict):
            out.append(Problem(path, f"expected a mapping, got {_got(value)}"))
            return
        tag_field = members[0].tag_field or "type"
        by_tag = {str(m.tag): m for m in members}
        known = ", ".join(by_tag)
        tag = value.get(tag_field)
        if tag is None:
            out.append(Problem((*path, tag_field), f"missing (required: one of {known})"))
        elif not isinstance(tag, str) or tag not in by_tag:
            hint = suggest(tag, by_tag) if isinstance(tag, str) else None
            near = f"; did you mean {hint!r}?" if hint else ""
            out.append(Problem((*path, tag_field), f"unknown type {_got(tag)} (known types: {known}){near}"))
        else:
            self._struct(value, by_tag[tag], path, out)

    def _struct(self, value: dict[Any, Any], t: mi.StructType, path: Path, out: list[Problem]) -> None:
        fields = {f.encode_name: f for f in t.fields}
        known = [*([t.tag_field] if t.tag_field else []), *fields]
        for key, item in value.items():
            name = str(key)
            f = fields.get(name) if isinstance(key, str) else None
            if f is not None:
                self._check(item, f.type, (*path, name), out)
            elif name == t.tag_field:
                continue
            elif t.forbid_unknown_fields:
                hint = suggest(name, known)
                detail = f"did you mean {hint!r}?" if hint else f"known fields: {', '.join(known)}"
                out.append(Problem((*path, name), f"unknown field; {detail}"))
        for f in t.fields:
            if f.required and f.encode_name not in value:
                out.append(Problem((*path, f.encode_name), "missing (required)"))

    def _str(self, value: object, t: mi.StrType, path: Path, out: list[Problem], fmt: str | None) -> None:
        if not isinstance(value, str):
            out.append(Problem(path, f"expected a string, got {_got(value)}"))
            return
        if fmt is not None:
            # A named format knows how to explain itself better than a bare regular expression.
            message = self.formats[fmt](value)
            if message:
                out.append(Problem(path, message))
        elif t.min_length and len(value) < t.min_length:
            out.append(Problem(path, "must not be empty"))
        elif t.pattern and not re.search(t.pattern, value):
            out.append(Problem(path, f"{_got(value)} does not match {t.pattern}"))

    def _number(self, value: object, t: mi.IntType | mi.FloatType, path: Path, out: list[Problem]) -> None:
        # bool is an int to Python but not to msgspec; a float is never an int, even 2.0.
        is_int = isinstance(value, int) and not isinstance(value, bool)
        if isinstance(t, mi.IntType) and not is_int:
            out.append(Problem(path, f"expected an integer, got {_got(value)}"))
            return
        if not (is_int or isinstance(value, float)):
            out.append(Problem(path, f"expected a number, got {_got(value)}"))
            return
        assert isinstance(value, int | float)
        bounds = (
            (t.ge, value >= t.ge if t.ge is not None else True, "at least"),
            (t.gt, value > t.gt if t.gt is not None else True, "greater than"),
            (t.le, value <= t.le if t.le is not None else True, "at most"),
            (t.lt, value < t.lt if t.lt is not None else True, "less than"),
        )
        for bound, ok, words in bounds:
            if not ok:
                out.append(Problem(path, f"must be {words} {bound}, got {_got(value)}"))
                return


def _with_format(t: mi.Type, fmt: str | None) -> mi.Type:
    return mi.Metadata(t, extra={"format": fmt}) if fmt is not None else t


# --- string formats named by `Meta(extra={"format": ...})` in the Structs ----------------------


def _id_problem(value: str) -> str | None:
    if not value:
        return "must not be empty"
    if re.match(ID_PATTERN, value):
        return None
    return (
        f"{value!r} is not a valid id: use only letters, digits, '_' and '-' "
        "(ids become NATS subject tokens, where '.', '*', '>' and spaces have meaning)"
    )


def _alias_problem(value: str) -> str | None:
    if not value:
        return "must not be empty"
    return f"{value!r}: an alias may not contain whitespace" if re.search(r"\s", value) else None


def _port_ok(port: str) -> bool:
    # 0 asks the OS for a free port: `iop smoke` runs its own edge that way, and reads the bound ports back.
    return re.fullmatch(r"[0-9]{1,5}", port) is not None and 0 <= int(port) <= 65535


def _address_problem(value: str) -> str | None:
    host, sep, port = value.rpartition(":")
    if sep and host and not re.search(r"\s", host) and _port_ok(port):
        return None
    return f"expected host:port with a port from 0 to 65535, got {value!r}"


def _url_ok(value: str, schemes: tuple[str, ...]) -> bool:
    try:
        url = urlsplit(value)
        _ = url.port  # raises on a port that is not a number in range
    except ValueError:
        return False
    return url.scheme in schemes and bool(url.hostname)


def _nats_url_problem(value: str) -> str | None:
    if value == "embedded":
        return None
    for item in value.split(","):
        if not _url_ok(item.strip(), ("nats", "tls")):
            return f"expected 'embedded' or comma-separated nats:// or tls:// URLs, and {item.strip()!r} is not one"
    return None


def _http_url_problem(value: str) -> str | None:
    if _url_ok(value, ("http", "https")):
        return None
    return f"expected an http:// or https:// URL with a host, got {value!r}"


def _env_problem(value: str) -> str | None:
    if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", value):
        return None
    return f"{value!r} is not an environment variable name (letters, digits, '_'; not starting with a digit)"


FORMATS: dict[str, Format] = {
    "id": _id_problem,
    "alias": _alias_problem,
    "address": _address_problem,
    "nats_url": _nats_url_problem,
    "http_url": _http_url_problem,
    "env": _env_problem,
}


# --- rules across fields and sections ------------------------------------------------------------


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
        if node.get("concurrency") is not None:
            self.warnings.append(Problem((*at, "concurrency"), _LEGACY))
        runtime = node.get("runtime")
        if isinstance(runtime, dict) and runtime.get("concurrency") is not None:
            self.warnings.append(Problem((*at, "runtime", "concurrency"), _LEGACY))

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


def _is_list(t: mi.Type) -> bool:
    while isinstance(t, mi.Metadata):
        t = t.type
    return isinstance(t, mi.ListType)
