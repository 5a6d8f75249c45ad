"""The requests a node runs, pool and CLI alike: each one's task, its flow window, cancels and probes."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from iop import tracing as tr
from iop import wire
from iop.errors import Cancelled, RequestError, UpstreamError, failure_of
from iop.node import spans
from iop.node.adapters.base import Outcome
from iop.node.adapters.base import outcome as current_outcome
from iop.node.body import SentBodies, fetch_body
from iop.node.flow import STALL_TIMEOUT_S, FlowWindow
from iop.node.presence import Lease
from iop.node.replay import ReplayStore, serve_resend
from iop.node.resource import Resource

log = logging.getLogger("iop.node")

CANCEL_MEMORY_S = 120.0
CHUNK_BYTES = 256 * 1024
"""The largest piece of an answer in one NATS message (far below any server's max_payload)."""
PROBES_UNANSWERED = 2
"""Consecutive probes without a responder after which the edge of a request counts as gone."""


@dataclass(eq=False)
class Running:
    """One request this node runs, with what the edge told it about its client."""

    item: wire.WorkItem
    msg: Msg | None
    window: FlowWindow
    since: float
    task: asyncio.Task[None] | None = None
    unanswered: int = 0
    """Consecutive probes that found no responder at the edge."""
    answered: bool = False
    """The adapter has finished: the edge may already have forgotten it, nothing to stop any more."""
    cold_start_ms: float = 0.0
    """How long it waited for its model server to start (servers.py) before it ran."""
    trace: Mapping[str, str] | None = None
    """The headers the work came with: its try's trace context, when the request is traced."""
    freed: asyncio.Future[None] | None = None
    """Pool work: resolved once the run no longer holds its slot, its work acked (the upstream's
    answer read whole) or the run over. The slot's fetch loop pulls the next item then, not after the Done."""
    holds_slot: bool = False
    ahead: Callable[[], Awaitable[None]] | None = None
    """Pool work: sends its slot's next pull (iop/node/fetch.py), called between the ack and the Done."""


class RunningRequests:
    """Every request the node runs now, by id: started here, stopped by a Cancel, a lost edge or `stop`."""

    def __init__(self, nc: NATS, node_id: str, instance: str, changed: asyncio.Event) -> None:
        self.nc = nc
        self.node_id = node_id
        self.bodies = SentBodies()
        """Bodies that stay at an edge, sent ahead of their work items (iop/node/body.py)."""
        self.instance = instance
        self.changed = changed
        """Set when a request starts, ends, or waits for credit (observers clear it, then wait)."""
        self.by_id: dict[str, Running] = {}
        self._cancelled: dict[str, float] = {}
        self.stopping = False
        """The node is stopping: no new work, and a request cut short says so."""
        self.lease = Lease()
        """Work is taken only while it is fresh: this process is the node's live instance (presence.py)."""
        self.stall_timeout_s = STALL_TIMEOUT_S
        self.probe_interval_s = wire.PROBE_INTERVAL_S
        self.flushing: set[asyncio.Task[None]] = set()
        """Started messages sent by their hold timer (kept referenced until sent)."""
        self.replay = ReplayStore()
        """What the edges may not have of each answer yet, to send again when they ask (replay.py)."""
        self.tracing: tr.Tracing | None = None
        """The node's tracer when tracing is on: items whose work came with a sampled context are traced."""

    def was_cancelled(self, request_id: str) -> bool:
        """Whether a Cancel for this request arrived recently (before its work message did)."""
        return request_id in self._cancelled

    def start(
        self,
        r: Resource,
        item: wire.WorkItem,
        msg: Msg | None,
        cold_start_ms: float = 0.0,
        trace: Mapping[str, str] | None = None,
        ahead: Callable[[], Awaitable[None]] | None = None,
    ) -> Running:
        # Registered before the task runs, so a Credit or Cancel arriving at once finds it.
        run = Running(item, msg, FlowWindow(self.changed), time.monotonic(), cold_start_ms=cold_start_ms, trace=trace)
        run.ahead = ahead
        self.by_id[item.id] = run
        if msg is not None:  # pool work: its slot's fetch loop waits for the slot
            run.freed = asyncio.get_running_loop().create_future()
        run.task = asyncio.create_task(self._run(r, run))
        self.changed.set()
        return run

    async def finish(self, grace_s: float) -> None:
        """Let running requests end by themselves for up to `grace_s`, then cancel the rest."""
        running = [run.task for run in self.by_id.values() if run.task is not None]
        if running:
            log.info("node %s: waiting up to %gs for %d running requests", self.node_id, grace_s, len(running))
            _, pending = await asyncio.wait(running, timeout=grace_s)
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.wait(pending, timeout=5.0)

    async def _run(self, r: Resource, run: Running) -> None:
        item, window = run.item, run.window
        r.in_flight += 1
        run.holds_slot = True
        if r.in_flight > r.peak_in_flight:
            r.peak_in_flight = r.in_flight
        edge = wire.edge_of(item.reply_to)
        r.by_edge[edge] = r.by_edge.get(edge, 0) + 1
        # What the adapter learns (upstream status, exit code) travels back in Done/Failure.
        outcome = Outcome()
        current_outcome.set(outcome)  # this task's own context: no other item sees it
        began = time.monotonic()
        first_byte = 0.0

        def failure(exc: RequestError) -> wire.Failure:
            return msgspec.structs.replace(
                failure_of(exc, item.id, window.sent_chunks),
                usage=outcome.usage,
                upstream_status=outcome.upstream_status,
                exit_code=outcome.exit_code,
                run_ms=round((time.monotonic() - began) * 1000, 3),
            )

        pending: dict[str, str] = {}
        out = _Outbox(self, item)
        tracing = self.tracing
        work = call = None
        error = "cancelled"
        usage: wire.Usage | None = None
        if run.trace and tracing is not None and tracing.on:
            work = spans.work(tracing, run.trace, r, item, self.node_id, *_delivery(run.msg))
            if work is not None:
                if run.cold_start_ms:
                    work.set_attribute("iop.cold_start_ms", run.cold_start_ms)  # its model server started first
                call = spans.call(tracing, work, r, getattr(r.adapter, "cfg", None), item)
                outcome.traceparent = tr.traceparent(call)  # the upstream request joins the trace

        async def send(data: bytes, headers: Mapping[str, str] | None = None) -> None:
            nonlocal first_byte
            if data and not first_byte:
                first_byte = time.monotonic()
            # Headers travel on the next chunk with bytes: the edge answers once it has the first.
            if headers:
                pending.update(headers)
            # Whatever an adapter hands over, no NATS message exceeds CHUNK_BYTES, and no more than
            # the window is ever unread at the edge: a slow client slows the upstream, not memory.
            for i in range(0, len(data), CHUNK_BYTES):
                piece = data[i : i + CHUNK_BYTES]
                if out.holds_chunk():
                    # Sent before waiting for credit: the edge cannot grant any for a chunk it lacks.
                    await out.flush()
                seq = await window.reserve(len(piece), self.stall_timeout_s)
                extra = None
                if pending:
                    extra = dict(pending)
                    pending.clear()
                chunk = wire.Chunk(item.id, seq, piece, extra)
                if item.stream:
                    await out.send(chunk)
                else:
                    out.hold(chunk)  # the client gets nothing before the Done: it travels with it

        try:
            ack = run.msg.reply if run.msg is not None else ""
            out.hold_started(wire.Started(item.id, self.node_id, self.instance, ack, cold_start_ms=run.cold_start_ms))
            if item.body_size:
                item = msgspec.structs.replace(item, body=await fetch_body(self.nc, item, self.bodies), body_size=0)
            usage = await r.adapter.run(item, r.cfg.model, send)
            error = ""
            run.answered = True
            if run.msg is not None:
                await run.msg.ack()  # before Done: the slot is free by the time the edge hears of it
            if _free(r, run, edge) and run.ahead is not None:
                # The slot's next pull goes out after the ack and before the Done, so it waits in
                # the broker by the time the edge, told by the Done, publishes the next request;
                # sent from here, the three leave in one write with no loop turn between (a turn
                # held the Done 0.2-0.35 ms at c=1). The fetch loop, woken by `freed`, waits on it.
                await _quietly(run.ahead())
            done = wire.Done(
                item.id,
                window.sent_chunks,
                usage,
                upstream_status=outcome.upstream_status,
                exit_code=outcome.exit_code,
                run_ms=round((time.monotonic() - began) * 1000, 3),
                ttfb_ms=round((first_byte - began) * 1000, 3) if first_byte else 0.0,
            )
            await out.send(done)
            r.served += 1
        except asyncio.CancelledError:
            r.failed += 1
            if run.msg is not None:
                await _quietly(run.msg.term())
            reason = "node is stopping" if self.stopping else "cancelled"
            await _quietly(out.send(failure(Cancelled(reason))))
        except RequestError as exc:
            r.failed += 1
            error = exc.code
            # The operator's view of an upstream failure, under the id the client and the edge know.
            # Its code and status only: the message may quote the upstream's error text or a
            # command's stderr, which can repeat the prompt (only the client is told those).
            log.warning(
                "%s %s: request %s failed: %s (status %d)",
                r.kind,
                r.cfg.id,
                item.request_id or item.id,
                exc.code,
                exc.status,
            )
            if run.msg is not None:
                await _quietly(run.msg.term())
            await _quietly(out.send(failure(exc)))
        except Exception as exc:  # the adapter boundary: any bug below it must end as a Failure, never hang
            # (adapter, upstream client, translation): the client hears why and the slot is freed.
            r.failed += 1
            error = "node_error"
            log.exception("provider %s: request %s failed", r.cfg.id, item.request_id or item.id)
            if run.msg is not None:
                await _quietly(run.msg.term())
            await _quietly(out.send(failure(UpstreamError(f"{type(exc).__name__}: {exc}", code="node_error"))))
        finally:
            out.close()
            if work is not None:
                ttfb_ms = round((first_byte - began) * 1000, 3) if first_byte else 0.0
                spans.ended(work, call, outcome, usage, error, ttfb_ms)
            _free(r, run, edge)
            self.by_id.pop(item.id, None)
            self.changed.set()

    async def publish(self, item: wire.WorkItem, message: Any) -> None:
        """Send one reply message (Started, Chunk, Done, Failure, Replies) to the request's edge."""
        # Kept first: a reply lost with a NATS server is sent again when the edge asks (Resend).
        self.replay.keep(item.reply_to, message)
        await self.nc.publish(item.reply_to, wire.encode(message))

    def redelivered(self, item: wire.WorkItem, msg: Msg) -> bool:
        """Whether a work message delivered again is one this process runs or ran: it never runs twice.

        The broker redelivers when an ack or progress was lost with a NATS server; the edge may not
        know the request started (its Started lost too), so only the node can tell. A running one
        takes the new delivery (its ack and progress must name it); an ended one is answered again.
        """
        run = self.by_id.get(item.id)
        if run is not None:
            run.msg = msg
            return True
        return self.replay.knows(item.id)

    # --- what the edge says about running requests ----------------------------------------------

    def on_cancel(self, msg: Msg) -> None:
        try:
            cancel = wire.decode_cancel(msg.data)
        except msgspec.DecodeError:
            log.warning("node %s: undecodable cancel dropped", self.node_id)
            return
        now = time.monotonic()
        self._cancelled[cancel.id] = now
        if len(self._cancelled) > 10_000:
            self._cancelled = {k: t for k, t in self._cancelled.items() if now - t < CANCEL_MEMORY_S}
        run = self.by_id.get(cancel.id)
        if run is not None and run.task is not None:
            run.task.cancel()

    def on_received(self, msg: Msg) -> None:
        try:
            received = wire.decode_received(msg.data)
        except msgspec.DecodeError:
            log.warning("node %s: undecodable received list dropped", self.node_id)
            return
        self.replay.received(received.ids)

    def on_credit(self, msg: Msg) -> None:
        try:
            credit = wire.decode_credit(msg.data)
        except msgspec.DecodeError:
            log.warning("node %s: undecodable credit dropped", self.node_id)
            return
        self._credited(credit)

    def _credited(self, credit: wire.Credit) -> None:
        self.replay.confirm(credit.id, credit.chunks)
        run = self.by_id.get(credit.id)
        if run is not None:
            run.window.grant(credit.chunks, credit.nbytes)

    async def on_resend(self, msg: Msg) -> None:
        """An edge lost replies on the way (a NATS server died): publish again what is kept."""
        await serve_resend(self.nc, self.replay, msg)

    # --- keeping long requests alive, and finding out when their edge is gone -------------------

    async def progress_loop(self) -> None:
        # Long answers outlive ack_wait; tell the broker they are alive so it never redelivers them.
        while True:
            await asyncio.sleep(wire.ACK_WAIT_S / 3)
            for run in list(self.by_id.values()):
                if run.msg is not None:
                    try:
                        await run.msg.in_progress()
                    except (nats.errors.Error, OSError) as exc:
                        # Acked meanwhile, or disconnected: the next round tries again if it still runs.
                        log.debug("progress of %s not sent: %s", run.item.id, exc)

    async def probe_loop(self) -> None:
        # A dead edge raises nothing when we publish to it; asking is how a node finds out, and the
        # answer also carries the latest credit in case a Credit message was lost.
        while True:
            await asyncio.sleep(self.probe_interval_s)
            now = time.monotonic()
            due = [run for run in self.by_id.values() if now - run.since >= self.probe_interval_s]
            if due:
                await asyncio.gather(*(self.probe(run) for run in due))

    async def probe(self, run: Running) -> None:
        """Ask the edge of `run` whether it still wants it, and how far its client read (see probe_loop)."""
        try:
            reply = await self.nc.request(
                run.item.reply_to, wire.encode(wire.Probe(run.item.id)), timeout=self.probe_interval_s
            )
            credit = wire.decode_credit(reply.data)
        except nats.errors.NoRespondersError:
            # Twice in a row, so that an edge reconnecting to NATS is not taken for a dead one.
            run.unanswered += 1
            if run.unanswered >= PROBES_UNANSWERED:
                self._abandon(run, "its edge is gone")
            return
        except (nats.errors.Error, TimeoutError, OSError, msgspec.DecodeError) as exc:
            log.debug("probe for %s unanswered: %s", run.item.id, exc)
            return
        run.unanswered = 0
        if credit.known:
            self._credited(credit)
        else:
            self._abandon(run, "its edge no longer has it")

    def _abandon(self, run: Running, why: str) -> None:
        if run.task is not None and not run.task.done() and not run.answered:
            log.warning("node %s: stopping request %s: %s", self.node_id, run.item.id, why)
            run.task.cancel()


class _Outbox:
    """One request's replies on their way to the edge: a few travel together as one `Replies`.

    Every NATS message costs the node a write, nats-server a routing and the edge a wake-up; a short
    answer used to be three (Started, Chunk, Done). Started waits up to `wire.STARTED_HOLD_S` for the
    first answer bytes, and a non-streamed answer's chunk waits for the Done (its client gets
    nothing before it anyway). Order is kept: whatever is held leaves before anything sent after it.
    """

    __slots__ = ("held", "item", "running", "since", "timer")

    def __init__(self, running: RunningRequests, item: wire.WorkItem) -> None:
        self.running = running
        self.item = item
        self.held: list[wire.Started | wire.Chunk | wire.Done | wire.Failure] = []
        self.since = 0.0
        self.timer: asyncio.TimerHandle | None = None

    def hold_started(self, started: wire.Started) -> None:
        self.since = time.monotonic()
        self.held.append(started)
        self.timer = asyncio.get_running_loop().call_later(wire.STARTED_HOLD_S, self._on_timer)

    def hold(self, chunk: wire.Chunk) -> None:
        self.held.append(chunk)

    def holds_chunk(self) -> bool:
        return bool(self.held) and isinstance(self.held[-1], wire.Chunk)

    async def send(self, message: wire.Started | wire.Chunk | wire.Done | wire.Failure) -> None:
        self.held.append(message)
        await self.flush()

    async def flush(self) -> None:
        if not self.held:
            return
        held, self.held = self.held, []  # taken before the first await: a concurrent flush sends after
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        first = held[0]
        if isinstance(first, wire.Started):
            held[0] = msgspec.structs.replace(first, held_ms=round((time.monotonic() - self.since) * 1000, 3))
        await self.running.publish(self.item, held[0] if len(held) == 1 else wire.Replies(held))

    def _on_timer(self) -> None:
        # The first bytes are slow to come (a model thinking): the edge hears of the start now.
        self.timer = None
        if self.held:
            task = asyncio.create_task(_quietly(self.flush()))
            self.running.flushing.add(task)
            task.add_done_callback(self.running.flushing.discard)

    def close(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


def _free(r: Resource, run: Running, edge: str) -> bool:
    """The run's slot is free: the upstream has answered (or the run is over). Whether a fetch loop was told.

    The counts the node reports (in flight, and by edge for the edges' shares) drop with it: the
    next item may start before this run has sent its Done, and never counts twice."""
    if not run.holds_slot:
        return False
    run.holds_slot = False
    r.in_flight -= 1
    if r.by_edge.get(edge, 0) <= 1:
        r.by_edge.pop(edge, None)
    else:
        r.by_edge[edge] -= 1
    if run.freed is None or run.freed.done():
        return False
    run.freed.set_result(None)
    return True


def _delivery(msg: Msg | None) -> tuple[int, float | None]:
    """How often the work stream delivered the item, and how long it was stored there (ms); (1, None) for CLI."""
    if msg is None:
        return 1, None
    meta = msg.metadata
    return meta.num_delivered, max(0.0, (time.time() - meta.timestamp.timestamp()) * 1000)


async def _quietly(aw: Any) -> None:
    try:
        await aw
    except (nats.errors.Error, OSError, TimeoutError) as exc:
        log.debug("ignored while failing a request: %s", exc)
