"""The edge's HTTP API as iop's own commands reach it: `iop status`, `iop refresh`, `iop usage`, `iop smoke --edge`.

One place knows the edge's address rules, its paths and the Structs its answers decode into;
every failure becomes an `IopError` whose message is the one line the command prints.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import TracebackType
from typing import Any
from urllib.parse import quote, urlsplit

import httpx
import msgspec

from iop import config
from iop.contracts.refresh import RefreshResult
from iop.contracts.status import Status, StatusSummary, decode_status, decode_summary
from iop.errors import ConfigError, IopError

DEFAULT_EDGE = "http://127.0.0.1:8080"
"""Where the edge listens when neither --edge nor a deployment file says otherwise (edge.listen's default)."""


class EdgeAddressError(IopError):
    """An --edge value that is not an http(s) address (the command exits 2)."""


def edge_url(address: str) -> str:
    """`address` as a base URL: `host:port` gets `http://`; anything but http(s) with a host is refused."""
    text = address.strip()
    example = "e.g. 127.0.0.1:8080 or https://edge.example:8443"
    if not text:
        raise EdgeAddressError(f"--edge is empty ({example})")
    url = text if "://" in text else "http://" + text
    try:
        parts = urlsplit(url)
        _ = parts.port  # reading the port is what checks it
    except ValueError as exc:
        raise EdgeAddressError(f"--edge {address!r}: not a valid address: {exc} ({example})") from None
    if parts.scheme not in ("http", "https"):
        raise EdgeAddressError(f"--edge {address!r}: the edge speaks http:// or https://, not {parts.scheme}://")
    if not parts.hostname:
        raise EdgeAddressError(f"--edge {address!r}: no host ({example})")
    if parts.query or parts.fragment:
        raise EdgeAddressError(f"--edge {address!r}: a base address has no ?query or #fragment ({example})")
    return f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/')}"


def edge_url_of(dep: config.Deployment) -> str:
    """The edge of a deployment file as this machine reaches it: `edge.listen`, a wildcard host as loopback."""
    host, _, port = dep.edge.listen.rpartition(":")
    if host in ("0.0.0.0", "", "::", "[::]"):
        host = "127.0.0.1"
    return f"http://{host}:{port}"


class _ErrorDetail(msgspec.Struct):
    message: str = ""
    problems: list[str] = msgspec.field(default_factory=list)


class _ErrorAnswer(msgspec.Struct):
    """The OpenAI-style error JSON the edge answers with (plus `problems` for an invalid file)."""

    error: _ErrorDetail


_error_answer = msgspec.json.Decoder(_ErrorAnswer).decode
_refresh_result = msgspec.json.Decoder(RefreshResult).decode


class EdgeClient:
    """A running edge's own endpoints (`/status`, `/admin/refresh`, `/usage`), used as `async with EdgeClient(url):`."""

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 5.0,
        trust_env: bool = True,
        max_connections: int | None = 100,
    ) -> None:
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # trust_env=False for an edge known to be on loopback: a proxy from the environment must not stand in between.
        self._http = httpx.AsyncClient(
            base_url=self.url,
            headers=headers,
            timeout=timeout_s,
            trust_env=trust_env,
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        )

    async def __aenter__(self) -> EdgeClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def status_json(self, view: str = "full") -> bytes:
        """The /status document as the edge sent it (fields this version does not know included);
        `view="summary"`: the summary view."""
        path = "/status" if view == "full" else f"/status?view={view}"
        r = await self._send("GET", path)
        if r.status_code != 200:
            raise IopError(f"{self.url}{path} answered {r.status_code}: {_message(r)}")
        return r.content

    async def summary(self) -> StatusSummary:
        """The /status?view=summary document, decoded."""
        raw = await self.status_json("summary")
        try:
            return decode_summary(raw)
        except msgspec.DecodeError as exc:
            # An edge older than the view ignores the parameter and sends the full document.
            raise IopError(f"{self.url}/status?view=summary is not a summary (an older edge?): {exc}") from None

    async def status(self) -> Status:
        """The /status document, decoded."""
        raw = await self.status_json()
        try:
            return decode_status(raw)
        except msgspec.DecodeError as exc:  # ValidationError is a DecodeError: it names the path
            raise IopError(f"{self.url}/status is not a status document: {exc}") from None

    async def refresh(self, text: str, *, dry_run: bool = False, timeout_s: float = 60.0) -> RefreshResult:
        """Send a deployment file to apply (or only diff, with `dry_run`).

        A file the edge finds invalid raises `ConfigError` with its problems; a refresh that failed
        and was rolled back returns normally, with `error` set.
        """
        path = "/admin/refresh" + ("?dry_run=1" if dry_run else "")
        r = await self._send(
            "POST", path, content=text.encode(), headers={"content-type": "application/yaml"}, timeout=timeout_s
        )
        if r.status_code == 400:
            try:
                detail = _error_answer(r.content).error
            except msgspec.DecodeError:
                raise IopError(f"{self.url}{path} answered 400: {r.text[:200]}") from None
            raise ConfigError(detail.problems or [detail.message or "the deployment file is invalid"])
        if r.status_code not in (200, 500):
            raise IopError(f"{self.url}{path} answered {r.status_code}: {_message(r)}")
        try:
            return _refresh_result(r.content)
        except msgspec.DecodeError:
            raise IopError(f"{self.url}{path} answered {r.status_code}: {r.text[:200]}") from None

    async def keys(self, method: str, path: str = "", body: dict[str, object] | None = None) -> dict[str, Any]:
        """`/admin/keys{path}` (managed keys): the JSON answer; IopError with the edge's message otherwise."""
        content = msgspec.json.encode(body) if body is not None else None
        headers = {"content-type": "application/json"} if body is not None else None
        r = await self._send(method, "/admin/keys" + path, content=content, headers=headers)
        if r.status_code != 200:
            raise IopError(f"{self.url}/admin/keys{path} answered {r.status_code}: {_message(r)}")
        answer: dict[str, Any] = msgspec.json.decode(r.content)
        return answer

    async def usage(self, params: dict[str, str]) -> bytes:
        """GET /usage: the usage table as JSON or CSV (`params["format"]`), as the edge sent it."""
        r = await self._send("GET", "/usage", params=params, timeout=120.0)
        if r.status_code != 200:
            raise IopError(f"{self.url}/usage answered {r.status_code}: {_message(r)}")
        return r.content

    async def follow_usage(self, params: dict[str, str]) -> AsyncIterator[bytes]:
        """GET /usage/tail: one JSON record per line as edges write them, until the caller stops."""
        try:
            async with self._http.stream(
                "GET", "/usage/tail", params=params, timeout=httpx.Timeout(10.0, read=None)
            ) as r:
                if r.status_code != 200:
                    await r.aread()
                    raise IopError(f"{self.url}/usage/tail answered {r.status_code}: {_message(r)}")
                async for line in r.aiter_lines():
                    if line:
                        yield line.encode()
        except httpx.HTTPError as exc:
            raise IopError(f"lost the edge at {self.url}: {type(exc).__name__}: {exc}") from exc

    async def restart_provider(self, provider: str) -> str:
        """Restart the model server a provider's node runs (admin); what the node said."""
        answer = await self._admin_json("POST", f"/admin/providers/{quote(provider, safe='')}/restart", None)
        return str(answer.get("message", ""))

    # --- qualification (admin): iop/edge/qualification.py ----------------------------------------

    async def qualify_lease(self, body: dict[str, Any]) -> dict[str, Any]:
        """Open a qualification lease (`exclusive` drains its providers); the answer's `id` renews it."""
        return await self._admin_json("POST", "/admin/qualify/leases", body)

    async def qualify_renew(self, lease_id: str) -> dict[str, Any]:
        return await self._admin_json("PUT", f"/admin/qualify/leases/{quote(lease_id, safe='')}", None)

    async def qualify_end(self, lease_id: str) -> None:
        await self._admin_json("DELETE", f"/admin/qualify/leases/{quote(lease_id, safe='')}", None)

    async def qualify_keep(self, provider: str, report: bytes) -> None:
        """Hand a report to the edge, which keeps it as the provider's latest (KV bucket iop_qualify)."""
        path = f"/admin/qualify/results/{quote(provider, safe='')}"
        r = await self._send("PUT", path, content=report, headers={"content-type": "application/json"})
        if r.status_code != 200:
            raise IopError(f"{self.url}{path} answered {r.status_code}: {_message(r)}")

    async def qualify_status(self) -> Status:
        """/status read with the admin key (the qualifier holds no client key)."""
        r = await self._send("GET", "/admin/qualify/status")
        if r.status_code != 200:
            raise IopError(f"{self.url}/admin/qualify/status answered {r.status_code}: {_message(r)}")
        try:
            return decode_status(r.content)
        except msgspec.DecodeError as exc:
            raise IopError(f"{self.url}/admin/qualify/status is not a status document: {exc}") from None

    async def qualify_results(self) -> bytes:
        """`{"reports": [...]}`: the latest report of every provider the edge keeps one for."""
        r = await self._send("GET", "/admin/qualify/results")
        if r.status_code != 200:
            raise IopError(f"{self.url}/admin/qualify/results answered {r.status_code}: {_message(r)}")
        return r.content

    def pinned_path(self, provider: str, api: str) -> str:
        """The admin path serving `api` (chat or responses) by `provider` alone."""
        tail = "chat/completions" if api == "chat" else "responses"
        return f"/admin/qualify/providers/{quote(provider, safe='')}/v1/{tail}"

    async def pinned(self, provider: str, api: str, body: bytes, timeout_s: float) -> httpx.Response:
        """One whole (non-streamed) request served by `provider` alone; any status is returned."""
        return await self._send(
            "POST",
            self.pinned_path(provider, api),
            content=body,
            headers={"content-type": "application/json"},
            timeout=timeout_s,
        )

    @asynccontextmanager
    async def pinned_stream(
        self, provider: str, api: str, body: bytes, timeout_s: float
    ) -> AsyncIterator[httpx.Response]:
        """A streamed request served by `provider` alone: the response, its body not yet read."""
        request = self._http.build_request(
            "POST",
            self.pinned_path(provider, api),
            content=body,
            headers={"content-type": "application/json"},
            timeout=timeout_s,
        )
        try:
            r = await self._http.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise IopError(f"cannot reach the edge at {self.url}: {type(exc).__name__}: {exc}") from exc
        try:
            yield r
        finally:
            await r.aclose()

    async def drain_provider(self, provider: str, reason: str = "") -> dict[str, Any]:
        """Take `provider` out of its pools on every edge of the NATS until `enable_provider` (admin key)."""
        return await self._admin_json("POST", f"/admin/providers/{quote(provider, safe='')}/drain", {"reason": reason})

    async def enable_provider(self, provider: str) -> dict[str, Any]:
        """Put `provider` back in its pools (a drain by an operator, its policy or a failed qualification)."""
        return await self._admin_json("POST", f"/admin/providers/{quote(provider, safe='')}/enable", None)

    async def _admin_json(self, method: str, path: str, body: dict[str, Any] | None) -> dict[str, Any]:
        content = msgspec.json.encode(body) if body is not None else None
        headers = {"content-type": "application/json"} if body is not None else None
        r = await self._send(method, path, content=content, headers=headers)
        if r.status_code != 200:
            raise IopError(f"{self.url}{path} answered {r.status_code}: {_message(r)}")
        answer: dict[str, Any] = msgspec.json.decode(r.content)
        return answer

    async def _send(
        self,
        method: str,
        path: str,
        *,
        content: bytes | None = None,
        headers: dict[str, str] | None = None,
        timeout: float | None = None,
        params: dict[str, str] | None = None,
    ) -> httpx.Response:
        try:
            return await self._http.request(
                method,
                path,
                content=content,
                headers=headers,
                params=params,
                timeout=timeout if timeout is not None else httpx.USE_CLIENT_DEFAULT,
            )
        except httpx.HTTPError as exc:
            raise IopError(f"cannot reach the edge at {self.url}: {type(exc).__name__}: {exc}") from exc


def _message(r: httpx.Response) -> str:
    """The edge's error message when it answered with error JSON, else the start of the body."""
    try:
        return _error_answer(r.content).error.message or r.text[:200]
    except msgspec.DecodeError:
        return r.text[:200]
