"""A background response followed while it runs, from any edge: its events as they happen,
resumable from any sequence number, and its cancel heard by the edge that runs it.

The edge running a background response records each event of its stream (numbered from 0 in
the order it passed) and, over core NATS subjects only edges may use (nodes' users have no right
to `iop.responses.>`, iop/nats/auth.py):

- publishes each on `iop.responses.bg.<id>.events`;
- answers `iop.responses.bg.<id>.since` (a sequence number) with the events after it, so a
  follower that arrives late (or lost one) catches up;
- stops the work on a message to `iop.responses.bg.<id>.cancel` (a cancel on another edge).

Before the answer is kept, the whole recording is kept beside it in the store, so a response that
ended replays the very events (and numbers) a follower saw live: `starting_after=N` means the same
thing before and after the end. A follower subscribes first and then asks what it missed; when no
edge answers (the response ended, or its edge is gone) it waits for the stored record to end.

A response another edge took over (iop/responses/takeover.py) runs again: its events are another
`run`, numbered from 0 (a header of each published event, a field of each reply and of the kept
recording). A follower that heard part of one run gets of another only its final event, which
holds the whole response.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any, Protocol

import msgspec
import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from iop.errors import Unavailable
from iop.responses.records import Stored
from iop.responses.replay import replay_events, sse
from iop.responses.store import ResponseStore

log = logging.getLogger("iop.responses")
_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode
_FINAL = frozenset({"response.completed", "response.incomplete", "response.failed"})


def _final(event: dict[str, Any]) -> bool:
    """The event ends its response (its `type`, from the upstream, may be any JSON)."""
    kind = event.get("type")
    return isinstance(kind, str) and kind in _FINAL


ASK_S = 2.0
"""How long a follower waits for the running edge to say what it missed."""
QUIET_S = 15.0
"""A follower that heard nothing this long asks again (the running edge may be gone)."""
_RUN = "Iop-Run"


class Lease(Protocol):
    """A background response's lease (iop/responses/takeover.py)."""

    async def commit(self) -> bool: ...


def subject(response_id: str, what: str) -> str:
    return f"iop.responses.bg.{response_id}.{what}"


class Recording:
    """The running edge's side: every event of one background response, published as it passes."""

    def __init__(
        self, store: ResponseStore, owner: str, response_id: str, run: int = 0, lease: Lease | None = None
    ) -> None:
        self.store = store
        self.run = run
        """Which run of the response this is: how often it was taken over (iop/responses/takeover.py)."""
        self.lease = lease
        """Its end is kept only while this edge holds the response's lease."""
        self.nc = store.nc
        self.owner = owner
        self.response_id = response_id
        self.events: list[dict[str, Any]] = []
        self.visible = 0
        """Events followers may have: all but a final one until its answer is kept (`release`)."""
        self.ended = False
        self.subs: list[Subscription] = []
        self.pending = b""

    async def start(self, task: asyncio.Task[None] | None = None) -> None:
        """Answer late followers; `task` is cancelled when another edge cancels the response."""
        self.subs.append(await self.nc.subscribe(subject(self.response_id, "since"), cb=self._since))
        if task is not None:

            async def cancelled(_: Msg) -> None:
                task.cancel()

            self.subs.append(await self.nc.subscribe(subject(self.response_id, "cancel"), cb=cancelled))

    async def stop(self) -> None:
        await self.release()
        for sub in self.subs:
            try:
                await sub.unsubscribe()
            except nats.errors.Error:
                pass  # the connection is gone: so are its subscriptions

    async def feed(self, data: bytes) -> None:
        """SSE bytes of the stream as the client would get them (iop/responses/tap.py), in order."""
        data = self.pending + data
        *frames, self.pending = data.replace(b"\r\n", b"\n").split(b"\n\n")
        for frame in frames:
            payload = b"\n".join(line[5:].lstrip(b" ") for line in frame.split(b"\n") if line.startswith(b"data:"))
            if not payload or payload == b"[DONE]":
                continue
            try:
                event = _decode(payload)
            except msgspec.DecodeError:
                continue
            if isinstance(event, dict) and isinstance(event.get("type"), str):
                await self.add(event)

    async def abort(self) -> None:
        """The work ended without a final event (cancelled): followers stop listening and read the store."""
        self.ended = True
        try:
            await self.nc.publish(subject(self.response_id, "events"), b"")
        except nats.errors.Error:
            pass  # they ask again when they hear nothing

    async def add(self, event: dict[str, Any]) -> None:
        """One event: numbered, published. The final one keeps the whole recording (before the
        answer is kept, so whoever finds the answer finds its events) and is published only by
        `release`, once the answer is kept: a follower that heard the end finds it in the store."""
        if self.ended:
            return
        event["sequence_number"] = len(self.events)
        self.events.append(event)
        if event["type"] not in _FINAL:
            self.visible = len(self.events)
            await self._publish(event)
            return
        self.ended = True
        if self.lease is not None and not await self.lease.commit():
            return  # another edge runs it now: its recording is the one kept
        try:
            recorded = _encode({"run": self.run, "events": self.events})
            await self.store.keep_events(self.owner, self.response_id, recorded)
        except Unavailable:
            # Its answer is still kept when the store comes back; its replay is then renumbered.
            log.warning("background %s: events not kept", self.response_id)

    async def release(self) -> None:
        """The final event to followers (its answer is kept now)."""
        if self.ended and self.visible < len(self.events):
            self.visible = len(self.events)
            await self._publish(self.events[-1])

    async def _publish(self, event: dict[str, Any]) -> None:
        try:
            await self.nc.publish(subject(self.response_id, "events"), _encode(event), headers={_RUN: str(self.run)})
        except nats.errors.Error as exc:
            log.warning("background %s: event not published: %s", self.response_id, type(exc).__name__)

    async def _since(self, msg: Msg) -> None:
        try:
            after = int(msg.data or b"-1")
        except ValueError:
            after = -1
        # One reply within a NATS message; the follower asks again from the last one it got.
        out: list[dict[str, Any]] = []
        size, limit = 2, max(1024, self.nc.max_payload // 2)
        rest = self.events[max(after + 1, 0) : self.visible]
        for event in rest:
            size += len(_encode(event)) + 1
            if out and size > limit:
                break
            out.append(event)
        await msg.respond(_encode({"events": out, "more": len(out) < len(rest), "run": self.run}))


async def stored_events(store: ResponseStore, owner: str, stored: Stored) -> list[dict[str, Any]]:
    """The events of a stored response: its recording when it ran in the background, else a replay."""
    return (await _kept_events(store, owner, stored))[0]


async def _kept_events(store: ResponseStore, owner: str, stored: Stored) -> tuple[list[dict[str, Any]], int | None]:
    """The events and the run that recorded them (None: a replay of the stored response)."""
    response_id = str(stored.response.get("id"))
    raw = await store.events(owner, response_id) if stored.response.get("background") else None
    if raw is not None:
        kept = _decode(raw)
        run, events = (kept.get("run"), kept.get("events")) if isinstance(kept, dict) else (0, kept)
        if isinstance(events, list):
            return [e for e in events if isinstance(e, dict)], run if isinstance(run, int) else 0
    return replay_events(stored.response), None


async def follow(
    store: ResponseStore, owner: str, stored: Stored, after: int, wait_s: float, finished: Any
) -> AsyncIterator[bytes]:
    """The SSE bytes of a background response's events after `after`, live until its end.

    `finished(stored, timeout_s)`: the stored record once it ended (iop/responses/background.py),
    for when no edge runs it any more.
    """
    nc = store.nc
    response_id = str(stored.response.get("id"))
    heard: asyncio.Queue[bytes] = asyncio.Queue()

    async def hear(msg: Msg) -> None:
        heard.put_nowait((msg.headers or {}).get(_RUN, "0").encode() + b" " + msg.data)

    sub = await nc.subscribe(subject(response_id, "events"), cb=hear)
    last = after
    run: int | None = None
    """The run this follower heard (it follows no other)."""
    deadline = asyncio.get_running_loop().time() + wait_s
    try:
        while True:
            asked = await _ask(nc, response_id, last)
            if asked is None:
                break  # no edge runs it: what is stored says how it ended
            missed, more, now_run = asked
            if run is not None and now_run != run:
                break  # taken over: the new run's end is what this follower gets
            if missed:
                run = now_run
            for event in missed:
                last = event["sequence_number"]
                yield sse([event])
                if event["type"] in _FINAL:
                    return
            if more:
                continue  # more wait behind one full reply
            while True:
                left = deadline - asyncio.get_running_loop().time()
                if left <= 0:
                    return
                try:
                    data = await asyncio.wait_for(heard.get(), min(QUIET_S, left))
                except TimeoutError:
                    break  # quiet: ask again (is it still running anywhere?)
                heard_run, _, data = data.partition(b" ")
                if not data:
                    break  # ended without a final event: what is stored says how
                if run is not None and heard_run != str(run).encode():
                    break  # taken over (see `_ask`)
                event = _decode(data)
                seq = event.get("sequence_number", -1) if isinstance(event, dict) else -1
                if seq <= last:
                    continue
                if seq != last + 1:
                    break  # one was lost on the way: ask for the gap
                last = seq
                yield sse([event])
                if _final(event):
                    return
    finally:
        try:
            await sub.unsubscribe()
        except nats.errors.Error:
            pass
    now = await finished(stored, max(0.0, deadline - asyncio.get_running_loop().time()))
    events, recorded = await _kept_events(store, owner, now)
    if run is not None and recorded != run:
        yield sse([e for e in events if _final(e)])  # another run's end: the whole response
    elif recorded is not None or last < 0:
        # A replay of a response that was never recorded (cancelled) has its own numbers: only
        # a follower that heard nothing yet takes it.
        yield sse([e for e in events if e.get("sequence_number", -1) > last])


async def _ask(nc: NATS, response_id: str, after: int) -> tuple[list[dict[str, Any]], bool, int] | None:
    """The events after `after` from the edge running the response, whether more wait behind
    them, and the run they are of; None when no edge answers."""
    try:
        reply = await nc.request(subject(response_id, "since"), str(after).encode(), timeout=ASK_S)
    except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
        return None
    answer = _decode(reply.data)
    events = answer.get("events") if isinstance(answer, dict) else None
    if not isinstance(events, list):
        return [], False, 0
    run = answer.get("run", 0)
    return [e for e in events if isinstance(e, dict)], answer.get("more") is True, run if isinstance(run, int) else 0


async def answers(nc: NATS, response_id: str, timeout_s: float) -> bool | None:
    """Whether an edge runs `response_id` (its `since` subject has a subscriber); None: no word in time."""
    try:
        await nc.request(subject(response_id, "since"), b"%d" % 2**62, timeout=timeout_s)
    except nats.errors.NoRespondersError:
        return False
    except nats.errors.TimeoutError:
        return None
    return True


async def cancel_elsewhere(nc: NATS, response_id: str) -> None:
    """Tell whichever edge runs `response_id` to stop it (nothing happens when none does)."""
    try:
        await nc.publish(subject(response_id, "cancel"), b"")
        await nc.flush(timeout=int(ASK_S))
    except (nats.errors.Error, TimeoutError) as exc:
        log.warning("background %s: cancel not sent: %s", response_id, type(exc).__name__)
