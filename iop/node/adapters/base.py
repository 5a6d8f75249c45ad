"""What every adapter is to the node: `Adapter`, the `Send` it answers through, the `Outcome` it reports."""

from __future__ import annotations

from collections.abc import Awaitable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Literal, Protocol

from iop import wire


class Send(Protocol):
    """Publishes bytes of the answer (already in the client's API and framing) to the edge.

    `headers` are HTTP headers for the client's answer; they must come with or before the first
    bytes (the edge answers once it has them).
    """

    def __call__(self, data: bytes, headers: Mapping[str, str] | None = None) -> Awaitable[None]: ...


@dataclass
class Outcome:
    """What only the node learns while running one item, reported to the edge in Done/Failure."""

    upstream_status: int = 0
    exit_code: int | None = None
    usage: wire.Usage | None = None
    """Set by an adapter that fails after the upstream already reported its usage."""
    traceparent: str = ""
    """The W3C context of the upstream call's span when the item is traced: sent upstream with it."""


outcome: ContextVar[Outcome] = ContextVar("outcome")
"""The running item's Outcome: set by the node's task for each item, filled in by the adapter."""


def note_upstream_status(status: int) -> None:
    o = outcome.get(None)
    if o is not None:
        o.upstream_status = status


def note_exit_code(code: int) -> None:
    o = outcome.get(None)
    if o is not None:
        o.exit_code = code


class Adapter(Protocol):
    """Runs one work item to completion, sending the answer through `send`.

    Raises `iop.errors.RequestError` for failures the client should see; cancellation (client
    gone, node stopping) arrives as `asyncio.CancelledError` and must release the upstream call.
    """

    async def run(self, item: wire.WorkItem, model: str | None, send: Send) -> wire.Usage | None: ...

    async def close(self) -> None: ...


def writes(api: wire.Api) -> Literal["chat", "responses"]:
    """The API an adapter that writes its own answers (mock, CLI) answers `api` in; NotFound for others.

    Messages reach them as chat (iop/node/adapters/messages.py); embeddings and completions never
    do (the edge refuses them for these aliases first).
    """
    if api == "chat" or api == "responses":
        return api
    from iop.errors import NotFound

    raise NotFound(f"this provider does not serve the {api} endpoint", code="endpoint_not_served")
