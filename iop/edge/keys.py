"""Who may call the edge: client keys for /v1/* and /status, separate admin keys for /admin/*.

Keys come from environment variables the deployment file names, as comma-separated entries,
each `key` or `name:key`. The name is what logs show; a key itself is never logged.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import re
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from starlette.types import Scope

from iop import config
from iop.edge.origin import host_name, is_loopback_name
from iop.errors import ConfigError, Forbidden, Unauthorized

_NAME = re.compile(r"^[A-Za-z0-9_.@-]{1,64}$")


@dataclass(frozen=True)
class Key:
    """One bearer key and the name logs know it by."""

    name: str
    secret: bytes = field(repr=False)
    tenant: str | None = None
    """The tenant a managed key belongs to (iop/edge/managed.py); None: resolved from the name."""
    id: str = ""
    """A managed key's id ("" for the environment's keys)."""


def parse_keys(raw: str, prefix: str) -> list[Key]:
    """`a, ops:b` → [Key('client-1', a), Key('ops', b)]; empty entries (separators) are skipped."""
    keys: list[Key] = []
    for entry in (e.strip() for e in raw.split(",")):
        if not entry:
            continue
        name, sep, secret = entry.partition(":")
        if sep and secret.strip() and _NAME.match(name.strip()):
            keys.append(Key(name.strip(), secret.strip().encode()))
        else:
            keys.append(Key(f"{prefix}-{len(keys) + 1}", entry.encode()))
    return keys


def read_keys(field_name: str, var: str | None, prefix: str, environ: Mapping[str, str] | None = None) -> list[Key]:
    """The keys in `$var`; a named variable that is unset or holds no key is a ConfigError (fail closed)."""
    if var is None:
        return []
    env = os.environ if environ is None else environ
    raw = env.get(var)
    if raw is None:
        raise ConfigError([f"edge.{field_name}: environment variable {var} is not set"])
    keys = parse_keys(raw, prefix)
    if not keys:
        raise ConfigError([f"edge.{field_name}: environment variable {var} holds no key (empty or only separators)"])
    return keys


@dataclass(frozen=True)
class EdgeKeys:
    """The edge's client and admin keys, read once at start (a refresh does not change them)."""

    clients: list[Key]
    admins: list[Key]
    lookups: list[Callable[[bytes], Key | None]] = field(default_factory=list)
    """Further client keys beside the environment's, asked in order (the managed keys)."""
    _clients: dict[bytes, Key] = field(init=False, repr=False, compare=False)
    _admins: dict[bytes, Key] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_clients", _index(self.clients))
        object.__setattr__(self, "_admins", _index(self.admins))

    @classmethod
    def from_settings(cls, edge: config.EdgeSettings, environ: Mapping[str, str] | None = None) -> EdgeKeys:
        return cls(
            clients=read_keys("api_keys_env", edge.api_keys_env, "client", environ),
            admins=read_keys("admin_keys_env", edge.admin_keys_env, "admin", environ),
        )

    def client(self, scope: Scope) -> Key | None:
        """The client key of this request (None when the edge has none); Unauthorized when it fits none."""
        if not self.clients:
            return None
        given = _bearer(scope)
        key = _match(given, self._clients)
        if key is None and given:
            for lookup in self.lookups:
                if (key := lookup(given)) is not None:
                    break
        if key is None:
            raise Unauthorized("missing or invalid API key (send Authorization: Bearer <key> or x-api-key: <key>)")
        return key

    def holds_admin_key(self, scope: Scope) -> bool:
        """The request carries one of the admin keys (never true without admin keys: no loopback rule)."""
        return bool(self.admins) and _match(_bearer(scope), self._admins) is not None

    def admin(self, scope: Scope) -> str:
        """Who is asking for an admin action, as logs may say it; Forbidden/Unauthorized otherwise.

        Without admin keys only a peer on this machine (loopback) that names the edge by a loopback
        name (`Host: 127.0.0.1:…`, `localhost`, or no Host) is an administrator: it could as well
        edit the deployment file and send SIGHUP. A loopback peer naming another host is a browser
        on this machine sent by a page elsewhere (DNS rebinding), or a reverse proxy passing on
        its clients' Host; neither is. A client key is never one.
        """
        given = _bearer(scope)
        peer = _peer(scope)
        if not self.admins:
            if not _is_loopback_peer(peer) or not _names_loopback(scope):
                raise Forbidden(
                    "admin endpoints answer only this machine (a loopback peer asking for a loopback "
                    "host) while edge.admin_keys_env is not set",
                    code="admin_only_loopback",
                )
            return f"local ({peer})"
        key = _match(given, self._admins)
        if key is not None:
            return f"{key.name} ({peer})"
        if given and _match(given, self._clients) is not None:
            raise Forbidden("a client key cannot use admin endpoints (send an admin key)", code="not_admin")
        raise Unauthorized("missing or invalid admin key (send Authorization: Bearer <admin key>)")


def _bearer(scope: Scope) -> bytes:
    """`Authorization: Bearer <key>`, else `x-api-key: <key>` (Anthropic's clients send only that)."""
    api_key = b""
    for name, value in scope["headers"]:
        if name == b"authorization":
            return bytes(value[7:].strip()) if value[:7].lower() == b"bearer " else b""
        if name == b"x-api-key":
            api_key = bytes(value.strip())
    return api_key


_INDEX_KEY = secrets.token_bytes(32)
"""This process's key for the keys' index: nobody outside knows where a given key would land."""


def _tag(secret: bytes) -> bytes:
    return hashlib.blake2b(secret, key=_INDEX_KEY, digest_size=16).digest()


def _index(keys: list[Key]) -> dict[bytes, Key]:
    """Keys by a keyed digest of their secret (the first of equal secrets wins, as a scan in order)."""
    index: dict[bytes, Key] = {}
    for key in keys:
        index.setdefault(_tag(key.secret), key)
    return index


def _match(given: bytes, index: dict[bytes, Key]) -> Key | None:
    # One lookup whatever the number of keys (1,000 keys scanned cost ~60 us a request). The
    # lookup's timing depends on a digest under a key only this process has, so it tells a caller
    # nothing about any secret; the secret itself is compared in constant time.
    if not given:
        return None
    key = index.get(_tag(given))
    return key if key is not None and hmac.compare_digest(given, key.secret) else None


def _peer(scope: Scope) -> str:
    client = scope.get("client")
    return str(client[0]) if client else "unknown"


def _names_loopback(scope: Scope) -> bool:
    for name, value in scope["headers"]:
        if name == b"host":
            host = host_name(value)
            return host is not None and is_loopback_name(host)
    return True  # HTTP/1.0 without Host: no browser sends that


def _is_loopback_peer(peer: str) -> bool:
    try:
        return ipaddress.ip_address(peer).is_loopback
    except ValueError:
        return False
