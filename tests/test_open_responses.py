"""The Open Responses specification, over a chat-only upstream through an edge and a node.

What its compliance suite checks over HTTP, in our own tests: every response object and every
streamed event validates against the specification's schema (its pydantic models, package
openresponses-types), for a plain answer, a stream, instructions, a tool call, a multi-turn
conversation (whole input and `previous_response_id`) and a stored response read back.
"""

from __future__ import annotations

import enum
from typing import Any

import httpx
import pydantic
from openresponses_types import types as spec

from iop.nats.server import EmbeddedNats
from tests.fakes import fake_upstream
from tests.harness import deployment, deployment_running, sse_events

CHAT_ONLY = """
models: [{{alias: m, pool: [p]}}]
nodes:
  - id: n
    adapters: [{{id: up, type: openai, base_url: "{url}", api: chat}}]
    providers: [{{id: p, adapter: up, model: served-model, capacity: 2}}]
"""
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def _event_models() -> dict[str, type[pydantic.BaseModel]]:
    models: dict[str, type[pydantic.BaseModel]] = {}
    for name in dir(spec):
        model = getattr(spec, name)
        if name.endswith("StreamingEvent") and isinstance(model, type) and issubclass(model, pydantic.BaseModel):
            kind = model.model_fields["type"].annotation
            if isinstance(kind, type) and issubclass(kind, enum.Enum):
                models.update({member.value: model for member in kind})
    return models


EVENTS = _event_models()


def check_response(body: dict[str, Any]) -> spec.ResponseResource:
    return spec.ResponseResource.model_validate(body)


def check_stream(text: str) -> list[dict[str, Any]]:
    """Every event of a stream, each valid as the specification's event of its type."""
    events = sse_events(text)
    assert events, "no events"
    for n, event in enumerate(events):
        assert event["type"] in EVENTS, f"{event['type']} is not an Open Responses event"
        EVENTS[event["type"]].model_validate(event)
        assert event["sequence_number"] == n
    assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.completed"
    return events


async def post(http: httpx.AsyncClient, **body: Any) -> httpx.Response:
    r = await http.post("/v1/responses", json={"model": "m", **body})
    assert r.status_code == 200, r.text
    return r


async def test_open_responses_answers_and_streams_validate_over_a_chat_only_upstream(
    nats_server: EmbeddedNats,
) -> None:
    async with (
        fake_upstream(api="chat") as up,
        deployment_running(deployment(CHAT_ONLY.format(url=up.url)), nats_server.url) as h,
        h.http() as http,
    ):
        plain = check_response((await post(http, input="Say hello")).json())
        assert plain.status == "completed" and plain.store is True
        events = check_stream((await post(http, input="Say hello", stream=True)).text)
        deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        assert deltas == "w0 w1 w2"
        for event in events:
            if "response" in event:
                check_response(event["response"])
        told = check_response((await post(http, input="hi", instructions="Answer in French")).json())
        assert told.instructions == "Answer in French"
    assert up.bodies[-1]["messages"][0] == {"role": "system", "content": "Answer in French"}


async def test_open_responses_tool_calls_validate_and_round_trip(nats_server: EmbeddedNats) -> None:
    async with (
        fake_upstream(api="chat") as up,
        deployment_running(deployment(CHAT_ONLY.format(url=up.url)), nats_server.url) as h,
        h.http() as http,
    ):
        called = (await post(http, input="weather in Paris?", tools=[WEATHER])).json()
        check_response(called)
        [call] = [item for item in called["output"] if item["type"] == "function_call"]
        assert called["tools"] == [{**WEATHER, "strict": False}]
        check_stream((await post(http, input="weather in Paris?", tools=[WEATHER], stream=True)).text)
        output = {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}
        answer = (await post(http, tools=[WEATHER], previous_response_id=called["id"], input=[output])).json()
        check_response(answer)
        assert answer["output"][-1]["type"] == "message"
    assert [m["role"] for m in up.bodies[-1]["messages"]] == ["user", "assistant", "tool"]


async def test_open_responses_multi_turn_and_stored_reads_validate(nats_server: EmbeddedNats) -> None:
    async with (
        fake_upstream(api="chat") as up,
        deployment_running(deployment(CHAT_ONLY.format(url=up.url)), nats_server.url) as h,
        h.http() as http,
    ):
        history = [
            {"type": "message", "role": "user", "content": "My name is Ada."},
            {"type": "message", "role": "assistant", "content": "Hello Ada."},
            {"type": "message", "role": "user", "content": "What is my name?"},
        ]
        whole = check_response((await post(http, input=history)).json())
        follow = check_response((await post(http, input="And again?", previous_response_id=whole.id)).json())
        assert follow.previous_response_id == whole.id
        got = (await http.get(f"/v1/responses/{follow.id}")).json()
        assert check_response(got) == follow
        check_stream((await http.get(f"/v1/responses/{follow.id}?stream=true")).text)
    assert len(up.bodies[-1]["messages"]) == 5
