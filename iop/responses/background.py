"""Background responses (`background: true`): answered at once with `queued`, run on this edge
like any request (queue, capacity, breaker, ledger), and kept when done, for polling and replay.

The work runs in a task of the edge that took the request, streamed and recorded
(iop/responses/live.py); the stored record is what every edge reads, so polling, `GET
…?stream=true` (which follows it live, from any sequence number) and cancelling work from any
edge. Cancelling marks the record at once and stops the work on the edge that runs it (told over
NATS when that is another edge); a cancelled response's answer is never kept. An edge that stops keeps its running
background responses as `failed` (they are not resumed elsewhere yet); one that dies leaves them
`queued`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine, Mapping
from typing import Any

import nats.errors
from starlette.types import Message

from iop.errors import BadRequest, RequestError
from iop.openai.responses_events import response_error, response_object
from iop.responses import live
from iop.responses.expand import Responses, Turn
from iop.responses.live import Recording
from iop.responses.store import Stored

log = logging.getLogger("iop.responses")

UNFINISHED = frozenset({"queued", "in_progress"})


async def queue(responses: Responses, owner: str, turn: Turn, request: Mapping[str, Any], model: str) -> dict[str, Any]:
    """The `queued` response for a background request, kept before the client hears of it."""
    queued = response_object(request, model)
    queued.update(status="queued", background=True, store=True, previous_response_id=turn.previous)
    turn.response_id = queued["id"]
    assert responses.store is not None  # expand refuses background without a store
    responses.caps.background.take(owner)  # 429 when the key runs its bound already; given back by `run`
    try:
        await responses.store.keep(owner, Stored(queued, list(turn.items), turn.previous, turn.chain), [])
    except BaseException:
        responses.caps.background.give(owner)
        raise
    return queued


def recording(responses: Responses, owner: str, response_id: str) -> Recording:
    """The recording of a background response's events (its store's connection publishes them)."""
    assert responses.store is not None
    return Recording(responses.store, owner, response_id)


async def nowhere(message: Message) -> None:
    """The send of a request nobody waits on: its answer goes to the store and its followers."""


def run(responses: Responses, owner: str, response_id: str, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
    """Run `work` as `owner`'s background response `response_id` (this edge can then cancel it)."""
    task = asyncio.create_task(work)
    responses.running[response_id] = task

    def done(_: object) -> None:
        responses.running.pop(response_id, None)
        responses.caps.background.give(owner)

    task.add_done_callback(done)
    return task


async def failed(
    responses: Responses, owner: str, turn: Turn, queued: dict[str, Any], exc: RequestError, recording: Recording
) -> None:
    """A background response whose request failed before any answer: kept as `failed`."""
    response = {**queued, "status": "failed", "error": response_error(exc.message, exc.code)}
    await _ended(responses, owner, turn, response, recording)


async def abandoned(responses: Responses, owner: str, turn: Turn, queued: dict[str, Any], recording: Recording) -> None:
    """A background response whose edge stopped before its answer: kept as `failed`, to be sent again."""
    message = "the edge running this background response stopped before it finished; send the request again"
    response = {**queued, "status": "failed", "error": response_error(message, "server_error")}
    await _ended(responses, owner, turn, response, recording)


async def _ended(responses: Responses, owner: str, turn: Turn, response: dict[str, Any], recording: Recording) -> None:
    """Its followers hear the end (`response.failed`) before it is kept, as for any answer."""
    await recording.add({"type": "response.failed", "response": response})
    await responses.keep(owner, turn, response)
    await recording.release()


async def cancel(responses: Responses, owner: str, stored: Stored) -> dict[str, Any]:
    """Cancel a background response; one already finished is answered as it is."""
    response = stored.response
    if not response.get("background"):
        raise BadRequest("Only background responses can be cancelled.", param="response_id")
    if response.get("status") not in UNFINISHED:
        return response
    response = {**response, "status": "cancelled", "completed_at": None}
    assert responses.store is not None
    await responses.store.keep(owner, Stored(response, stored.input, stored.previous, stored.chain, stored.size), [])
    task = responses.running.get(str(response["id"]))
    if task is not None:
        task.cancel()
    else:
        await live.cancel_elsewhere(responses.store.nc, str(response["id"]))  # the edge running it stops it
    return response


async def until_finished(responses: Responses, owner: str, stored: Stored, timeout_s: float) -> Stored:
    """`stored` once it is no longer queued or in progress (or as it is after `timeout_s`)."""
    store = responses.store
    if store is None or stored.response.get("status") not in UNFINISHED:
        return stored
    response_id = str(stored.response.get("id"))
    deadline = time.monotonic() + timeout_s
    watcher = await store.kv.watch(f"r.{owner}.{response_id}", meta_only=True)
    try:
        while (left := deadline - time.monotonic()) > 0:
            try:
                await watcher.updates(timeout=left)
            except nats.errors.TimeoutError:
                break
            now = await store.response(owner, response_id)
            if now is None:
                return stored
            if now.response.get("status") not in UNFINISHED:
                return now
    finally:
        await watcher.stop()
    return stored
