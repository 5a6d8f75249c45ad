"""Background responses (`background: true`): answered at once with `queued`, run on this edge
like any request (queue, capacity, breaker, ledger), and kept when done, for polling and replay.

The work runs in a task of the edge that took the request, streamed and recorded
(iop/responses/live.py); the stored record is what every edge reads, so polling, `GET
…?stream=true` (which follows it live, from any sequence number) and cancelling work from any
edge. Cancelling marks the record at once and stops the work on the edge that runs it (told over
NATS when that is another edge); a cancelled response's answer is never kept. The response's
work and lease are kept beside it: when its edge stops, or dies, another edge (or the same one,
started again) runs it again and keeps its one answer (iop/responses/takeover.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

import nats.errors
from starlette.types import Message

from iop.errors import BadRequest, RequestError
from iop.openai.responses_events import response_error, response_object
from iop.responses import live
from iop.responses.expand import Responses, Turn
from iop.responses.live import Recording
from iop.responses.records import Stored
from iop.responses.takeover import MAX_TAKEOVERS, Held, Work, hold, work_of

log = logging.getLogger("iop.responses")

UNFINISHED = frozenset({"queued", "in_progress"})


async def queue(
    responses: Responses,
    owner: str,
    turn: Turn,
    request: Mapping[str, Any],
    model: str,
    key: str,
    tenant: str,
    key_id: str = "",
) -> dict[str, Any]:
    """The `queued` response for a background request, kept (with its work and lease) before the
    client hears of it; `key`, `tenant` and `key_id` (a managed key's): whose it is, for a run on
    another edge."""
    queued = response_object(request, model)
    queued.update(status="queued", background=True, store=True, previous_response_id=turn.previous)
    turn.response_id = queued["id"]
    store = responses.store
    assert store is not None  # expand refuses background without a store
    responses.caps.background.take(owner)  # 429 when the key runs its bound already; given back by `run`
    try:
        turn.lease = await hold(store, owner, queued["id"], responses.runner, Work(dict(request), key, tenant, key_id))
        await store.keep(owner, Stored(queued, list(turn.items), turn.previous, turn.chain), [])
    except BaseException:
        responses.caps.background.give(owner)
        if turn.lease is not None:
            await turn.lease.end()
        raise
    return queued


async def resumed(
    responses: Responses, held: Held, accepts: Callable[[str, str], bool]
) -> tuple[Turn, Stored, Work] | None:
    """The turn of a response taken over from a gone edge; None when there is nothing to run (it
    ended, was cancelled or deleted), or it was kept as failed (taken over too often, its
    request or its conversation gone, or its key revoked: `accepts(owner, key_id)` is false)."""
    store = responses.store
    assert store is not None
    owner, response_id = held.owner, held.response_id
    stored = await store.response(owner, response_id)
    work = await work_of(store, owner, response_id)
    if stored is None or stored.response.get("status") not in UNFINISHED:
        await held.end()
        return None
    turn = Turn({}, list(stored.input), stored.previous, True, background=True, response_id=response_id)
    turn.chain, turn.lease = stored.chain, held
    recording = Recording(store, owner, response_id, held.lease.takeovers, held)
    try:
        if work is None:  # gone, or written over (docs/security.md): nothing to run it again from
            raise RequestError("the response's request is no longer in the response store", code="server_error")
        if not accepts(owner, work.key_id):
            raise RequestError("the key that created this response was revoked", code="invalid_api_key")
        if held.lease.takeovers > MAX_TAKEOVERS:
            raise RequestError(
                f"the response was run {held.lease.takeovers} times and never finished", code="server_error"
            )
        turn = await responses.expand(work.request, owner)
    except RequestError as exc:
        await failed(responses, owner, turn, stored.response, exc, recording)
        await recording.stop()
        await held.end()
        return None
    turn.request, turn.response_id, turn.lease = work.request, response_id, held
    responses.caps.background.take(owner, bounded=False)  # it runs somewhere; given back by `run`
    return turn, stored, work


def recording(responses: Responses, owner: str, turn: Turn) -> Recording:
    """The recording of a background response's events (its store's connection publishes them)."""
    assert responses.store is not None and turn.response_id is not None
    run = turn.lease.lease.takeovers if turn.lease is not None else 0
    return Recording(responses.store, owner, turn.response_id, run, turn.lease)


async def nowhere(message: Message) -> None:
    """The send of a request nobody waits on: its answer goes to the store and its followers."""


def run(responses: Responses, owner: str, turn: Turn, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
    """Run `work` as `owner`'s background response `turn` (this edge can then cancel it); its
    lease ends with it (unless the edge stopped and released it, or another edge took it over)."""
    response_id = str(turn.response_id)
    lease = turn.lease

    async def leased() -> None:
        try:
            await work
        finally:
            if lease is not None:
                await lease.end()

    task = asyncio.create_task(leased())
    responses.running[response_id] = task
    if lease is not None:
        responses.leases[response_id] = lease

    def done(_: object) -> None:
        responses.running.pop(response_id, None)
        responses.leases.pop(response_id, None)
        responses.caps.background.give(owner)

    task.add_done_callback(done)
    return task


async def failed(
    responses: Responses, owner: str, turn: Turn, queued: dict[str, Any], exc: RequestError, recording: Recording
) -> None:
    """A background response whose request failed before any answer: kept as `failed`."""
    response = {**queued, "status": "failed", "error": response_error(exc.message, exc.code)}
    await _ended(responses, owner, turn, response, recording)


async def _ended(responses: Responses, owner: str, turn: Turn, response: dict[str, Any], recording: Recording) -> None:
    """Its followers hear the end (`response.failed`) before it is kept, as for any answer."""
    if turn.lease is not None and (turn.lease.lost or turn.lease.released):
        return  # another edge runs it now
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
