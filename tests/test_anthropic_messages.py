"""Anthropic Messages end to end: the anthropic SDK through the edge and a node, over chat-only and
Messages-serving upstreams, with Anthropic's errors for every refusal."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from iop.nats.server import EmbeddedNats
from tests.fakes import FakeUpstream, fake_upstream
from tests.harness import EdgeHandle, deployment, deployment_running, until
from tests.test_ledger import ledger_records

if TYPE_CHECKING:
    import anthropic

# The SDK is imported by the tests that use it: under xdist every worker collects this file, and the
# SDK's import alone is seconds of CPU for the three workers that never run it.

KEY = "sk-iop-claude-test-key"
TOOLS: list[Any] = [
    {
        "name": "get_weather",
        "description": "Weather for a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]
HELLO: list[Any] = [{"role": "user", "content": "hello"}]


def one_provider(url: str, api: str, extra: str = "", adapter: str = "") -> str:
    return f"""
edge: {{api_keys_env: IOP_TEST_KEYS{extra}}}
models: [{{alias: m, pool: [p]}}]
nodes:
  - id: n
    adapters: [{{id: up, type: openai, base_url: "{url}", api: {api}{adapter}}}]
    providers: [{{id: p, adapter: up, model: served-model, capacity: 1}}]
"""


@asynccontextmanager
async def served(
    nats_url: str, api: str, monkeypatch: pytest.MonkeyPatch, extra: str = "", adapter: str = "", **knobs: Any
) -> AsyncIterator[tuple[EdgeHandle, FakeUpstream, anthropic.AsyncAnthropic]]:
    import anthropic

    monkeypatch.setenv("IOP_TEST_KEYS", KEY)
    upstream_api = api.strip("[]").replace(" ", "")
    async with (
        fake_upstream(api=upstream_api, **knobs) as up,
        deployment_running(deployment(one_provider(up.url, api, extra, adapter)), nats_url) as h,
    ):
        # The SDK sends x-api-key (never Authorization), as Claude Code does.
        client = anthropic.AsyncAnthropic(base_url=h.url, api_key=KEY, max_retries=0)
        try:
            yield h, up, client
        finally:
            await client.close()


async def test_messages_over_a_chat_only_upstream_whole_and_streamed(
    nats_server: EmbeddedNats, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with served(nats_server.url, "chat", monkeypatch) as (_, up, client):
        msg = await client.messages.create(model="m", max_tokens=64, system="be brief", messages=HELLO)
        assert [b.type for b in msg.content] == ["text"]
        assert msg.content[0].type == "text" and msg.content[0].text == "w0 w1 w2"
        assert msg.stop_reason == "end_turn" and msg.role == "assistant"
        assert (msg.usage.input_tokens, msg.usage.output_tokens) == (5, 3)

        async with client.messages.stream(model="m", max_tokens=64, messages=HELLO) as stream:
            kinds = [event.type async for event in stream]
            final = await stream.get_final_message()
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
        assert "content_block_delta" in kinds and "message_delta" in kinds
        assert final.content[0].type == "text" and final.content[0].text == "w0 w1 w2"
        assert final.usage.output_tokens == 3
    # The upstream saw chat requests only: the system prompt first, the served model's name.
    assert set(up.by_path) == {"/v1/chat/completions"}
    assert up.bodies[0]["messages"][0] == {"role": "system", "content": "be brief"}
    assert up.bodies[0]["model"] == "served-model" and up.bodies[0]["max_tokens"] == 64


@pytest.mark.parametrize("stream", [False, True])
async def test_messages_tool_round_trip_over_chat(
    nats_server: EmbeddedNats, monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    async with served(nats_server.url, "chat", monkeypatch) as (_, up, client):
        ask: list[Any] = [{"role": "user", "content": "weather in Paris?"}]
        first: anthropic.types.Message  # streamed: the SDK's ParsedMessage, a Message
        if stream:
            async with client.messages.stream(model="m", max_tokens=64, messages=ask, tools=TOOLS) as s:
                first = await s.get_final_message()
        else:
            first = await client.messages.create(model="m", max_tokens=64, messages=ask, tools=TOOLS)
        assert first.stop_reason == "tool_use"
        uses = [b for b in first.content if b.type == "tool_use"]
        assert len(uses) == 1
        use = uses[0]
        assert (use.name, use.input, use.id) == ("get_weather", {"city": "Paris"}, "call_fake1")
        follow: list[Any] = [
            *ask,
            {"role": "assistant", "content": [b.model_dump() for b in first.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]},
        ]
        second = await client.messages.create(model="m", max_tokens=64, messages=follow, tools=TOOLS)
        assert second.stop_reason == "end_turn"
        assert second.content[0].type == "text" and second.content[0].text == "w0 w1 w2"
    # The tool's answer reached the chat upstream as a tool message answering the call.
    last = up.bodies[-1]["messages"]
    assert last[-2]["tool_calls"][0]["id"] == "call_fake1"
    assert last[-1] == {"role": "tool", "tool_call_id": "call_fake1", "content": "sunny"}
    assert up.bodies[-1]["tools"][0]["function"]["name"] == "get_weather"


async def test_messages_pass_through_to_an_upstream_that_serves_them(
    nats_server: EmbeddedNats, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with served(nats_server.url, "[chat, messages]", monkeypatch) as (h, up, client):
        msg = await client.messages.create(model="m", max_tokens=64, messages=HELLO, tools=TOOLS)
        assert msg.id == "msg_native"  # the upstream's own answer, not a translation
        assert msg.content[0].type == "text" and msg.content[0].text == "w0 w1 w2"
        async with client.messages.stream(model="m", max_tokens=64, messages=HELLO) as stream:
            final = await stream.get_final_message()
        assert final.id == "msg_native" and final.usage.output_tokens == 3
        records = await ledger_records(h, 2)
    assert set(up.by_path) == {"/v1/messages"}
    # The client's body went up untouched but for the served model's name.
    assert up.bodies[0]["tools"] == TOOLS and up.bodies[0]["model"] == "served-model"
    assert sorted((r.api, r.stream, r.provider, r.status) for r in records) == [
        ("messages", False, "p", 200),
        ("messages", True, "p", 200),
    ]
    assert sorted((r.stream, r.input_tokens, r.output_tokens) for r in records) == [(False, 6, 3), (True, 6, 3)]


async def test_messages_refusals_are_anthropic_errors(
    nats_server: EmbeddedNats, monkeypatch: pytest.MonkeyPatch
) -> None:
    import anthropic

    async with served(nats_server.url, "chat", monkeypatch) as (h, up, client):
        with pytest.raises(anthropic.NotFoundError) as missing:
            await client.messages.create(model="nope", max_tokens=8, messages=HELLO)
        assert missing.value.body == {
            "type": "error",
            "error": {"type": "not_found_error", "message": missing.value.body["error"]["message"]},
            "request_id": missing.value.response.headers["x-request-id"],
        }
        assert "nope" in missing.value.message
        with pytest.raises(anthropic.BadRequestError) as bad:
            await client.messages.create(model="m", max_tokens=0, messages=HELLO)
        assert bad.value.status_code == 400 and "max_tokens" in bad.value.message
        wrong = anthropic.AsyncAnthropic(base_url=h.url, api_key="sk-iop-wrong", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError) as denied:
            await wrong.messages.create(model="m", max_tokens=8, messages=HELLO)
        await wrong.close()
        assert denied.value.body["error"]["type"] == "authentication_error"
        # Authorization: Bearer is the same key.
        async with httpx.AsyncClient(base_url=h.url) as http:
            body = {"model": "m", "max_tokens": 8, "messages": HELLO}
            ok = await http.post("/v1/messages?beta=true", json=body, headers={"authorization": f"Bearer {KEY}"})
            assert ok.status_code == 200 and ok.json()["type"] == "message"
            odd = await http.post(
                "/v1/messages", json={**body, "messages": "hi"}, headers={"x-api-key": KEY, "anthropic-version": "x"}
            )
            assert odd.status_code == 400 and odd.json()["error"]["type"] == "invalid_request_error"
        assert up.total == 1  # nothing refused reached the upstream


async def test_messages_upstream_failure_and_full_queue_are_anthropic_errors(
    nats_server: EmbeddedNats, monkeypatch: pytest.MonkeyPatch
) -> None:
    import anthropic

    async with served(nats_server.url, "chat", monkeypatch, fail_status=500) as (h, up, client):
        with pytest.raises(anthropic.APIStatusError) as failed:
            await client.messages.create(model="m", max_tokens=8, messages=HELLO)
        assert failed.value.status_code == 502
        assert failed.value.body["error"]["type"] == "api_error"
    gate = asyncio.Event()
    extra = ", queue: {max_waiting: 1}"
    async with served(nats_server.url, "chat", monkeypatch, extra, gate=gate) as (h, up, client):
        held = [asyncio.create_task(client.messages.create(model="m", max_tokens=8, messages=HELLO)) for _ in range(2)]
        await up.wait_for(lambda u: u.in_flight == 1)
        pool = h.edge.scheduler.pools["m"]
        await until(lambda: len(pool.waiters) + pool.standing == 1, h.edge.scheduler.changed)
        with pytest.raises(anthropic.RateLimitError) as full:
            await client.messages.create(model="m", max_tokens=8, messages=HELLO)
        assert full.value.body["error"]["type"] == "rate_limit_error"
        gate.set()
        done = await asyncio.gather(*held)
        assert all(m.content[0].type == "text" for m in done)


async def test_count_tokens_estimates_without_a_model(
    nats_server: EmbeddedNats, monkeypatch: pytest.MonkeyPatch
) -> None:
    import anthropic

    async with served(nats_server.url, "chat", monkeypatch) as (_, up, client):
        short = await client.messages.count_tokens(model="m", messages=HELLO)
        long = await client.messages.count_tokens(
            model="m", messages=[{"role": "user", "content": "hello " * 400}], system="be brief", tools=TOOLS
        )
        assert 0 < short.input_tokens < long.input_tokens
        assert long.input_tokens >= 2400 // 4  # 4 bytes a token (iop/anthropic/count.py)
        with pytest.raises(anthropic.NotFoundError):
            await client.messages.count_tokens(model="nope", messages=HELLO)
        with pytest.raises(anthropic.BadRequestError):
            await client.messages.count_tokens(model="m", messages="hi")
    assert up.total == 0  # counted on the edge


@pytest.mark.parametrize("tokenizer", ["vllm", "llama.cpp"])
async def test_count_tokens_asks_the_upstreams_tokenizer_through_the_pool(
    nats_server: EmbeddedNats, monkeypatch: pytest.MonkeyPatch, tokenizer: str
) -> None:
    async with served(nats_server.url, "chat", monkeypatch, adapter=f", tokenize: {tokenizer}") as (h, up, client):
        asked: list[Any] = [{"role": "user", "content": "one two three four"}]
        counted = await client.messages.count_tokens(model="m", system="be brief", messages=asked)
        records = await ledger_records(h, 1)
    # A token a word in the fake: the system prompt and the message (llama.cpp: and a <turn> each).
    assert counted.input_tokens == (6 if tokenizer == "vllm" else 8)
    if tokenizer == "vllm":
        assert up.by_path == {"/tokenize": 1}
        assert up.bodies[0]["messages"][0] == {"role": "system", "content": "be brief"}
        assert up.bodies[0]["model"] == "served-model" and up.bodies[0]["add_generation_prompt"] is True
    else:
        assert up.by_path == {"/apply-template": 1, "/tokenize": 1}
    assert [(r.api, r.provider, r.status) for r in records] == [("count_tokens", "p", 200)]


async def test_an_endpoint_the_pool_cannot_serve_is_refused_at_once(
    nats_server: EmbeddedNats, monkeypatch: pytest.MonkeyPatch
) -> None:
    import anthropic

    gate = asyncio.Event()  # the only slot is busy: a request that queued would wait
    async with served(nats_server.url, "responses", monkeypatch, gate=gate) as (h, up, client):
        held = asyncio.create_task(h.client(KEY).chat.completions.create(model="m", messages=HELLO))
        await up.wait_for(lambda u: u.in_flight == 1)
        with pytest.raises(anthropic.BadRequestError) as refused:
            await client.messages.create(model="m", max_tokens=8, messages=HELLO)
        assert "does not serve /v1/messages" in refused.value.message
        async with httpx.AsyncClient(base_url=h.url, headers={"x-api-key": KEY}) as http:
            emb = await http.post("/v1/embeddings", json={"model": "m", "input": "x"})
            assert emb.status_code == 400 and emb.json()["error"]["code"] == "endpoint_not_served"
            models = (await http.get("/v1/models")).json()["data"]
            assert models[0]["endpoints"] == ["chat", "responses"]
            pool = (await http.get("/status")).json()["pools"][0]
            assert (pool["alias"], pool["endpoints"]) == ("m", ["chat", "responses"])
        gate.set()
        await held
