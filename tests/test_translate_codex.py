"""Codex CLI's Responses surface over a chat-only server, row by row (tests/data/translate/codex_items.json)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pytest

from iop.openai.responses_request import responses_to_chat_request
from iop.openai.tool_names import MAX_NAME, Origin, ToolMap
from iop.openai.translate import ChatToResponsesStream, chat_to_responses_answer
from tests.harness import RESPONSE_EVENT, sdk_client, sse

TABLE = json.loads((Path(__file__).parent / "data" / "translate" / "codex_items.json").read_text())


@pytest.mark.parametrize("case", TABLE["requests"], ids=lambda c: c["about"][:60])
def test_codex_request_items_to_chat(case: dict[str, Any]) -> None:
    tools = ToolMap.of(case["request"])
    chat = responses_to_chat_request(case["request"], "served", tools=tools, **case.get("options", {}))
    assert chat == case["expected"]
    assert tools.dropped == case["dropped"]


def test_codex_tool_names_are_chat_safe_unique_and_never_split() -> None:
    long_ns = "mcp__" + "a_very_long_server_name_that_goes_on" * 2
    request = {
        "tools": [
            {"type": "function", "name": "mcp__demo__echo_text"},  # a plain function with a namespace-like name
            {"type": "namespace", "name": "mcp__demo", "tools": [{"type": "function", "name": "echo_text"}]},
            {"type": "namespace", "name": "mcp", "tools": [{"type": "function", "name": "demo__echo_text"}]},
            {"type": "namespace", "name": long_ns, "tools": [{"type": "function", "name": "tool.with.dots"}]},
        ]
    }
    tools = ToolMap.of(request)
    names = [t["function"]["name"] for t in tools.tools]
    assert len(set(names)) == 4
    assert names[0] == "mcp__demo__echo_text"  # plain functions keep their names
    assert all(len(n) <= MAX_NAME and n.replace("_", "").replace("-", "").isalnum() for n in names)
    origins = [tools.origin(n) for n in names]
    assert origins == [
        Origin("function", "mcp__demo__echo_text"),
        Origin("function", "echo_text", "mcp__demo"),
        Origin("function", "demo__echo_text", "mcp"),
        Origin("function", "tool.with.dots", long_ns),
    ]
    # Built again from the same request (the answer side does), the map is the same.
    assert [t["function"]["name"] for t in ToolMap.of(request).tools] == names


def whole_body(case: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": "served",
        "choices": [{"index": 0, "message": case["message"], "finish_reason": case["finish_reason"]}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14},
    }


def stream_bytes(case: dict[str, Any], usage: bool = True) -> bytes:
    """The answer as a chat server streams it: reasoning, text, then each call with its arguments in pieces."""
    message = case["message"]
    chunks: list[dict[str, Any]] = [{"role": "assistant", "content": ""}]
    if message.get("reasoning_content"):
        text = message["reasoning_content"]
        chunks += [{"reasoning_content": text[:2]}, {"reasoning_content": text[2:]}]
    if message.get("content"):
        text = message["content"]
        chunks += [{"content": text[:3]}, {"content": text[3:]}]
    for i, call in enumerate(message.get("tool_calls") or []):
        head = {"index": i, "id": call["id"], "type": "function"}
        chunks.append({"tool_calls": [{**head, "function": {"name": call["function"]["name"], "arguments": ""}}]})
        arguments = call["function"]["arguments"]
        for piece in (arguments[:5], arguments[5:]):
            chunks.append({"tool_calls": [{"index": i, "function": {"arguments": piece}}]})
    out = b""
    base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "served"}
    for delta in chunks:
        data = {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
        out += b"data: " + json.dumps(data).encode() + b"\n\n"
    finish = {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": case["finish_reason"]}]}
    out += b"data: " + json.dumps(finish).encode() + b"\n\n"
    if usage:
        counts = {"prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14}
        out += b"data: " + json.dumps({**base, "choices": [], "usage": counts}).encode() + b"\n\n"
    return out + b"data: [DONE]\n\n"


def without_ids(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in item.items() if k != "id"} for item in items]


def request_of(case: dict[str, Any]) -> dict[str, Any]:
    return {"model": "gpt-5.5", "input": "go", "tools": case["tools"], "stream": True}


@pytest.mark.parametrize("case", TABLE["answers"], ids=lambda c: c["about"][:60])
def test_codex_chat_answer_to_items_whole(case: dict[str, Any]) -> None:
    response = chat_to_responses_answer(whole_body(case), request_of(case), "gpt-5.5")
    assert without_ids(response["output"]) == case["output"]
    assert response["usage"]["input_tokens"] == 10 and response["usage"]["total_tokens"] == 14
    openai.types.responses.Response.model_validate(response)


def sse_events(data: bytes) -> list[dict[str, Any]]:
    """The events of a Responses stream as JSON, each named by its type and valid as the SDK's typed event."""
    events = []
    for n, sent in enumerate(sse(data)):
        event = json.loads(sent.data)
        assert sent.event == event["type"] and event["sequence_number"] == n
        RESPONSE_EVENT.validate_python(event)
        events.append(event)
    return events


@pytest.mark.parametrize("case", TABLE["answers"], ids=lambda c: c["about"][:60])
def test_codex_chat_answer_to_items_streamed(case: dict[str, Any]) -> None:
    stream = ChatToResponsesStream(request_of(case), "gpt-5.5")
    data = stream.start() + stream.feed(stream_bytes(case)) + stream.close()
    events = sse_events(data)
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert without_ids(done) == case["output"]
    completed = events[-1]
    assert completed["type"] == "response.completed" and completed["response"]["id"]
    assert without_ids(completed["response"]["output"]) == case["output"]
    usage = completed["response"]["usage"]
    assert (usage["input_tokens"], usage["output_tokens"], usage["total_tokens"]) == (10, 4, 14)
    # Every delta follows the output_item.added of its item (Codex drops deltas of unknown items).
    added: set[str] = set()
    for event in events:
        if event["type"] == "response.output_item.added":
            added.add(event["item"]["id"])
        elif event["type"].endswith(".delta"):
            assert event["item_id"] in added, event
    kinds = {e["type"] for e in events}
    if any(i["type"] == "custom_tool_call" for i in case["output"]):
        assert {"response.custom_tool_call_input.delta", "response.custom_tool_call_input.done"} <= kinds
    if any(i["type"] == "function_call" for i in case["output"]):
        assert "response.function_call_arguments.delta" in kinds


def sdk_stream(data: bytes) -> Any:
    """The openai SDK's `responses.stream(...)` helper reading `data`, offline; returns its final response."""

    client = sdk_client(data, "text/event-stream")
    with client.responses.stream(model="gpt-5.5", input="go") as stream:
        for _ in stream:
            pass
        return stream.get_final_response()


@pytest.mark.parametrize("case", TABLE["answers"], ids=lambda c: c["about"][:60])
def test_codex_streams_are_accepted_by_the_sdk_stream_helper(case: dict[str, Any]) -> None:
    stream = ChatToResponsesStream(request_of(case), "gpt-5.5")
    final = sdk_stream(stream.start() + stream.feed(stream_bytes(case)) + stream.close())
    assert [item.type for item in final.output] == [item["type"] for item in case["output"]]
    assert final.usage is not None and final.usage.total_tokens == 14
