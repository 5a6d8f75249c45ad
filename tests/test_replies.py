"""How a node's replies travel: a short answer in one NATS message, Started held only briefly."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import nats
from nats.aio.msg import Msg

from iop import config, wire
from iop.nats import connection
from iop.nats.server import EmbeddedNats
from iop.node.adapters.mock import MockAdapter
from iop.node.resource import Resource
from iop.node.running import RunningRequests

WAIT_S = 20.0


@dataclass
class Inbox:
    """Every NATS message a request's reply subject received, decoded, in arrival order."""

    messages: list[object] = field(default_factory=list)
    ended: asyncio.Event = field(default_factory=asyncio.Event)

    async def on_message(self, msg: Msg) -> None:
        reply = wire.decode_reply(msg.data)
        self.messages.append(reply)
        last = reply.items[-1] if isinstance(reply, wire.Replies) else reply
        if isinstance(last, wire.Done | wire.Failure):
            self.ended.set()

    def pieces(self) -> list[object]:
        return [one for m in self.messages for one in (m.items if isinstance(m, wire.Replies) else [m])]


@asynccontextmanager
async def answered(nats_url: str, *, stream: bool, latency_ms: int, tokens: int = 3) -> AsyncIterator[Inbox]:
    """Run one request on a node's RunningRequests (mock adapter) and collect what its edge receives."""
    node_nc = await nats.connect(nats_url)
    edge_nc = await nats.connect(nats_url)
    try:
        cfg = config.MockAdapter(id="m", latency_ms=latency_ms, tokens=tokens, token_interval_ms=0)
        resource = Resource(cfg=config.Provider(id="p", adapter="m", capacity=1), adapter=MockAdapter(cfg), kind="pool")
        running = RunningRequests(node_nc, "n", "instance", asyncio.Event())
        request_id = secrets.token_hex(4)
        inbox = Inbox()
        reply_to = wire.reply_subject("played-edge", "n", request_id)
        await edge_nc.subscribe(reply_to, cb=inbox.on_message)
        await connection.flush(edge_nc)
        body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
        item = wire.WorkItem(
            id=request_id, api="chat", stream=stream, alias="m", body=body, reply_to=reply_to, deadline=time.time() + 60
        )
        run = running.start(resource, item, None)
        assert run.task is not None
        await asyncio.wait_for(run.task, WAIT_S)
        await connection.flush(node_nc)
        async with asyncio.timeout(WAIT_S):
            await inbox.ended.wait()
        yield inbox
    finally:
        await edge_nc.close()
        await node_nc.close()


async def test_a_short_answer_is_one_message(nats_server: EmbeddedNats) -> None:
    async with answered(nats_server.url, stream=False, latency_ms=0) as inbox:
        assert len(inbox.messages) == 1
        (only,) = inbox.messages
        assert isinstance(only, wire.Replies)
        started, chunk, done = only.items
        assert isinstance(started, wire.Started) and 0 <= started.held_ms < 1000
        assert isinstance(chunk, wire.Chunk) and chunk.seq == 0 and b'"choices"' in chunk.data
        assert isinstance(done, wire.Done) and done.chunks == 1


async def test_a_stream_sends_started_with_its_first_bytes_and_each_chunk_at_once(nats_server: EmbeddedNats) -> None:
    async with answered(nats_server.url, stream=True, latency_ms=0, tokens=4) as inbox:
        first = inbox.messages[0]
        assert isinstance(first, wire.Replies)
        assert [type(p) for p in first.items] == [wire.Started, wire.Chunk]
        # Every later chunk travels as it comes: nothing streamed waits for company.
        rest = inbox.messages[1:]
        assert all(isinstance(m, wire.Chunk) for m in rest[:-1]), rest
        pieces = inbox.pieces()
        chunks = [p for p in pieces if isinstance(p, wire.Chunk)]
        assert [c.seq for c in chunks] == list(range(len(chunks))) and len(chunks) > 3
        assert isinstance(pieces[-1], wire.Done) and pieces[-1].chunks == len(chunks)


async def test_a_slow_first_byte_does_not_hold_started_back(nats_server: EmbeddedNats) -> None:
    # The model takes 300 ms to its first byte: the edge hears of the start long before that.
    async with answered(nats_server.url, stream=False, latency_ms=300) as inbox:
        first = inbox.messages[0]
        assert isinstance(first, wire.Started)
        assert wire.STARTED_HOLD_S * 1000 <= first.held_ms < 300
        second = inbox.messages[1]
        assert isinstance(second, wire.Replies)
        assert [type(p) for p in second.items] == [wire.Chunk, wire.Done]
