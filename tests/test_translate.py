"""translate.py: Responses ⇄ chat over recorded requests and answers, checked with the openai SDK's own models."""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionMessageFunctionToolCall
from openai.types.responses import FunctionTool, Response

from iop.errors import BadRequest, UpstreamError, error_response
from iop.openai.sse import SseDecoder, SseEvent
from iop.openai.translate import (
    ChatToResponsesStream,
    ResponsesToChatStream,
    chat_to_responses_answer,
    chat_to_responses_request,
    responses_to_chat_answer,
    responses_to_chat_request,
)
from tests.harness import responses_events, sdk_client, sse

DATA = Path(__file__).parent / "data" / "translate"


def load(name: str) -> Any:
    return json.loads((DATA / name).read_text())


def raw(name: str) -> bytes:
    return (DATA / name).read_bytes()


def feed_all(stream: ChatToResponsesStream | ResponsesToChatStream, pieces: Iterable[bytes]) -> bytes:
    out = b"".join(stream.feed(piece) for piece in pieces)
    return out + stream.close()


def pieces_of(data: bytes, cuts: Iterable[int]) -> list[bytes]:
    points = sorted({0, len(data), *(c for c in cuts if 0 <= c <= len(data))})
    return [data[a:b] for a, b in itertools.pairwise(points)]


def line_ends(data: bytes, end: bytes) -> bytes:
    return data.replace(b"\n", end)


# --- checking what clients receive ----------------------------------------------------------


def summary(items: Iterable[Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for item in items:
        item = item if isinstance(item, Mapping) else item.model_dump()
        if item["type"] == "message":
            out.append({"message": "".join(part["text"] for part in item["content"])})
        elif item["type"] == "reasoning":
            out.append({"reasoning": "".join(part["text"] for part in item["content"])})
        else:
            out.append({"call": [item["call_id"], item["name"], item["arguments"]]})
    return out


def responses_usage(usage: Any) -> list[int] | None:
    if usage is None:
        return None
    u = usage if isinstance(usage, Mapping) else usage.model_dump()
    details_in, details_out = u["input_tokens_details"], u["output_tokens_details"]
    return [
        u["input_tokens"],
        details_in["cached_tokens"],
        u["output_tokens"],
        details_out["reasoning_tokens"],
        u["total_tokens"],
    ]


def chat_stream(data: bytes) -> dict[str, Any]:
    """Every chunk validated as the SDK's ChatCompletionChunk, accumulated like a client does."""
    events = sse(data)
    result: dict[str, Any] = {"content": "", "reasoning": "", "tool_calls": [], "finish_reason": None}
    result.update(usage=None, error=None, done=False)
    calls: dict[int, list[str]] = {}
    for n, event in enumerate(events):
        assert not result["done"] and result["error"] is None, "nothing may follow [DONE] or an error"
        if event.data == "[DONE]":
            result["done"] = True
            continue
        body = json.loads(event.data)
        if "error" in body:
            result["error"] = [body["error"]["code"], body["error"]["message"]]
            continue
        chunk = ChatCompletionChunk.model_validate(body)
        if n == 0:
            assert chunk.choices[0].delta.role == "assistant"
        if chunk.usage is not None:
            u = chunk.usage
            cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0
            reasoning = u.completion_tokens_details.reasoning_tokens if u.completion_tokens_details else 0
            result["usage"] = [u.prompt_tokens, cached, u.completion_tokens, reasoning, u.total_tokens]
        for choice in chunk.choices:
            result["content"] += choice.delta.content or ""
            result["reasoning"] += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            for call in choice.delta.tool_calls or []:
                if call.id is not None:
                    assert call.index not in calls
                    calls[call.index] = [call.id, (call.function.name if call.function else None) or "", ""]
                calls[call.index][2] += (call.function.arguments if call.function else None) or ""
            result["finish_reason"] = choice.finish_reason or result["finish_reason"]
    result["tool_calls"] = [calls[i] for i in sorted(calls)]
    assert result["done"] != (result["error"] is not None), "a chat stream ends with [DONE] or an error"
    return result


# --- requests ---------------------------------------------------------------------------------

RESPONSES_REQUESTS = [
    "codex_first_turn.json",
    "codex_tool_round_trip.json",
    "responses_fields_to_chat.json",
    "responses_string_input_to_chat.json",
]


@pytest.mark.parametrize("name", RESPONSES_REQUESTS)
def test_translate_responses_request_to_chat(name: str) -> None:
    case = load(name)
    assert responses_to_chat_request(case["request"], case["model"], **case.get("options", {})) == case["expected"]


def test_translate_chat_request_to_responses() -> None:
    case = load("chat_client_request.json")
    assert chat_to_responses_request(case["request"], case["model"]) == case["expected"]


def test_translate_responses_request_drops_unknown_and_harmless_fields() -> None:
    request = {
        "input": "hi",
        "store": None,
        "include": ["reasoning.encrypted_content", "web_search_call.action.sources"],
        "truncation": "auto",
        "service_tier": "flex",
        "prompt_cache_retention": "24h",
        "context_management": [{"type": "compaction", "compact_threshold": 1000}],
        "a_field_from_the_future": {"x": 1},
        "tool_choice": "required",  # without tools it means nothing and chat servers reject it
        "parallel_tool_calls": True,
    }
    assert responses_to_chat_request(request, "m") == {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_translate_responses_request_allowed_tools_choice() -> None:
    request = {
        "input": "hi",
        "tools": [{"type": "function", "name": "a"}, {"type": "function", "name": "b"}],
        "tool_choice": {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "a"}]},
    }
    chat = responses_to_chat_request(request, "m")
    assert chat["tool_choice"] == {
        "type": "allowed_tools",
        "allowed_tools": {"mode": "required", "tools": [{"type": "function", "function": {"name": "a"}}]},
    }


def test_translate_responses_request_function_call_without_preceding_text_opens_an_assistant_turn() -> None:
    request = {
        "input": [
            {"role": "user", "content": "go"},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "ok"}]},
            {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{}"},
        ]
    }
    messages = responses_to_chat_request(request, "m")["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"]
    assert messages[1]["content"] is None and messages[1]["tool_calls"][0]["id"] == "c1"
    assert messages[2] == {"role": "tool", "tool_call_id": "c1", "content": "ok"}


REFUSED_RESPONSES = [
    ({"store": True}, "store", "store"),
    ({"previous_response_id": "resp_1"}, "previous_response_id", "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation", "conversation"),
    ({"conversation": {"id": "conv_1"}}, "conversation", "conversation"),
    ({"background": True}, "background", "background"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt", "prompt"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]", "item_reference"),
    (
        {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file-1"}]}]},
        "input[0].content[0]",
        "'input_file'",
    ),
    ({"text": {"format": {"type": "grammar"}}}, "text.format", "'grammar'"),
    ({"top_logprobs": 5}, "top_logprobs", "logprobs"),
    ({"include": ["message.output_text.logprobs"]}, "top_logprobs", "logprobs"),
]


@pytest.mark.parametrize(("fields", "param", "named"), REFUSED_RESPONSES)
def test_translate_responses_request_refuses_what_chat_cannot_serve(
    fields: dict[str, Any], param: str, named: str
) -> None:
    with pytest.raises(BadRequest) as caught:
        responses_to_chat_request({"input": "hi", **fields}, "m")
    error = caught.value
    assert (error.status, error.code, error.param) == (400, "unsupported_parameter", param)
    assert named in error.message
    assert json.loads(error_response(error).body)["error"]["param"] == param


REFUSED_CHAT = [
    ({"n": 2}, "n"),
    ({"store": True}, "store"),
    ({"stop": ["END"]}, "stop"),
    ({"logprobs": True}, "logprobs"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"logit_bias": {"50256": -100}}, "logit_bias"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools[0]"),
    ({"messages": [{"role": "function", "name": "f", "content": "x"}]}, "messages[0]"),
    (
        {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
        "messages[0].content[0]",
    ),
]


@pytest.mark.parametrize(("fields", "param"), REFUSED_CHAT)
def test_translate_chat_request_refuses_what_responses_cannot_serve(fields: dict[str, Any], param: str) -> None:
    request = {"messages": [{"role": "user", "content": "hi"}], **fields}
    with pytest.raises(BadRequest) as caught:
        chat_to_responses_request(request, "m")
    assert (caught.value.code, caught.value.param) == ("unsupported_parameter", param)


def test_translate_chat_request_keeps_later_system_messages_in_place() -> None:
    request = {
        "messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}],
        "max_tokens": 9,
        "response_format": {"type": "json_object"},
        "tool_choice": "none",
        "stop": None,
    }
    assert chat_to_responses_request(request, "m") == {
        "model": "m",
        "store": False,
        "input": [
            {"type": "message", "role": "user", "content": "a"},
            {"type": "message", "role": "system", "content": "b"},
        ],
        "tool_choice": "none",
        "max_output_tokens": 9,
        "text": {"format": {"type": "json_object"}},
    }


# --- whole answers ----------------------------------------------------------------------------

CHAT_TO_RESPONSES = load("chat_to_responses.json")
RESPONSES_TO_CHAT = load("responses_to_chat.json")


@pytest.mark.parametrize("case", CHAT_TO_RESPONSES["answers"], ids=lambda c: c["upstream"])
def test_translate_chat_answer_to_response(case: dict[str, Any]) -> None:
    body = chat_to_responses_answer(load(case["upstream"]), CHAT_TO_RESPONSES["request"], "qwen")
    response = Response.model_validate(body)
    assert response.status == case["status"] and response.model == "qwen"
    assert (response.incomplete_details.reason if response.incomplete_details else None) == case["reason"]
    assert summary(body["output"]) == case["output"]
    assert responses_usage(body["usage"]) == case["usage"]
    assert response.instructions == "You are Codex."
    assert isinstance(response.tools[0], FunctionTool) and response.tools[0].name == "shell"
    sdk = sdk_client(json.dumps(body).encode(), "application/json").responses.create(model="qwen", input="x")
    assert summary(sdk.output) == case["output"]


def test_translate_chat_answer_without_choices_is_an_upstream_error() -> None:
    with pytest.raises(UpstreamError):
        chat_to_responses_answer({"object": "chat.completion", "choices": []}, {}, "m")


@pytest.mark.parametrize("case", RESPONSES_TO_CHAT["answers"], ids=lambda c: c["upstream"])
def test_translate_response_answer_to_chat(case: dict[str, Any]) -> None:
    body = responses_to_chat_answer(load(case["upstream"]), "oss")
    completion = ChatCompletion.model_validate(body)
    choice = completion.choices[0]
    assert completion.model == "oss" and choice.finish_reason == case["finish_reason"]
    assert choice.message.content == case["content"]
    assert (choice.message.model_extra or {}).get("reasoning_content") == case["reasoning"]
    calls = []
    for c in choice.message.tool_calls or []:
        assert isinstance(c, ChatCompletionMessageFunctionToolCall)
        calls.append([c.id, c.function.name, c.function.arguments])
    assert calls == case["tool_calls"]
    u = completion.usage
    assert u is not None and u.prompt_tokens_details and u.completion_tokens_details
    usage = [u.prompt_tokens, u.prompt_tokens_details.cached_tokens, u.completion_tokens]
    assert [*usage, u.completion_tokens_details.reasoning_tokens, u.total_tokens] == case["usage"]


@pytest.mark.parametrize(
    ("status", "details", "finish_reason"),
    [
        ("incomplete", {"reason": "max_output_tokens"}, "length"),
        ("incomplete", {"reason": "content_filter"}, "content_filter"),
    ],
)
def test_translate_incomplete_response_to_chat_finish_reason(status: str, details: Any, finish_reason: str) -> None:
    body = {"status": status, "incomplete_details": details, "output": [], "created_at": 1}
    completion = ChatCompletion.model_validate(responses_to_chat_answer(body, "m"))
    assert completion.choices[0].finish_reason == finish_reason and completion.choices[0].message.content == ""


@pytest.mark.parametrize("status", ["failed", "in_progress", None])
def test_translate_unfinished_response_is_an_upstream_error(status: str | None) -> None:
    with pytest.raises(UpstreamError, match="upstream"):
        responses_to_chat_answer({"status": status, "error": {"code": "server_error", "message": "boom"}}, "m")


def test_translate_chat_content_filter_is_incomplete() -> None:
    body = {
        "choices": [{"index": 0, "message": {"role": "assistant", "content": ""}, "finish_reason": "content_filter"}]
    }
    response = Response.model_validate(chat_to_responses_answer(body, {}, "m"))
    assert response.status == "incomplete" and response.incomplete_details is not None
    assert response.incomplete_details.reason == "content_filter" and response.usage is None


# --- streams: chat upstream, Responses client -------------------------------------------------

SPLITS: dict[str, Callable[[bytes], list[bytes]]] = {
    "whole": lambda data: [data],
    "bytes": lambda data: [data[i : i + 1] for i in range(len(data))],
    "sevens": lambda data: [data[i : i + 7] for i in range(0, len(data), 7)],
}


def check_chat_to_responses(case: dict[str, Any], data: bytes, pieces: list[bytes]) -> None:
    stream = ChatToResponsesStream(CHAT_TO_RESPONSES["request"], "qwen")
    out = feed_all(stream, pieces)
    events = responses_events(out)
    assert [e.type.removeprefix("response.") for e in events] == case["events"]
    final = events[-1].response
    assert final.status == case["status"] and final.id == events[0].response.id
    assert summary(final.output) == case["output"]
    assert responses_usage(final.usage) == case["usage"]
    if case["status"] == "failed":
        error = json.loads(sse(out)[-1].data)["response"]["error"]
        assert [error["code"], error["message"]] == case["error"]
    else:
        assert (final.incomplete_details.reason if final.incomplete_details else None) == case["reason"]
        assert stream.usage is not None
    # Every delta adds up to its item's final text.
    deltas: dict[str, str] = {}
    for e in events:
        if e.type in (
            "response.output_text.delta",
            "response.reasoning_text.delta",
            "response.function_call_arguments.delta",
        ):
            deltas[e.item_id] = deltas.get(e.item_id, "") + e.delta
    for item in final.output:
        text = item.arguments if item.type == "function_call" else "".join(p.text for p in item.content or [])
        assert deltas.get(item.id, "") == text


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("end", [b"\n", b"\r\n", b"\r"], ids=["lf", "crlf", "cr"])
@pytest.mark.parametrize("case", CHAT_TO_RESPONSES["streams"], ids=lambda c: c["upstream"])
def test_translate_chat_stream_to_responses(case: dict[str, Any], end: bytes, split: str) -> None:
    data = line_ends(raw(case["upstream"]), end)
    check_chat_to_responses(case, data, SPLITS[split](data))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cuts=st.lists(st.integers(min_value=0, max_value=4000), max_size=40), crlf=st.booleans())
def test_translate_chat_stream_any_split_gives_the_same_answer(cuts: list[int], crlf: bool) -> None:
    for case in CHAT_TO_RESPONSES["streams"][:2]:
        data = line_ends(raw(case["upstream"]), b"\r\n" if crlf else b"\n")
        check_chat_to_responses(case, data, pieces_of(data, cuts))


def test_translate_chat_stream_sdk_accumulates_the_response() -> None:
    stream = ChatToResponsesStream(CHAT_TO_RESPONSES["request"], "qwen")
    body = feed_all(stream, [raw("vllm_reasoning_tool_calls.sse")])
    client = sdk_client(body, "text/event-stream")
    with client.responses.stream(model="qwen", input="x") as events:
        final = events.get_final_response()
    assert summary(final.output) == CHAT_TO_RESPONSES["streams"][0]["output"]
    assert final.usage is not None and final.usage.total_tokens == 1610


def test_translate_chat_stream_failure_reaches_the_sdk() -> None:
    body = feed_all(ChatToResponsesStream({}, "qwen"), [raw("vllm_error.sse")])
    client = sdk_client(body, "text/event-stream")
    types = [e.type for e in client.responses.create(model="qwen", input="x", stream=True)]
    assert types[-1] == "response.failed"


def test_translate_chat_stream_start_before_the_upstream_speaks() -> None:
    stream = ChatToResponsesStream({}, "m")
    opening = stream.start()
    assert [e.type for e in responses_events(opening)] == ["response.created", "response.in_progress"]
    rest = stream.feed(b"data: [DONE]\n\n")
    events = responses_events(opening + rest)
    assert events[-1].type == "response.completed" and events[-1].response.output_text == ""
    assert stream.ended and stream.feed(b"data: {}\n\n") == b"" and stream.close() == b""


def test_translate_chat_stream_explicit_fail_keeps_partial_output() -> None:
    stream = ChatToResponsesStream({}, "m")
    data = stream.feed(b'data: {"choices":[{"index":0,"delta":{"content":"par"}}]}\n\n')
    data += stream.fail("upstream timed out mid-answer", "upstream_timeout")
    events = responses_events(data)
    assert events[-1].type == "response.failed" and events[-1].response.output_text == "par"
    assert events[-1].response.error.code == "server_error"
    assert stream.fail("again", "x") == b""


@pytest.mark.parametrize("bad", [b"data: {not json\n\n", b"data: [1, 2]\n\n", b'data: {"error": "overloaded"}\n\n'])
def test_translate_chat_stream_garbage_fails_the_response(bad: bytes) -> None:
    stream = ChatToResponsesStream({}, "m")
    events = responses_events(stream.feed(bad) + stream.close())
    assert events[-1].type == "response.failed"


def test_translate_chat_stream_tool_call_whose_name_comes_late() -> None:
    chunks = [
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"a"'}}]}}]},
        {
            "choices": [
                {"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"name": "f", "arguments": ":1}"}}]}}
            ]
        },
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
    ]
    data = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
    events = responses_events(feed_all(ChatToResponsesStream({}, "m"), [data]))
    [call] = events[-1].response.output
    assert call.type == "function_call" and (call.name, call.arguments) == ("f", '{"a":1}')
    assert call.call_id.startswith("call_")


# --- streams: Responses upstream, chat client -------------------------------------------------


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("case", RESPONSES_TO_CHAT["streams"], ids=lambda c: c["upstream"])
def test_translate_responses_stream_to_chat(case: dict[str, Any], split: str) -> None:
    data = raw(case["upstream"])
    stream = ResponsesToChatStream(RESPONSES_TO_CHAT["request"], "oss")
    result = chat_stream(feed_all(stream, SPLITS[split](data)))
    for key in ("content", "reasoning", "tool_calls", "finish_reason", "usage", "error"):
        assert result[key] == case[key], key


@settings(max_examples=40, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=9000), max_size=40))
def test_translate_responses_stream_any_split_gives_the_same_answer(cuts: list[int]) -> None:
    case = RESPONSES_TO_CHAT["streams"][0]
    data = line_ends(raw(case["upstream"]), b"\r\n")
    result = chat_stream(feed_all(ResponsesToChatStream(RESPONSES_TO_CHAT["request"], "oss"), pieces_of(data, cuts)))
    assert [result["content"], result["tool_calls"], result["usage"]] == [
        case["content"],
        case["tool_calls"],
        case["usage"],
    ]


def test_translate_responses_stream_sdk_accumulates_the_completion() -> None:
    body = feed_all(ResponsesToChatStream(RESPONSES_TO_CHAT["request"], "oss"), [raw("responses_tool_call.sse")])
    client = sdk_client(body, "text/event-stream")
    with client.chat.completions.stream(model="oss", messages=[{"role": "user", "content": "x"}]) as stream:
        final = stream.get_final_completion()
    message = final.choices[0].message
    assert message.content == "Checking Paris — one moment." and final.choices[0].finish_reason == "tool_calls"
    assert [(c.id, c.function.name) for c in message.tool_calls or []] == [("call_Qm4", "get_weather")]
    failed = feed_all(ResponsesToChatStream({}, "oss"), [raw("responses_failed.sse")])
    with pytest.raises(openai.APIError, match="The model crashed"):
        list(sdk_client(failed, "text/event-stream").chat.completions.create(model="oss", messages=[], stream=True))


def test_translate_responses_stream_without_include_usage_has_no_usage_chunk() -> None:
    result = chat_stream(feed_all(ResponsesToChatStream({}, "oss"), [raw("responses_tool_call.sse")]))
    assert result["usage"] is None and result["done"]


@pytest.mark.parametrize("cut", [0, 400, 2000])
def test_translate_responses_stream_cut_short_is_an_error(cut: int) -> None:
    stream = ResponsesToChatStream({}, "oss")
    result = chat_stream(feed_all(stream, [raw("responses_tool_call.sse")[:cut]]))
    assert result["error"] == ["upstream_error", "upstream stream ended before the response finished"]


def test_translate_responses_stream_error_event_is_an_error() -> None:
    error = {"type": "error", "code": "rate_limit_exceeded", "message": "slow down", "sequence_number": 0}
    data = b"event: error\ndata: " + json.dumps(error).encode() + b"\n\n"
    result = chat_stream(feed_all(ResponsesToChatStream({}, "oss"), [data]))
    assert result["error"] == ["rate_limit_exceeded", "upstream: slow down"]


# --- Codex CLI, one tool round trip on a chat-only server -------------------------------------


def test_translate_codex_tool_round_trip() -> None:
    """Codex asks, the model calls a function, Codex runs it and sends the output back, the model answers."""
    first = load("codex_first_turn.json")
    model = first["model"]
    chat = responses_to_chat_request(first["request"], model)
    assert chat["stream"] is True and chat["stream_options"] == {"include_usage": True}
    events = responses_events(
        feed_all(ChatToResponsesStream(first["request"], "qwen3-coder"), [raw("vllm_reasoning_tool_calls.sse")])
    )
    # Codex keeps each output_item.done item and replays it, with the tools' outputs, as the next input.
    done = [e.item.model_dump(exclude_none=True) for e in events if e.type == "response.output_item.done"]
    outputs = [
        {"type": "function_call_output", "call_id": item["call_id"], "output": "42\n"}
        for item in done
        if item["type"] == "function_call"
    ]
    second = {**first["request"], "input": [*first["request"]["input"], *done, *outputs]}
    messages = responses_to_chat_request(second, model)["messages"]
    assistant = messages[-3]
    assert assistant["role"] == "assistant" and assistant["content"] is None
    assert [c["id"] for c in assistant["tool_calls"]] == ["chatcmpl-tool-9f2e4b", "chatcmpl-tool-77aa01"]
    assert [m["tool_call_id"] for m in messages[-2:]] == ["chatcmpl-tool-9f2e4b", "chatcmpl-tool-77aa01"]
    answer = responses_events(feed_all(ChatToResponsesStream(second, "qwen3-coder"), [raw("llamacpp_answer.sse")]))
    assert answer[-1].type == "response.completed"
    assert answer[-1].response.output_text == "There are 42 Python files and 7 test files — all ✓"


# --- the SSE decoder --------------------------------------------------------------------------


def decode(pieces: list[bytes]) -> list[SseEvent]:
    decoder = SseDecoder()
    events = [e for piece in pieces for e in decoder.feed(piece)]
    return events + decoder.finish()


def test_translate_sse_decoder_reads_fields_comments_and_line_ends() -> None:
    data = b": hello\r\nevent: a\r\ndata: 1\r\ndata:2\r\nid: 9\r\n\r\ndata: x\rdata: y\r\rdata: last"
    expected = [SseEvent("a", b"1\n2"), SseEvent(None, b"x\ny"), SseEvent(None, b"last")]
    assert decode([data]) == expected
    assert decode([data[i : i + 1] for i in range(len(data))]) == expected


def test_translate_sse_decoder_crlf_split_between_cr_and_lf() -> None:
    assert decode([b"data: a\r", b"\ndata: b\r", b"\n\r", b"\n"]) == [SseEvent(None, b"a\nb")]


def test_translate_sse_decoder_keeps_multibyte_text_split_mid_character() -> None:
    data = 'data: {"t": "✓ ü"}\n\n'.encode()
    assert decode([data[:12], data[12:14], data[14:]]) == [SseEvent(None, '{"t": "✓ ü"}'.encode())]


def _events_line_by_line(data: bytes) -> list[tuple[str | None, bytes]]:
    """The events of `data` by the SSE rules, read one whole line at a time (the reference)."""
    out: list[tuple[str | None, bytes]] = []
    event: str | None = None
    lines: list[bytes] = []
    for line in [*re.split(rb"\r\n|\r|\n", data), b""]:
        if not line:
            if lines:
                out.append((event, b"\n".join(lines)))
            event, lines = None, []
        elif not line.startswith(b":"):
            name, _, value = line.partition(b":")
            value = value[1:] if value[:1] == b" " else value
            if name == b"data":
                lines.append(value)
            elif name == b"event":
                event = value.decode(errors="replace")
    return out


SSE_ALPHABET = [
    b"data: ",
    b"data:",
    b"event: ",
    b": ping",
    b"id: 3",
    b"x",
    b"{}",
    b"\xc3\xa9",
    b"\n",
    b"\r\n",
    b"\r",
    b" ",
]


@settings(max_examples=300, deadline=None)
@given(
    parts=st.lists(st.sampled_from(SSE_ALPHABET), max_size=60),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=12),
)
def test_sse_decoder_reads_any_stream_split_anywhere_as_the_line_rules_do(parts: list[bytes], cuts: list[int]) -> None:
    data = b"".join(parts)
    decoder = SseDecoder()
    got: list[tuple[str | None, bytes]] = []
    for piece in pieces_of(data, cuts):
        got += [(e.event, e.data) for e in decoder.feed(piece)]
    got += [(e.event, e.data) for e in decoder.finish()]
    assert got == _events_line_by_line(data)
