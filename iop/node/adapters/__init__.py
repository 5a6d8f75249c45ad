"""Adapters: how a node reaches what actually answers (an OpenAI server, a CLI, the mock model)."""

from __future__ import annotations

from collections.abc import Awaitable, Mapping
from typing import Protocol

from iop import config, wire


class Send(Protocol):
    """Publishes bytes of the answer (already in the client's API and framing) to the edge.

    `headers` are HTTP headers for the client's answer; they must come with or before the first
    bytes (the edge answers once it has them).
    """

    def __call__(self, data: bytes, headers: Mapping[str, str] | None = None) -> Awaitable[None]: ...


class Adapter(Protocol):
    """Runs one work item to completion, sending the answer through `send`.

    Raises `iop.errors.RequestError` for failures the client should see; cancellation (client
    gone, node stopping) arrives as `asyncio.CancelledError` and must release the upstream call.
    """

    async def run(self, item: wire.WorkItem, model: str | None, send: Send) -> wire.Usage | None: ...

    async def close(self) -> None: ...


def build(cfg: config.Adapter) -> Adapter:
    """The adapter instance for one `nodes[].adapters[]` entry."""
    if isinstance(cfg, config.MockAdapter):
        from iop.node.adapters.mock import MockAdapter

        return MockAdapter(cfg)
    if isinstance(cfg, config.CliAdapter):
        from iop.node.adapters.cli import CliAdapter

        return CliAdapter(cfg)
    from iop.node.adapters.openai import OpenAIAdapter

    return OpenAIAdapter(cfg)
