"""The openai adapter: forwards to an OpenAI-compatible server (vLLM, MLX, llama.cpp, Ollama)."""

from __future__ import annotations

import os
from typing import Any

import httpx
import msgspec

from iop import config, wire
from iop.errors import BadRequest, RequestError, UpstreamError, error_for_status
from iop.node.adapters import Send

_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode
_PATHS = {"chat": "/chat/completions", "responses": "/responses"}


class OpenAIAdapter:
    """One pooled httpx client per adapter; each API is forwarded natively when the upstream serves it."""

    def __init__(self, cfg: config.OpenAIAdapter) -> None:
        self.cfg = cfg
        headers = {}
        if cfg.api_key_env and (key := os.environ.get(cfg.api_key_env)):
            headers["Authorization"] = f"Bearer {key}"
        self.client = httpx.AsyncClient(
            base_url=cfg.base_url.rstrip("/"),
            headers=headers,
            timeout=httpx.Timeout(cfg.timeout_s, connect=10.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
        )

    def serves(self, api: str) -> bool:
        return self.cfg.api == "both" or self.cfg.api == api

    async def run(self, item: wire.WorkItem, model: str | None, send: Send) -> wire.Usage | None:
        if not self.serves(item.api):
            served = _PATHS[self.cfg.api]
            raise BadRequest(
                f"this provider's upstream serves only /v1{served}; /v1{_PATHS[item.api]} to it needs "
                "Responses/chat translation, which this iop does not have yet",
                code="api_not_supported",
            )
        body = item.body
        if model is not None:
            payload: dict[str, Any] = _decode(body)
            payload["model"] = model
            body = _encode(payload)
        request = self.client.build_request(
            "POST", _PATHS[item.api], content=body, headers={"content-type": "application/json"}
        )
        try:
            response = await self.client.send(request, stream=True)
        except httpx.TimeoutException as exc:
            raise UpstreamError(f"upstream timed out: {self.cfg.base_url}", code="upstream_timeout") from exc
        except httpx.HTTPError as exc:
            raise UpstreamError(
                f"upstream unreachable: {self.cfg.base_url}: {type(exc).__name__}", code="upstream_unavailable"
            ) from exc
        try:
            if response.status_code >= 400:
                raise await _upstream_error(response)
            if item.stream:
                async for data in response.aiter_raw():
                    if data:
                        await send(data)
            else:
                await send(await response.aread())
        except httpx.TimeoutException as exc:
            raise UpstreamError("upstream timed out mid-answer", code="upstream_timeout") from exc
        except httpx.HTTPError as exc:
            raise UpstreamError(f"upstream failed mid-answer: {type(exc).__name__}", code="upstream_error") from exc
        finally:
            await response.aclose()
        return None

    async def close(self) -> None:
        await self.client.aclose()


async def _upstream_error(response: httpx.Response) -> RequestError:
    """Map an upstream HTTP error: client mistakes pass through, the rest is the gateway's 502."""
    raw = await response.aread()
    message = raw[:2000].decode(errors="replace")
    try:
        err = _decode(raw).get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            message = err["message"]
        elif isinstance(err, str):
            message = err
    except (msgspec.DecodeError, AttributeError):
        pass
    status = response.status_code
    if status in (400, 413, 422):
        return error_for_status(400 if status == 422 else status, f"upstream: {message}", "upstream_bad_request")
    if status == 429:
        return error_for_status(429, f"upstream: {message}", "upstream_rate_limited")
    return UpstreamError(f"upstream answered {status}: {message}", code="upstream_error")
