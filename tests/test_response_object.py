"""The response object iop builds (translated answers, the mock's writer) has every field the Open
Responses `ResponseResource` requires, each of its type, echoing the request as it was applied."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import pytest

from iop.openai.answer import Usage, answer_writer
from iop.openai.translate import ChatToResponsesStream, chat_to_responses_answer, responses_to_chat_request
from tests.harness import sse_events

NUMBER = (int, float)
OPTIONAL_STRING = (str, type(None))
OPTIONAL_INT = (int, type(None))
# Field → the JSON types the specification allows for it (None: null allowed).
REQUIRED: dict[str, tuple[type, ...]] = {
    "id": (str,),
    "object": (str,),
    "created_at": (int,),
    "completed_at": OPTIONAL_INT,
    "status": (str,),
    "incomplete_details": (dict, type(None)),
    "model": (str,),
    "previous_response_id": OPTIONAL_STRING,
    "instructions": (str, list, type(None)),
    "output": (list,),
    "error": (dict, type(None)),
    "tools": (list,),
    "tool_choice": (str, dict),
    "truncation": (str,),
    "parallel_tool_calls": (bool,),
    "text": (dict,),
    "top_p": NUMBER,
    "presence_penalty": NUMBER,
    "frequency_penalty": NUMBER,
    "top_logprobs": (int,),
    "temperature": NUMBER,
    "reasoning": (dict, type(None)),
    "usage": (dict, type(None)),
    "max_output_tokens": OPTIONAL_INT,
    "max_tool_calls": OPTIONAL_INT,
    "store": (bool,),
    "background": (bool,),
    "service_tier": (str,),
    "metadata": (dict,),
    "safety_identifier": OPTIONAL_STRING,
    "prompt_cache_key": OPTIONAL_STRING,
}

CHAT_ANSWER = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "created": 1,
    "model": "m",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
}
CHAT_STREAM = (
    b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m",'
    b'"choices":[{"index":0,"delta":{"role":"assistant","content":"hi"},"finish_reason":null}]}\n\n'
    b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m",'
    b'"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
    b"data: [DONE]\n\n"
)
FUNCTION = {"type": "function", "name": "lookup", "parameters": {"type": "object", "properties": {}}}
HOSTED = {"type": "web_search"}


def check_resource(response: Mapping[str, Any]) -> None:
    for field, types in REQUIRED.items():
        assert field in response, f"{field} missing"
        value = response[field]
        assert isinstance(value, types) and not (isinstance(value, bool) and bool not in types), (field, value)
    assert isinstance(response["text"].get("format"), dict)
    for tool in response["tools"]:
        if tool["type"] == "function":
            assert {"name", "description", "parameters", "strict"} <= tool.keys(), tool
            assert isinstance(tool["strict"], bool)


def test_response_object_translated_answer_has_every_required_field() -> None:
    response = chat_to_responses_answer(CHAT_ANSWER, {"model": "m", "input": "hi"}, "m")
    check_resource(response)
    assert response["status"] == "completed" and isinstance(response["completed_at"], int)
    assert response["temperature"] == 1.0 and response["top_p"] == 1.0
    assert response["presence_penalty"] == 0.0 and response["frequency_penalty"] == 0.0
    assert response["text"] == {"format": {"type": "text"}} and response["service_tier"] == "default"


def test_response_object_every_streamed_lifecycle_event_has_every_required_field() -> None:
    stream = ChatToResponsesStream({"model": "m", "input": "hi", "stream": True}, "m")
    events = sse_events((stream.start() + stream.feed(CHAT_STREAM) + stream.close()).decode())
    lifecycle = [e for e in events if "response" in e]
    assert [e["type"] for e in lifecycle] == ["response.created", "response.in_progress", "response.completed"]
    for event in lifecycle:
        check_resource(event["response"])
    assert lifecycle[0]["response"]["completed_at"] is None
    assert isinstance(lifecycle[-1]["response"]["completed_at"], int)


@pytest.mark.parametrize("stream", [False, True])
def test_response_object_of_the_mock_writer_has_every_required_field(stream: bool) -> None:
    writer = answer_writer("responses", stream, "m", {"model": "m", "input": "hi"})
    raw = writer.start() + writer.delta("hi") + writer.finish(Usage(1, 1))
    events = sse_events(raw.decode()) if stream else [{"response": json.loads(raw)}]
    for response in (e["response"] for e in events if "response" in e):
        check_resource(response)


def test_response_object_echoes_the_settings_as_applied() -> None:
    request = {
        "model": "m",
        "input": "hi",
        "temperature": 0.3,
        "top_p": 0.9,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "safety_identifier": "user-7",
        "prompt_cache_key": "session-1",
        "text": {"verbosity": "low"},
        "service_tier": "flex",
        "tools": [FUNCTION, {**FUNCTION, "name": "strict_one", "strict": True, "description": "d"}, HOSTED],
    }
    response = chat_to_responses_answer(CHAT_ANSWER, request, "m")
    check_resource(response)
    assert (response["temperature"], response["top_p"]) == (0.3, 0.9)
    assert (response["presence_penalty"], response["frequency_penalty"]) == (0.5, -0.5)
    assert response["safety_identifier"] == "user-7" and response["prompt_cache_key"] == "session-1"
    assert response["text"] == {"verbosity": "low", "format": {"type": "text"}}
    assert response["service_tier"] == "default"  # iop has no tiers: what was applied, not what was asked
    # The hosted tool was dropped for the chat server, so it is not listed as served.
    assert [(t["name"], t["strict"], t["description"]) for t in response["tools"]] == [
        ("lookup", False, None),
        ("strict_one", True, "d"),
    ]
    # The penalties reach the chat server (they are applied, not only echoed).
    chat = responses_to_chat_request(request, "m")
    assert (chat["presence_penalty"], chat["frequency_penalty"]) == (0.5, -0.5)


def test_response_object_namespace_lists_only_its_served_tools() -> None:
    namespace = {"type": "namespace", "name": "mcp", "tools": [FUNCTION, HOSTED]}
    response = chat_to_responses_answer(CHAT_ANSWER, {"model": "m", "input": "hi", "tools": [namespace]}, "m")
    assert response["tools"] == [
        {"type": "namespace", "name": "mcp", "tools": [{**FUNCTION, "description": None, "strict": False}]}
    ]
