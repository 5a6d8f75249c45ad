"""Agent-sized request bodies stay at the edge: the work stream stores a small item, the node fetches the body."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from iop import wire
from iop.edge.channel import Channel
from iop.edge.publish import INLINE_BELOW
from iop.errors import BodyUnavailable
from iop.nats import connection, inline
from iop.nats.server import EmbeddedNats
from iop.node.body import SENT_KEEP_S, SENT_MAX_BYTES, SentBodies, fetch_body
from tests.fakes import fake_upstream
from tests.harness import EdgeHandle, deployment, deployment_running, eventually, one_provider_yaml
from tests.test_security import TWO_NODES, rogue


def _chat(text: str) -> dict[str, object]:
    return {"model": "m", "messages": [{"role": "user", "content": text}]}


async def test_an_agent_sized_body_reaches_the_upstream_whole_but_never_the_work_stream(
    nats_server: EmbeddedNats,
) -> None:
    small = "s" * (INLINE_BELOW - 4096)
    large = 'é"\\' * (INLINE_BELOW // 2)  # 1.5 x the bound in bytes, escapes and non-ASCII
    async with fake_upstream() as up:
        dep = deployment(one_provider_yaml(up.url).replace("adapter: up,", "adapter: up, model: served,"))
        async with deployment_running(dep, nats_server.url) as h, h.http() as http:
            published: list[int] = []

            async def seen(msg: Msg) -> None:
                published.append(len(msg.data))

            watch = await h.edge.nc.subscribe("iop.work.>", cb=seen)  # what the edge puts in the work stream
            publisher = h.edge.relay.publish
            for text in (small, large):
                r = await http.post("/v1/chat/completions", json=_chat(text))
                assert r.status_code == 200, r.text
                assert up.bodies[-1]["messages"][0]["content"] == text
                assert up.bodies[-1]["model"] == "served"  # the node's own model, set in the fetched body
            r = await http.post("/v1/chat/completions", json={**_chat(large), "stream": True})
            assert r.status_code == 200 and "[DONE]" in r.text
            assert up.bodies[-1]["messages"][0]["content"] == large
            await connection.flush(h.edge.nc)
            await watch.unsubscribe()
    assert publisher.bodies_by_reference == 2
    # Sent to the node ahead of their work items, they were there when it took them: no part asked for.
    assert publisher.bodies_sent == 2 and publisher.parts_asked == 0
    assert len(published) == 3
    assert published[0] > len(small)  # below the bound: inline, one message as before
    assert max(published[1:]) < 4096  # the work items of the large ones: no body in them


async def _edge_answering(nats_url: str, body: bytes, part: int, wanted: int) -> tuple[NATS, list[int]]:
    """A stand-in for the edge's answers to BodyPart: `part` bytes an answer, each only once `wanted`
    requests have arrived (a node asking one part at a time would never get its first)."""
    nc = await connection.connect(nats_url, "test-body-edge", wait_s=5)
    offsets: list[int] = []
    held: list[tuple[str, int]] = []

    async def on_part(msg: Msg) -> None:
        ask = wire.decode_reply(msg.data)
        assert isinstance(ask, wire.BodyPart) and ask.id == "w1"
        offsets.append(ask.offset)
        if len(offsets) < wanted:
            held.append((msg.reply, ask.offset))  # answered once all the first asks are in
            return
        for reply, offset in [*held, (msg.reply, ask.offset)]:
            await nc.publish(reply, body[offset : offset + part])
        held.clear()

    await nc.subscribe("iop.reply.e.n.w1", cb=on_part, pending_msgs_limit=100)
    await connection.flush(nc)
    return nc, offsets


def _item(size: int, rid: str = "w1") -> wire.WorkItem:
    return wire.WorkItem(
        id=rid,
        api="chat",
        stream=False,
        alias="m",
        body=b"",
        reply_to=f"iop.reply.e.n.{rid}",
        deadline=0,
        body_size=size,
    )


async def test_the_node_asks_for_every_part_at_once_and_again_for_what_a_short_answer_left(
    nats_server: EmbeddedNats,
) -> None:
    node = await connection.connect(nats_server.url, "test-body-node", wait_s=5)
    step = wire.body_part_size(node.max_payload)
    body = bytes(range(256)) * ((2 * step + step // 2) // 256)
    ranges = -(-len(body) // step)
    # The edge's parts are 3/4 of the node's: each full range needs a second ask for its last quarter.
    edge, offsets = await _edge_answering(nats_server.url, body, step * 3 // 4, wanted=ranges)
    try:
        got = await asyncio.wait_for(fetch_body(node, _item(len(body))), 20)
    finally:
        await edge.close()
        await node.close()
    assert got == body
    assert sorted(offsets[:ranges]) == [i * step for i in range(ranges)]  # all asked before any answer
    assert sorted(offsets[ranges:]) == [i * step + step * 3 // 4 for i in range(ranges - 1)]


async def test_a_body_the_edge_no_longer_has_is_unavailable(nats_server: EmbeddedNats) -> None:
    node = await connection.connect(nats_server.url, "test-body-node", wait_s=5)
    edge, _ = await _edge_answering(nats_server.url, b"", 1, wanted=1)  # answers b"": the request is gone
    try:
        with pytest.raises(BodyUnavailable, match="no longer has"):
            await asyncio.wait_for(fetch_body(node, _item(10)), 20)
    finally:
        await edge.close()
        await node.close()


@contextlib.asynccontextmanager
async def _kept_for_b(nats_server: EmbeddedNats, text: str) -> AsyncIterator[tuple[EdgeHandle, Channel]]:
    """A request whose body stayed at the edge, run by node b and held at its upstream meanwhile:
    the edge and the request's channel; the request answers 200 once the block ends."""
    gate = asyncio.Event()
    async with fake_upstream(gate=gate) as up:
        dep = deployment(TWO_NODES.replace("UPSTREAM", up.url))
        await nats_server.authorize(dep.nodes)
        async with deployment_running(dep, nats_server.url) as h, h.http() as http:
            held = asyncio.create_task(http.post("/v1/chat/completions", json={**_chat(text), "model": "b-pool"}))
            await up.wait_for(lambda u: u.in_flight == 1)  # node b fetched it, and the upstream holds it
            assert up.bodies[-1]["messages"][0]["content"] == text
            [ch] = [c for c in h.edge.relay.channels.values() if c.body]  # the one body kept for its node
            assert ch.node == "b"
            yield h, ch
            gate.set()
            assert (await held).status_code == 200


async def test_another_node_cannot_read_a_body_that_stayed_at_the_edge(nats_server: EmbeddedNats) -> None:
    # Every agent-sized body now waits at the edge for its node to ask. Node a, with its own
    # credential, asks for a body sent to node b: under b's id the server refuses the publish
    # (test_security), under its own id the edge answers nothing and counts a forged reply.
    async with _kept_for_b(nats_server, "b's prompt " * (INLINE_BELOW // 8)) as (h, ch), rogue(nats_server, "a") as a:
        ask = wire.encode(wire.BodyPart(ch.id, 0))
        answer = await a.nc.request(wire.reply_subject(h.edge.edge_id, "a", ch.id), ask, timeout=5)
        assert answer.data == b"" and h.edge.relay.forged == 1


async def _sent_bodies(
    nats_url: str, max_bytes: int = SENT_MAX_BYTES, keep_s: float = SENT_KEEP_S
) -> tuple[NATS, NATS, SentBodies]:
    """A node's store of bodies sent ahead, subscribed as the node subscribes, and an edge's connection."""
    node = await connection.connect(nats_url, "test-sent-node", wait_s=5)
    edge = await connection.connect(nats_url, "test-sent-edge", wait_s=5)
    sent = SentBodies(max_bytes, keep_s)
    await inline.subscribe(node, wire.body_subject("n"), sent.on_part)
    await connection.flush(node)
    return node, edge, sent


async def test_the_edge_answers_every_one_of_a_node_s_asks_for_a_body_s_parts(nats_server: EmbeddedNats) -> None:
    # The relay answers a node's questions one at a time from one task (a part is a 1 MiB publish
    # that may wait for the connection's buffer): many asks at once all get their own part.
    large = "b's prompt, \u00e9 " * (3 * 1024 * 1024 // 16)
    # Node b's own credential: the node the request was sent to.
    async with _kept_for_b(nats_server, large) as (h, ch), rogue(nats_server, "b") as b:
        body = bytes(ch.body)
        step = wire.body_part_size(b.nc.max_payload)
        offsets = [at for at in range(0, len(body), step) for _ in range(8)]
        subject = wire.reply_subject(h.edge.edge_id, "b", ch.id)
        answers = await asyncio.gather(
            *(b.nc.request(subject, wire.encode(wire.BodyPart(ch.id, at)), timeout=10) for at in offsets)
        )
    assert len(offsets) >= 24
    assert [a.data for a in answers] == [body[at : at + step] for at in offsets]


async def test_parts_sent_ahead_make_the_body_and_only_the_missing_one_is_fetched(nats_server: EmbeddedNats) -> None:
    node, edge, sent = await _sent_bodies(nats_server.url)
    step = wire.body_part_size(node.max_payload)
    body = bytes(range(256)) * ((2 * step + step // 2) // 256)
    answers, offsets = await _edge_answering(nats_server.url, body, step, wanted=1)
    try:
        # The first and last parts arrive; the middle one was lost on the way.
        for offset in (0, 2 * step):
            await edge.publish(wire.body_subject("n", "w1", offset), body[offset : offset + step])
        await connection.flush(edge)
        await until_held(sent, len(body) - step)
        got = await asyncio.wait_for(fetch_body(node, _item(len(body)), sent), 20)
        assert got == body
        assert offsets == [step]  # asked for the missing part alone, after waiting for it a while
        assert (sent.whole, sent.fetched, sent.held) == (0, 1, 0)
        # A body here whole is taken without a word to the edge.
        await edge.publish(wire.body_subject("n", "w2", 0), body[:step])
        await connection.flush(edge)
        await until_held(sent, step)
        assert await fetch_body(node, _item(step, "w2"), sent) == body[:step]
        assert (sent.whole, offsets) == (1, [step])
        # A part that comes after its body was taken is dropped at once, not held.
        await edge.publish(wire.body_subject("n", "w1", step), body[step : 2 * step])
        await connection.flush(edge)
        await until_held(sent, 0, dropped=1)
    finally:
        for nc in (answers, edge, node):
            await nc.close()


async def test_parts_sent_ahead_are_bounded_in_bytes_and_expire_unclaimed(nats_server: EmbeddedNats) -> None:
    node, edge, sent = await _sent_bodies(nats_server.url, max_bytes=1000, keep_s=1.0)
    try:
        await edge.publish(wire.body_subject("n", "a", 0), b"x" * 600)
        await edge.publish(wire.body_subject("n", "b", 0), b"y" * 600)  # over the bound: dropped
        await edge.publish(wire.body_subject("n", "c", "z"), b"z")  # not an offset: dropped
        await connection.flush(edge)
        await until_held(sent, 600, dropped=2)
        # Never claimed by a work item, what is held goes after `keep_s`.
        await until_held(sent, 0, dropped=3)
        have, missing = await sent.take("a", 600)
        assert (have, missing) == ({}, [(0, 600)])
    finally:
        await edge.close()
        await node.close()


async def test_parts_that_do_not_tile_the_stated_body_are_not_used(nats_server: EmbeddedNats) -> None:
    node, edge, sent = await _sent_bodies(nats_server.url)
    try:
        await edge.publish(wire.body_subject("n", "w1", 0), b"a" * 10)
        await edge.publish(wire.body_subject("n", "w1", 5), b"b" * 10)  # overlaps the first
        await connection.flush(edge)
        await until_held(sent, 20)
        assert await sent.take("w1", 15) == ({}, [(0, 15)])
        assert sent.held == 0
    finally:
        await edge.close()
        await node.close()


async def until_held(sent: SentBodies, held: int, dropped: int | None = None) -> None:
    async def reached() -> bool:
        return sent.held == held and (dropped is None or sent.dropped == dropped)

    await eventually(reached, timeout_s=10)
