"""Embeddings and completions through pools: the openai SDK, an upstream that serves them, the ledger."""

from __future__ import annotations

import asyncio
import base64
import struct

import openai

from iop.nats.server import EmbeddedNats
from tests.fakes import fake_upstream
from tests.harness import deployment, deployment_running, until
from tests.test_ledger import ledger_records


def one_provider(url: str, api: str, capacity: int = 2) -> str:
    return f"""
models: [{{alias: m, pool: [p]}}]
nodes:
  - id: n
    adapters: [{{id: up, type: openai, base_url: "{url}", api: {api}}}]
    providers: [{{id: p, adapter: up, model: served-model, capacity: {capacity}}}]
"""


async def test_embeddings_pass_through_and_count_every_input(nats_server: EmbeddedNats) -> None:
    async with (
        fake_upstream(api="chat,embeddings") as up,
        deployment_running(deployment(one_provider(up.url, "[chat, embeddings]")), nats_server.url) as h,
    ):
        client = h.client()
        one = await client.embeddings.create(model="m", input="a b c")
        assert [d.embedding for d in one.data] == [[0.0, 3.0, 0.5]]
        batch = await client.embeddings.create(model="m", input=["a", "b c", "d e f g"])
        assert [d.index for d in batch.data] == [0, 1, 2]
        assert batch.usage.prompt_tokens == 7  # every input of the batch, not the first
        # The SDK asks for base64 by default and decodes it; asked for floats, floats come back.
        raw = await client.embeddings.create(model="m", input=["x y"], encoding_format="float")
        assert raw.data[0].embedding == [0.0, 2.0, 0.5]
        async with h.http() as http:
            b64 = await http.post("/v1/embeddings", json={"model": "m", "input": "p q", "encoding_format": "base64"})
            vector = struct.unpack("<3f", base64.b64decode(b64.json()["data"][0]["embedding"]))
            assert vector == (0.0, 2.0, 0.5)
            empty = await http.post("/v1/embeddings", json={"model": "m", "input": []})
            assert empty.status_code == 400 and empty.json()["error"]["param"] == "input"
        records = await ledger_records(h, 5)
    assert {r.api for r in records} == {"embeddings"}
    assert sorted((r.status, r.input_tokens or 0) for r in records) == [
        (200, 2),
        (200, 2),
        (200, 3),
        (200, 7),
        (400, 0),
    ]
    assert set(up.by_path) == {"/v1/embeddings"}
    assert all(b["model"] == "served-model" for b in up.bodies)


async def test_completions_with_suffix_whole_and_streamed(nats_server: EmbeddedNats) -> None:
    async with (
        fake_upstream(api="completions") as up,
        deployment_running(deployment(one_provider(up.url, "[completions]")), nats_server.url) as h,
    ):
        client = h.client()
        whole = await client.completions.create(model="m", prompt="def add(a, b):", suffix="\nprint(add(1, 2))")
        assert whole.choices[0].text == "w0 w1 w2 <fim \nprint(add(1, 2))>"
        assert whole.usage is not None and whole.usage.completion_tokens == 3
        stream = await client.completions.create(model="m", prompt="x", suffix="END", stream=True)
        pieces = [c.choices[0].text async for c in stream if c.choices]
        assert "".join(pieces).strip() == "w0 w1 w2 <fim END>"
        records = await ledger_records(h, 2)
        # Chat is not what this upstream serves: refused at once, not queued.
        try:
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
            raise AssertionError("chat on a completions-only alias was served")
        except openai.BadRequestError as refused:
            assert "does not serve /v1/chat/completions" in refused.message
    assert {(r.api, r.stream) for r in records} == {("completions", False), ("completions", True)}
    # The stream asked the upstream for its usage (iop counts tokens) and the ledger has it.
    assert all(r.input_tokens == 4 and r.output_tokens == 3 for r in records)
    assert up.bodies[0]["suffix"] == "\nprint(add(1, 2))" and up.bodies[0]["model"] == "served-model"
    assert up.by_path == {"/v1/completions": 2}


async def test_embeddings_wait_for_the_pools_capacity(nats_server: EmbeddedNats) -> None:
    gate = asyncio.Event()
    async with (
        fake_upstream(api="embeddings", gate=gate) as up,
        deployment_running(deployment(one_provider(up.url, "[embeddings]", capacity=2)), nats_server.url) as h,
    ):
        client = h.client()
        calls = [asyncio.create_task(client.embeddings.create(model="m", input=f"t{i}")) for i in range(5)]
        await up.wait_for(lambda u: u.in_flight == 2)
        pool = h.edge.scheduler.pools["m"]
        await until(lambda: len(pool.waiters) + pool.standing == 3, h.edge.scheduler.changed)
        assert up.in_flight == 2  # capacity 2: the other three wait on the edge
        gate.set()
        done = await asyncio.gather(*calls)
    assert len(done) == 5 and up.peak == 2
