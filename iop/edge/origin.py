"""Which browsers' requests the edge answers: its own page's and programs', not other sites' pages.

Two checks, before anything else sees a request: a foreign `Origin` (a page elsewhere posting to
the edge) and a `Host` that is not one of the edge's names (a page elsewhere whose name was
re-pointed at the edge: DNS rebinding). Both refusals are 403 with OpenAI error JSON.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from typing import Any

from iop import config
from iop.anthropic.errors import refusal as refusal_answer
from iop.errors import Forbidden

_DEFAULT_PORTS = {b"http": b":80", b"https": b":443"}


def host_name(host: bytes) -> str | None:
    """The name in a `Host` header (`evil.test:8080` → `evil.test`, `[::1]:80` → `::1`), lower case,
    without a trailing dot; None when it is no host name at all."""
    text = host.strip().decode("ascii", errors="replace").lower()
    if text.startswith("["):
        name, sep, rest = text[1:].partition("]")
        if not sep or (rest and not (rest.startswith(":") and rest[1:].isdigit())):
            return None
    else:
        name, _, port = text.partition(":")
        if port and not port.isdigit():
            return None
    name = name.rstrip(".")
    return name or None


def is_loopback_name(name: str) -> bool:
    """`localhost`, `*.localhost` (browsers resolve them to loopback themselves) or a loopback address."""
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


class HostAllowList:
    """The names a request's `Host` may give: what stops DNS rebinding.

    A page on evil.test whose name its owner re-points to 127.0.0.1 is, for the browser, the same
    origin as the edge: `Origin` and `Host` both say `evil.test:PORT`, so no origin check can tell.
    Only the name can: the edge answers its IP addresses (a URL of an IP literal cannot be
    rebound), `localhost`, the name of its listen address and the names the deployment lists
    (`edge.allowed_hosts`); `*` there turns the check off. A request without `Host` is no
    browser's (they always send one) and passes.
    """

    def __init__(self, names: Iterable[str]) -> None:
        names = [n.strip().lower().rstrip(".") for n in names]
        self.any = "*" in names
        self.names = frozenset(n for n in names if n and n != "*")

    @classmethod
    def of(cls, edge: config.EdgeSettings) -> HostAllowList:
        listen = edge.listen.rpartition(":")[0].strip("[]")
        return cls([*edge.allowed_hosts, listen])

    def allows(self, host: bytes | None) -> bool:
        if host is None or self.any:
            return True
        name = host_name(host)
        if name is None:
            return False
        if name in self.names or is_loopback_name(name):
            return True
        try:
            ipaddress.ip_address(name)
        except ValueError:
            return False
        return True


class SameOrigin:
    """Refuse (403) any request a browser sends on behalf of another site.

    A page on any site can make its visitor's browser POST to `http://127.0.0.1:8080` without a
    preflight (no custom headers, a body of no declared type): against an edge without keys that
    would run models and CLI routes, or replace the deployment, for whoever wrote the page. Browsers
    always say where such a request comes from (`Origin`); iop's own page (/ui) is same-origin, and
    programs (the SDK, Codex, curl) send no `Origin` at all, so only the cross-site case is refused
    (`cross_origin`). A page that reaches the edge under its own re-pointed name (DNS rebinding) is
    same-origin by that test, and refused for its `Host` instead (`host_not_allowed`, HostAllowList).
    """

    def __init__(self, app: Any, hosts: HostAllowList | None = None) -> None:
        self.app = app
        self.hosts = hosts if hosts is not None else HostAllowList(())

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        # A WebSocket handshake too: browsers let any page open a socket to any host (with its Origin).
        if scope["type"] in ("http", "websocket"):
            origin = host = None
            for name, value in scope["headers"]:
                if name == b"origin":
                    origin = value
                elif name == b"host":
                    host = value
            refusal = None
            if not self.hosts.allows(host):
                assert host is not None
                refusal = Forbidden(
                    f"Host {host[:100].decode(errors='replace')!r} is not a name of this edge (its IP addresses, "
                    "localhost, edge.allowed_hosts): refused, as a page on a re-pointed name would be",
                    code="host_not_allowed",
                )
            elif origin is not None and not _same_origin(origin, host):
                refusal = Forbidden(
                    f"cross-origin request from {origin[:100].decode(errors='replace')!r} refused: the edge "
                    "answers pages it serves itself and programs, not other sites' pages",
                    code="cross_origin",
                )
            if refusal is not None:
                # Anthropic's clients read Anthropic's error bodies: the shape follows the path.
                err = refusal_answer(scope["path"], refusal, scope.get("iop.request_id"))
                headers = [(b"content-type", b"application/json")]
                headers += [(k.lower().encode(), v.encode()) for k, v in err.headers.items()]
                # A handshake is refused with an HTTP answer too (the ASGI extension uvicorn offers).
                kind = "http" if scope["type"] == "http" else "websocket.http"
                await send({"type": f"{kind}.response.start", "status": err.status, "headers": headers})
                await send({"type": f"{kind}.response.body", "body": err.body})
                return
        await self.app(scope, receive, send)


def _same_origin(origin: bytes, host: bytes | None) -> bool:
    scheme, sep, authority = origin.strip().lower().partition(b"://")
    if not sep or host is None:
        return False  # "null" (sandboxed frames, files) or no Host: nothing to match
    default = _DEFAULT_PORTS.get(scheme, b"")
    host = host.strip().lower()
    return authority.removesuffix(default) == host.removesuffix(default)
