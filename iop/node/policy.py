"""What a node's own operator allows it to run, whatever catalog the edge publishes.

The edge's administrators choose the catalog; the operator of each node machine chooses what may
run there. A catalog entry outside the policy is refused: not built, not served, one line in the
node's log and `refused: <why>` in the edge's /status.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import urlsplit

import msgspec
import yaml
from msgspec import Meta

from iop import config, wire
from iop.errors import ConfigError

log = logging.getLogger("iop.node")

Argv = Annotated[list[Annotated[str, Meta(min_length=1)]], Meta(min_length=1)]


class NodePolicy(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The commands, upstream hosts and environment variables a node may use."""

    commands: list[Argv] = msgspec.field(default_factory=list)
    """Allowed argv prefixes: a CLI command must start with one of them."""
    exact_commands: list[Argv] = msgspec.field(default_factory=list)
    """Allowed whole commands, argument for argument."""
    upstream_hosts: list[Annotated[str, Meta(min_length=1)]] = msgspec.field(default_factory=list)
    """Hosts an openai adapter's base_url may name (`*`: any)."""
    env: list[config.EnvName] = msgspec.field(default_factory=list)
    """Environment variables the catalog may make the node hand over: a CLI adapter's `env`
    (passed to its command) and an openai adapter's `api_key_env` (sent to its upstream)."""

    @classmethod
    def of_node(cls, node: config.Node) -> NodePolicy:
        """The default for a node started with a local file: exactly what its section there names."""
        policy = cls()
        for a in node.adapters:
            if isinstance(a, config.CliAdapter):
                policy.exact_commands.append(list(a.command))
                policy.env += [e for e in a.env if e not in policy.env]
            elif isinstance(a, config.OpenAIAdapter):
                host = _host(a.base_url)
                if host not in policy.upstream_hosts:
                    policy.upstream_hosts.append(host)
                if a.api_key_env and a.api_key_env not in policy.env:
                    policy.env.append(a.api_key_env)
                if a.server is not None:
                    policy.exact_commands.append(list(a.server.command))
                    policy.env += [e for e in a.server.env if e not in policy.env]
        return policy

    def refusal(self, adapter: config.Adapter) -> str | None:
        """Why `adapter` may not run here, or None when the policy allows it."""
        if isinstance(adapter, config.CliAdapter):
            return self._command_refusal(list(adapter.command), adapter.env, "command")
        if isinstance(adapter, config.OpenAIAdapter):
            if "*" not in self.upstream_hosts and _host(adapter.base_url) not in self.upstream_hosts:
                return "upstream host not allowed"
            if adapter.api_key_env and adapter.api_key_env not in self.env:
                return f"env not allowed: {adapter.api_key_env}"
            if adapter.server is not None:
                # A model server is a command like a CLI adapter's: the same rules decide it.
                return self._command_refusal(list(adapter.server.command), adapter.server.env, "server command")
        return None

    def _command_refusal(self, argv: list[str], env: list[str], what: str) -> str | None:
        if argv not in self.exact_commands and not any(argv[: len(p)] == p for p in self.commands):
            return f"{what} not allowed"
        extra = [e for e in env if e not in self.env]
        return f"env not allowed: {', '.join(extra)}" if extra else None


def _host(url: str) -> str:
    return (urlsplit(url).hostname or "").lower()


def load(path: str | Path) -> NodePolicy:
    """A policy file: the fields of NodePolicy at the top, or under a `node_policy:` key."""
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([f"{p}: cannot read: {exc}"]) from exc
    except yaml.YAMLError as exc:
        raise ConfigError([f"{p}: not valid YAML: {exc}"]) from exc
    if isinstance(data, dict) and "node_policy" in data:
        data = data["node_policy"]
    try:
        return msgspec.convert(data or {}, NodePolicy)
    except msgspec.ValidationError as exc:
        raise ConfigError([f"{p}: node_policy: {exc}"]) from exc


@dataclass
class Refused:
    """A catalog entry the policy refused, as heartbeats report it."""

    provider: config.Provider
    kind: Literal["pool", "cli"]
    reason: str

    def live(self) -> wire.ProviderLive:
        return wire.ProviderLive(
            id=self.provider.id, kind=self.kind, capacity=self.provider.capacity, refused=self.reason
        )
