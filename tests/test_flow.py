"""The flow window of one answer, without a deployment: credit, its bounds, stalls, and probes of the edge."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Literal

import nats
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from iop import config, wire
from iop.nats import connection
from iop.nats.server import EmbeddedNats
from iop.node.adapters.mock import MockAdapter
from iop.node.flow import ClientStalled, FlowWindow
from iop.node.resource import Resource
from iop.node.running import PROBES_UNANSWERED, Running, RunningRequests
from tests.harness import until

WAIT_S = 20.0
"""Upper bound on anything these tests wait for; a healthy run takes milliseconds (the bound is for
a machine busy with other work, as CI's two cores can be)."""


async def blocked(window: FlowWindow, size: int, on_blocked: asyncio.Event) -> asyncio.Task[int]:
    """A reserve of `size` bytes, once it is known to wait for credit."""
    on_blocked.clear()
    task = asyncio.create_task(window.reserve(size, stall_timeout_s=60))
    async with asyncio.timeout(WAIT_S):
        await on_blocked.wait()
    assert window.blocked and not task.done()
    return task


# --- the window itself ------------------------------------------------------------------------------


async def test_flow_window_lets_512_chunks_out_without_credit_then_waits() -> None:
    on_blocked = asyncio.Event()
    window = FlowWindow(on_blocked)
    seqs = [await window.reserve(10, stall_timeout_s=60) for _ in range(wire.WINDOW_CHUNKS)]
    assert seqs == list(range(wire.WINDOW_CHUNKS))
    assert (window.sent_chunks, window.sent_bytes, window.waits) == (wire.WINDOW_CHUNKS, 10 * wire.WINDOW_CHUNKS, 0)
    assert not on_blocked.is_set()

    task = await blocked(window, 10, on_blocked)
    window.grant(1, 10)  # the client took one chunk: exactly one more fits
    assert await asyncio.wait_for(task, WAIT_S) == wire.WINDOW_CHUNKS
    assert window.waits == 1 and not window.blocked
    assert not window.fits(10)


async def test_flow_window_lets_1_mib_out_without_credit_then_waits() -> None:
    on_blocked = asyncio.Event()
    window = FlowWindow(on_blocked)
    quarter = wire.WINDOW_BYTES // 4
    for _ in range(4):
        await window.reserve(quarter, stall_timeout_s=60)
    assert window.sent_bytes == wire.WINDOW_BYTES and window.waits == 0

    task = await blocked(window, 1, on_blocked)
    window.grant(0, 1)  # one byte taken: one byte fits, though no chunk was counted as taken
    assert await asyncio.wait_for(task, WAIT_S) == 4
    assert window.sent_bytes - window.credit_bytes == wire.WINDOW_BYTES


async def test_flow_window_a_piece_that_does_not_fit_waits_for_enough_credit() -> None:
    on_blocked = asyncio.Event()
    window = FlowWindow(on_blocked)
    await window.reserve(wire.WINDOW_BYTES - 100, stall_timeout_s=60)
    task = await blocked(window, 1000, on_blocked)
    window.grant(0, 500)  # progress, but not room for the whole piece
    assert not window.fits(1000) and window.blocked
    window.grant(1, 900)
    assert await asyncio.wait_for(task, WAIT_S) == 1


def test_flow_window_credit_is_cumulative_and_never_taken_back() -> None:
    window = FlowWindow()
    window.grant(100, 50_000)
    window.grant(40, 10_000)  # late, reordered: changes nothing
    assert (window.credit_chunks, window.credit_bytes) == (100, 50_000)
    window.grant(100, 60_000)  # a newer one moves what it moves
    assert (window.credit_chunks, window.credit_bytes) == (100, 60_000)
    # What fits is measured from the credit, not from zero.
    window.sent_chunks, window.sent_bytes = 100 + wire.WINDOW_CHUNKS - 1, 60_000
    assert window.fits(wire.WINDOW_BYTES)
    assert not window.fits(wire.WINDOW_BYTES + 1)
    window.sent_chunks += 1
    assert not window.fits(1)


async def test_flow_window_fails_a_client_that_takes_nothing_for_the_stall_timeout() -> None:
    window = FlowWindow()
    for _ in range(wire.WINDOW_CHUNKS):
        await window.reserve(1, stall_timeout_s=60)
    t0 = time.monotonic()
    with pytest.raises(ClientStalled) as raised:
        await window.reserve(1, stall_timeout_s=0.05)
    assert time.monotonic() - t0 >= 0.05
    assert raised.value.status == 408 and raised.value.code == "client_stalled"
    assert not window.blocked and window.sent_chunks == wire.WINDOW_CHUNKS  # nothing counted as sent


async def test_flow_window_cancel_ends_the_wait_for_credit() -> None:
    on_blocked = asyncio.Event()
    window = FlowWindow(on_blocked)
    for _ in range(wire.WINDOW_CHUNKS):
        await window.reserve(1, stall_timeout_s=60)
    task = await blocked(window, 1, on_blocked)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not window.blocked and window.sent_chunks == wire.WINDOW_CHUNKS


# --- a running request whose edge stops granting: what probes do (real NATS, the test plays the edge)


ProbeAnswer = Literal["received", "stale", "unknown"]


@dataclass
class PlayedEdge:
    """The reply inbox of one request: counts what the node sends and answers its probes as told.

    "received": credit for everything received (a Credit message was lost); "stale": the credit it
    last granted, none (the edge stopped granting); "unknown": the edge no longer has the request.
    """

    request_id: str
    probes: ProbeAnswer = "stale"
    chunks: int = 0
    nbytes: int = 0
    probed: int = 0
    failure: wire.Failure | None = None
    failed: asyncio.Event = field(default_factory=asyncio.Event)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    sub: Subscription | None = None

    async def on_message(self, msg: Msg) -> None:
        self.changed.set()
        reply = wire.decode_reply(msg.data)
        # A node sends Started with the first chunk, and a Failure with what it held, as one Replies.
        for one in reply.items if isinstance(reply, wire.Replies) else [reply]:
            if isinstance(one, wire.Chunk):
                self.chunks += 1
                self.nbytes += len(one.data)
            elif isinstance(one, wire.Failure):
                self.failure = one
                self.failed.set()
        if isinstance(reply, wire.Probe):
            self.probed += 1
            if self.probes == "received":
                credit = wire.Credit(self.request_id, self.chunks, self.nbytes)
            else:
                credit = wire.Credit(self.request_id, 0, 0, known=self.probes == "stale")
            await msg.respond(wire.encode(credit))


@dataclass
class OneRequest:
    running: RunningRequests
    resource: Resource
    run: Running
    edge: PlayedEdge
    edge_nc: NATS


@asynccontextmanager
async def one_long_answer(nats_url: str) -> AsyncIterator[OneRequest]:
    """A node's running requests with one streamed answer far longer than the window, held at its bound."""
    node_nc = await nats.connect(nats_url)
    edge_nc = await nats.connect(nats_url)
    adapter_cfg = config.MockAdapter(id="m", latency_ms=0, tokens=5 * wire.WINDOW_CHUNKS, token_interval_ms=0)
    resource = Resource(
        cfg=config.Provider(id="p", adapter="m", capacity=1), adapter=MockAdapter(adapter_cfg), kind="pool"
    )
    running = RunningRequests(node_nc, "n", "instance", asyncio.Event())
    running.probe_interval_s = WAIT_S  # a probe's answer may be slow on a busy machine; never time it out here
    request_id = secrets.token_hex(4)
    edge = PlayedEdge(request_id)
    reply_to = wire.reply_prefix("played-edge") + "." + request_id
    edge.sub = await edge_nc.subscribe(reply_to, cb=edge.on_message)
    await connection.flush(edge_nc)
    item = wire.WorkItem(
        id=request_id,
        api="chat",
        stream=True,
        alias="m",
        body=b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}',
        reply_to=reply_to,
        deadline=time.time() + 60,
    )
    run = running.start(resource, item, None)
    try:
        await until(lambda: run.window.blocked, running.changed, WAIT_S)
        assert run.window.sent_chunks == wire.WINDOW_CHUNKS and run.window.credit_chunks == 0
        # The node has sent the window; wait until the played edge has it all too, so that no probe
        # queues behind chunks still on their way (under load that took longer than a probe waits).
        await connection.flush(node_nc)
        await until(lambda: edge.chunks == wire.WINDOW_CHUNKS, edge.changed, WAIT_S)
        yield OneRequest(running, resource, run, edge, edge_nc)
    finally:
        assert run.task is not None
        run.task.cancel()
        await asyncio.wait({run.task}, timeout=WAIT_S)
        await edge_nc.close()
        await node_nc.close()


async def test_probe_brings_credit_that_was_lost_and_the_answer_moves_on(nats_server: EmbeddedNats) -> None:
    async with one_long_answer(nats_server.url) as one:
        one.edge.probes = "received"
        await one.running.probe(one.run)
        assert one.edge.probed == 1 and one.run.window.credit_chunks == wire.WINDOW_CHUNKS
        # One full window more, and not a chunk past it: the edge still grants nothing by itself.
        await until(
            lambda: one.run.window.blocked and one.run.window.sent_chunks == 2 * wire.WINDOW_CHUNKS,
            one.running.changed,
            WAIT_S,
        )
        assert one.run.unanswered == 0 and one.resource.in_flight == 1


async def test_probe_of_an_edge_that_stopped_granting_leaves_the_request_waiting(nats_server: EmbeddedNats) -> None:
    async with one_long_answer(nats_server.url) as one:
        one.edge.probes = "stale"
        for _ in range(PROBES_UNANSWERED + 1):
            await one.running.probe(one.run)
        # Answered, so the edge is alive: the request waits (the stall timeout is what ends it).
        assert one.edge.probed == PROBES_UNANSWERED + 1
        assert one.run.unanswered == 0 and one.run.window.blocked
        assert one.run.task is not None and not one.run.task.done()
        assert one.run.window.sent_chunks == wire.WINDOW_CHUNKS == one.edge.chunks


async def test_probe_answered_unknown_stops_the_request(nats_server: EmbeddedNats) -> None:
    async with one_long_answer(nats_server.url) as one:
        one.edge.probes = "unknown"
        await one.running.probe(one.run)
        async with asyncio.timeout(WAIT_S):
            await one.edge.failed.wait()
        assert one.edge.failure is not None and one.edge.failure.code == "cancelled"
        assert one.edge.failure.chunks == wire.WINDOW_CHUNKS
        await until(lambda: one.resource.in_flight == 0, one.running.changed, WAIT_S)
        assert one.resource.failed == 1 and not one.running.by_id


async def test_probe_without_responder_stops_the_request_only_the_second_time(nats_server: EmbeddedNats) -> None:
    async with one_long_answer(nats_server.url) as one:
        assert one.edge.sub is not None
        await one.edge.sub.unsubscribe()
        await connection.flush(one.edge_nc)  # the server no longer has a responder for the reply subject
        await one.running.probe(one.run)
        # Once may be an edge reconnecting to NATS: the request goes on.
        assert one.run.unanswered == 1
        assert one.run.task is not None and not one.run.task.done()

        # Answered again: the count starts over.
        one.edge.sub = await one.edge_nc.subscribe(one.run.item.reply_to, cb=one.edge.on_message)
        await connection.flush(one.edge_nc)
        await one.running.probe(one.run)
        assert one.run.unanswered == 0

        await one.edge.sub.unsubscribe()
        await connection.flush(one.edge_nc)
        for _ in range(PROBES_UNANSWERED):
            await one.running.probe(one.run)
        await until(lambda: one.resource.in_flight == 0, one.running.changed, WAIT_S)
        assert one.resource.failed == 1 and one.run.task.done()
