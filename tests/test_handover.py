"""A freed slot's handover to the next request: what keeps a provider busy while work waits.

After the upstream answers, three things travel: the node's ack (the broker's slot), the node's
Done (the edge's slot) and the next work item. The node's next pull must be in the broker before
the edge, told by the Done, publishes that item; and the edge must send that item before it
relays the answer that freed the slot. Both orders are checked on a real nats-server.
"""

from __future__ import annotations

import asyncio

import msgspec
import nats
from nats.aio.msg import Msg

from iop import wire
from iop.edge.relay import Relay
from iop.nats.server import EmbeddedNats
from tests.harness import deployment, deployment_running

YAML = """
models: [{alias: m, pool: [p]}]
nodes:
  - id: n
    adapters: [{id: sim, type: mock, latency_ms: 0, tokens: 2, token_interval_ms: 0}]
    providers: [{id: p, adapter: sim, capacity: 1}]
"""
CHAT = {"model": "m", "messages": [{"role": "user", "content": "x"}]}


def _kind(msg: Msg) -> str:
    """What a message on the bus is, of the three a handover is made of ("" for anything else)."""
    if msg.subject.startswith("$JS.ACK.") and msg.data in (b"", b"+ACK"):  # an empty body acks too
        return "ack"
    if msg.subject.startswith(f"$JS.API.CONSUMER.MSG.NEXT.{wire.WORK_STREAM}."):
        return "pull"
    if msg.subject.startswith(wire.REPLY_ROOT + "."):
        try:
            reply = wire.decode_reply(msg.data)
        except msgspec.DecodeError:
            return ""
        items = reply.items if isinstance(reply, wire.Replies) else [reply]
        if any(isinstance(r, wire.Done) for r in items):
            return "done"
    return ""


async def test_handover_node_pulls_the_next_item_before_its_done_leaves(nats_server: EmbeddedNats) -> None:
    # One subscription to everything: what the node's one connection publishes arrives in its order.
    spy = await nats.connect(nats_server.url)
    seen: list[str] = []
    three_done = asyncio.Event()

    async def on_message(msg: Msg) -> None:
        if kind := _kind(msg):
            seen.append(kind)
            if seen.count("done") >= 3:
                three_done.set()

    try:
        async with deployment_running(deployment(YAML), nats_server.url) as h, h.http() as http:
            await spy.subscribe(">", cb=on_message)
            await spy.flush()
            for _ in range(3):
                assert (await http.post("/v1/chat/completions", json=CHAT)).status_code == 200
            async with asyncio.timeout(10):
                await three_done.wait()
    finally:
        await spy.close()
    # Each answer: its ack, then the slot's next pull, then the Done that lets the edge publish
    # the next item. Before: ack, Done, and only then the pull (the fetch loop waited for the run's end).
    runs = [seen[i : seen.index("done", i) + 1] for i, k in enumerate(seen) if k == "ack"]
    assert len(runs) == 3, seen
    for run in runs:
        assert run[0] == "ack" and run[-1] == "done" and "pull" in run, seen


async def test_handover_edge_frees_the_slot_before_the_reader_has_any_of_the_answer(
    nats_server: EmbeddedNats,
) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        relay = Relay(nc, nc.jetstream(), "e1")
        await relay.start()
        queued_at_end: list[int] = []

        class Slot:
            def node_started(self) -> None:
                pass

            def node_ended(self) -> None:
                queued_at_end.append(ch.queue.qsize())

        ch = relay.open("n1", Slot())
        # A short answer arrives as one message: Started, its chunk and its Done together.
        batch = wire.Replies([wire.Started(ch.id, "n1", "i"), wire.Chunk(ch.id, 0, b"hello"), wire.Done(ch.id, 1)])
        await nc.publish(relay.reply_to(ch), wire.encode(batch))
        async with asyncio.timeout(10):
            got = [data async for data in relay.replies(ch, None)]
        assert got == [b"hello"]
        # The slot was free (the next waiter granted) before the reader could take anything of the
        # batch; before, the reader had Started and the chunk first and ran ahead of the grant.
        assert queued_at_end == [0]
    finally:
        await nc.close()
