"""Responses ⇄ chat end to end: the openai SDK against upstreams that serve only the other API."""

from __future__ import annotations

from typing import Any

from openai.types.responses import (
    Response,
    ResponseCompletedEvent,
    ResponseCustomToolCall,
    ResponseFunctionToolCall,
)

from iop.nats.server import EmbeddedNats
from tests.codex_upstream import Call, Turn, scripted_chat
from tests.fakes import fake_upstream
from tests.harness import deployment, deployment_running

TOOLS: list[Any] = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]


def one_provider(url: str, api: str) -> str:
    return f"""
models: [{{alias: m, pool: [p]}}]
nodes:
  - id: n
    adapters: [{{id: up, type: openai, base_url: "{url}", api: {api}}}]
    providers: [{{id: p, adapter: up, model: served-model, capacity: 2}}]
"""


async def test_responses_on_a_chat_only_upstream(nats_server: EmbeddedNats) -> None:
    async with fake_upstream(api="chat") as up:
        async with deployment_running(deployment(one_provider(up.url, "chat")), nats_server.url) as h:
            client = h.client()
            resp = await client.responses.create(model="m", input="hi", instructions="be brief")
            assert resp.output_text == "w0 w1 w2"
            assert resp.status == "completed"
            assert resp.usage is not None and resp.usage.output_tokens == 3 and resp.usage.total_tokens == 8

            events = [e async for e in await client.responses.create(model="m", input="hi", stream=True)]
            kinds = [e.type for e in events]
            assert kinds[:2] == ["response.created", "response.in_progress"]
            assert kinds[-1] == "response.completed"
            assert [e.sequence_number for e in events] == list(range(len(events)))
            assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "w0 w1 w2"
            assert isinstance(events[-1], ResponseCompletedEvent)
            final = events[-1].response
            assert final.usage is not None and final.usage.output_tokens == 3
        # The upstream saw only chat calls, with instructions as the system message.
        assert set(up.by_path) == {"/v1/chat/completions"}
        assert up.bodies[0]["messages"][0] == {"role": "system", "content": "be brief"}
        assert up.bodies[0]["model"] == "served-model"


async def test_tool_call_round_trip_through_translation(nats_server: EmbeddedNats) -> None:
    async with fake_upstream(api="chat") as up:
        async with deployment_running(deployment(one_provider(up.url, "chat")), nats_server.url) as h:
            client = h.client()
            first: Response  # streamed: the SDK's ParsedResponse, a Response
            answer: Response
            for stream in (False, True):
                if stream:
                    async with client.responses.stream(model="m", input="weather in Paris?", tools=TOOLS) as s:
                        first = await s.get_final_response()
                else:
                    first = await client.responses.create(model="m", input="weather in Paris?", tools=TOOLS)
                calls = [o for o in first.output if isinstance(o, ResponseFunctionToolCall)]
                assert len(calls) == 1
                call = calls[0]
                assert (call.name, call.arguments, call.call_id) == ("get_weather", '{"city": "Paris"}', "call_fake1")
                follow_up: list[Any] = [
                    {"role": "user", "content": "weather in Paris?"},
                    {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
                    {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
                ]
                if stream:
                    async with client.responses.stream(model="m", input=follow_up, tools=TOOLS) as s:
                        answer = await s.get_final_response()
                else:
                    answer = await client.responses.create(model="m", input=follow_up, tools=TOOLS)
                assert answer.output_text == "w0 w1 w2"
        # The follow-up reached the chat server as an assistant tool call plus the tool's output.
        follow = up.bodies[1]
        assert [m["role"] for m in follow["messages"]] == ["user", "assistant", "tool"]
        assert follow["messages"][1]["tool_calls"][0]["id"] == "call_fake1"
        assert follow["messages"][2] == {"role": "tool", "tool_call_id": "call_fake1", "content": "sunny"}
        assert set(up.by_path) == {"/v1/chat/completions"}


async def test_chat_on_a_responses_only_upstream(nats_server: EmbeddedNats) -> None:
    async with fake_upstream(api="responses") as up:
        async with deployment_running(deployment(one_provider(up.url, "responses")), nats_server.url) as h:
            client = h.client()
            msgs: Any = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
            chat = await client.chat.completions.create(model="m", messages=msgs)
            assert chat.choices[0].message.content == "w0 w1 w2"
            assert chat.choices[0].finish_reason == "stop"
            chunks = [c async for c in await client.chat.completions.create(model="m", messages=msgs, stream=True)]
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "w0 w1 w2"
        assert set(up.by_path) == {"/v1/responses"}
        assert up.bodies[0]["instructions"] == "be brief"


CODEX_TOOLS: list[Any] = [
    {"type": "function", "name": "exec_command", "parameters": {"type": "object", "properties": {}}},
    {
        "type": "namespace",
        "name": "multi_agent_v1",
        "description": "",
        "tools": [{"type": "function", "name": "close_agent"}],
    },
    {"type": "custom", "name": "apply_patch", "description": "Edit files."},
    {"type": "web_search", "external_web_access": False},
    {"type": "image_generation"},
]


async def test_codex_tools_through_edge_and_node_with_the_sdk_stream_helper(nats_server: EmbeddedNats) -> None:
    turns = [
        Turn(
            reasoning="Two calls.",
            text="On it.",
            calls=[
                Call("multi_agent_v1__close_agent", {"target": "a"}, "c1"),
                Call("apply_patch", {"input": "PATCH"}, "c2"),
            ],
        ),
        Turn(text="whole"),
        Turn(text="streamed"),
    ]
    async with (
        scripted_chat(turns) as up,
        deployment_running(deployment(one_provider(up.url, "chat")), nats_server.url) as h,
    ):
        client = h.client()
        async with client.responses.stream(model="m", input="go", tools=CODEX_TOOLS) as stream:
            final = await stream.get_final_response()
        kinds = [item.type for item in final.output]
        assert kinds == ["reasoning", "message", "function_call", "custom_tool_call"]
        call, patch = final.output[2], final.output[3]
        assert isinstance(call, ResponseFunctionToolCall) and isinstance(patch, ResponseCustomToolCall)
        assert (call.name, call.namespace, call.call_id) == ("close_agent", "multi_agent_v1", "c1")
        assert (patch.name, patch.input, patch.call_id) == ("apply_patch", "PATCH", "c2")
        assert final.usage is not None and final.usage.total_tokens == 18
        # The hosted tools were dropped, and the answer says which (whole answers too).
        raw = await client.responses.with_raw_response.create(model="m", input="go", tools=CODEX_TOOLS)
        assert raw.headers["x-iop-dropped-tools"] == "web_search,image_generation"
        assert raw.parse().output_text == "whole"
        body = {"model": "m", "input": "go", "tools": CODEX_TOOLS, "stream": True}
        async with h.http() as http, http.stream("POST", "/v1/responses", json=body) as streamed:
            assert streamed.headers["x-iop-dropped-tools"] == "web_search,image_generation"
            assert b"response.completed" in b"".join([piece async for piece in streamed.aiter_bytes()])
    sent = [t["function"]["name"] for t in up.bodies[0]["tools"]]
    assert sent == ["exec_command", "multi_agent_v1__close_agent", "apply_patch"]


async def test_hosted_tool_types_reach_the_dropped_tools_header_only_as_safe_bounded_text(
    nats_server: EmbeddedNats,
) -> None:
    forged = [{"type": "web_search\r\nx-forged: 1"}]
    many = [{"type": f"hosted_{i}"} for i in range(3000)]
    async with (
        scripted_chat([Turn(text="one"), Turn(text="two")]) as up,
        deployment_running(deployment(one_provider(up.url, "chat")), nats_server.url) as h,
        h.http() as http,
    ):
        r = await http.post("/v1/responses", json={"model": "m", "input": "go", "tools": forged})
        assert r.status_code == 200, r.text
        assert r.headers["x-iop-dropped-tools"] == "web_search??x-forged:?1" and "x-forged" not in r.headers
        r = await http.post("/v1/responses", json={"model": "m", "input": "go", "tools": many})
        assert r.status_code == 200, r.text
        dropped = r.headers["x-iop-dropped-tools"]
        assert len(dropped) <= 600 and dropped.startswith("hosted_0,hosted_1,") and dropped.endswith(" more")


async def test_refusal_names_its_param_and_provider(nats_server: EmbeddedNats) -> None:
    async with (
        fake_upstream(api="chat") as up,
        deployment_running(deployment(one_provider(up.url, "chat")), nats_server.url) as h,
        h.http() as http,
    ):
        r = await http.post("/v1/responses", json={"model": "m", "input": "hi", "conversation": "conv_1"})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "conversation"
    assert r.json()["error"]["code"] == "unsupported_parameter"
    assert r.headers["x-iop-provider"] == "p"
    assert up.total == 0


MIXED = """
models: [{{alias: m, pool: [p-chat, p-resp]}}]
nodes:
  - id: n
    adapters:
      - {{id: chat, type: openai, base_url: "{chat}", api: chat}}
      - {{id: resp, type: openai, base_url: "{resp}", api: responses}}
    providers:
      - {{id: p-chat, adapter: chat, model: served-model, capacity: 1}}
      - {{id: p-resp, adapter: resp, model: served-model, capacity: 4}}
"""


async def test_mixed_pool_refuses_the_same_on_every_provider(nats_server: EmbeddedNats) -> None:
    async with fake_upstream(api="chat") as chat, fake_upstream(api="responses") as resp:
        dep = deployment(MIXED.format(chat=chat.url, resp=resp.url))
        async with deployment_running(dep, nats_server.url) as h, h.http() as http:
            # The scheduler would pick p-resp (most free slots), which serves Responses natively.
            for _ in range(4):
                r = await http.post("/v1/responses", json={"model": "m", "input": "hi", "conversation": "conv_1"})
                assert r.status_code == 400, r.text
                assert (r.json()["error"]["param"], r.headers["x-iop-provider"]) == ("conversation", "p-chat")
            ok = [await http.post("/v1/responses", json={"model": "m", "input": "hi"}) for _ in range(2)]
            assert [r.status_code for r in ok] == [200, 200]
    assert chat.total + resp.total == 2
