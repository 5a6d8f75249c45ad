"""Messages ⇄ chat translation (iop/anthropic/): requests, whole answers, streams, errors, the estimate."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from iop.anthropic.answer import chat_to_messages_answer
from iop.anthropic.count import estimate_input_tokens
from iop.anthropic.errors import error_body, error_type
from iop.anthropic.request import messages_to_chat_request
from iop.anthropic.stream import ChatToMessagesStream
from iop.errors import BadRequest, QueueFull, UpstreamError

# The shape Claude Code 2.1 sends (docs/anthropic-compat.md): system blocks with cache_control, a
# system turn inside `messages`, tool_use answered by a tool_result, thinking/context settings.
CLAUDE_CODE_TURN: dict[str, Any] = {
    "model": "claude-opus-5-5",
    "max_tokens": 32000,
    "stream": True,
    "metadata": {"user_id": '{"device_id":"d","session_id":"s"}'},
    "thinking": {"type": "adaptive", "display": "omitted"},
    "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    "output_config": {"effort": "medium"},
    "system": [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.328.c5e; cc_entrypoint=sdk-cli;"},
        {"type": "text", "text": "You are an agent.", "cache_control": {"type": "ephemeral"}},
    ],
    "messages": [
        {
            "role": "user",
            "content": [{"type": "text", "text": "<reminder>"}, {"type": "text", "text": "run echo hello"}],
        },
        {"role": "system", "content": "# Environment\n - Platform: linux"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "I should run it.", "signature": "sig"},
                {"type": "text", "text": "Running it."},
                {"type": "tool_use", "id": "toolu_01", "name": "Bash", "input": {"command": "echo hello"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_01",
                    "content": "hello",
                    "is_error": False,
                    "cache_control": {"type": "ephemeral"},
                },
                {"type": "text", "text": "and now?"},
            ],
        },
    ],
    "tools": [
        {
            "name": "Bash",
            "description": "Run a command",
            "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}},
        },
        {"type": "web_search_20250305", "name": "web_search", "max_uses": 3},
    ],
    "tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
    "stop_sequences": ["\n\nHuman:"],
    "temperature": 0.2,
}


def test_messages_request_maps_claude_codes_turn_to_chat() -> None:
    chat = messages_to_chat_request(CLAUDE_CODE_TURN, "qwen-coder")
    body = chat.body
    assert body["model"] == "qwen-coder"
    assert body["max_tokens"] == 32000
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["stop"] == ["\n\nHuman:"] and body["temperature"] == 0.2
    assert body["tool_choice"] == "auto" and body["parallel_tool_calls"] is False
    roles = [m["role"] for m in body["messages"]]
    assert roles == ["system", "user", "system", "assistant", "tool", "user"]
    assert body["messages"][0]["content"] == "You are an agent."  # the billing line is Anthropic's only
    assert body["messages"][1]["content"] == "<reminder>\nrun echo hello"
    assistant = body["messages"][3]
    assert assistant["content"] == "Running it."  # the thinking block is not sent back
    assert assistant["tool_calls"] == [
        {"id": "toolu_01", "type": "function", "function": {"name": "Bash", "arguments": '{"command":"echo hello"}'}}
    ]
    assert body["messages"][4] == {"role": "tool", "tool_call_id": "toolu_01", "content": "hello"}
    assert body["messages"][5] == {"role": "user", "content": "and now?"}
    assert [t["function"]["name"] for t in body["tools"]] == ["Bash"]
    assert chat.dropped_tools == ["web_search_20250305"]
    for dropped in ("metadata", "thinking", "context_management", "output_config", "system"):
        assert dropped not in body


def test_messages_request_images_and_errors_in_tool_results() -> None:
    request = {
        "model": "m",
        "max_tokens": 10,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}},
                    {"type": "text", "text": "what is this?"},
                ],
            },
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "t1",
                        "is_error": True,
                        "content": [{"type": "text", "text": "boom"}],
                    }
                ],
            },
        ],
        "tool_choice": {"type": "tool", "name": "f"},
        "tools": [{"name": "f", "input_schema": {"type": "object"}}],
    }
    body = messages_to_chat_request(request).body
    assert body["messages"][0]["content"] == [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "text", "text": "what is this?"},
    ]
    assert body["messages"][2] == {"role": "tool", "tool_call_id": "t1", "content": "Error: boom"}
    assert body["tool_choice"] == {"type": "function", "function": {"name": "f"}}


@pytest.mark.parametrize(
    ("request_body", "param"),
    [
        ({"model": "m", "max_tokens": 5, "messages": []}, "messages"),
        ({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
        ({"model": "m", "max_tokens": 5, "messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
        (
            {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "video"}]}]},
            "messages[0].content[0]",
        ),
        (
            {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [{"text": "no type"}]}]},
            "messages[0].content[0]",
        ),
        (
            {
                "model": "m",
                "max_tokens": 5,
                "messages": [{"role": "user", "content": "x"}],
                "tools": [{"name": "f"}],
                "tool_choice": {"type": "sometimes"},
            },
            "tool_choice.type",
        ),
    ],
)
def test_messages_request_refuses_malformed_input_naming_its_path(request_body: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as caught:
        messages_to_chat_request(request_body)
    assert caught.value.param == param


def _chat_answer(message: dict[str, Any], finish: str, **choice: Any) -> bytes:
    usage = {"prompt_tokens": 100, "completion_tokens": 7, "prompt_tokens_details": {"cached_tokens": 60}}
    return json.dumps(
        {"choices": [{"index": 0, "message": message, "finish_reason": finish, **choice}], "usage": usage}
    ).encode()


def test_whole_answer_with_reasoning_text_and_a_call() -> None:
    body = _chat_answer(
        {
            "role": "assistant",
            "reasoning_content": "hmm",
            "content": "Let me look.",
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "Read", "arguments": '{"path": "a"}'}}
            ],
        },
        "tool_calls",
    )
    answer = chat_to_messages_answer(body, "alias")
    assert answer["type"] == "message" and answer["role"] == "assistant" and answer["model"] == "alias"
    assert answer["id"].startswith("msg_")
    assert answer["content"] == [
        {"type": "thinking", "thinking": "hmm", "signature": ""},
        {"type": "text", "text": "Let me look."},
        {"type": "tool_use", "id": "call_1", "name": "Read", "input": {"path": "a"}},
    ]
    assert answer["stop_reason"] == "tool_use" and answer["stop_sequence"] is None
    assert answer["usage"] == {
        "input_tokens": 40,
        "output_tokens": 7,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 60,
    }


@pytest.mark.parametrize(
    ("finish", "extra", "reason", "sequence"),
    [
        ("stop", {}, "end_turn", None),
        ("length", {}, "max_tokens", None),
        ("stop", {"stop_reason": "END"}, "stop_sequence", "END"),
        ("content_filter", {}, "refusal", None),
    ],
)
def test_whole_answer_stop_reasons(finish: str, extra: dict[str, Any], reason: str, sequence: str | None) -> None:
    answer = chat_to_messages_answer(_chat_answer({"role": "assistant", "content": "x"}, finish, **extra), "m")
    assert (answer["stop_reason"], answer["stop_sequence"]) == (reason, sequence)


def test_whole_answer_that_is_not_an_answer_is_an_upstream_error() -> None:
    for body in (b"not json", b"[]", b'{"choices": []}'):
        with pytest.raises(UpstreamError):
            chat_to_messages_answer(body, "m")


def _events(data: bytes) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for frame in data.decode().split("\n\n"):
        if frame.strip():
            name, payload = frame.split("\n", 1)
            assert name.startswith("event: ") and payload.startswith("data: ")
            event = json.loads(payload[len("data: ") :])
            assert event["type"] == name[len("event: ") :]
            out.append((event["type"], event))
    return out


def _chat_sse(*chunks: dict[str, Any]) -> bytes:
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


STREAM = _chat_sse(
    {"choices": [{"index": 0, "delta": {"role": "assistant", "reasoning_content": "thin"}}]},
    {"choices": [{"index": 0, "delta": {"reasoning_content": "king"}}]},
    {"choices": [{"index": 0, "delta": {"content": "Hel"}}]},
    {"choices": [{"index": 0, "delta": {"content": "lo"}}]},
    {
        "choices": [
            {
                "index": 0,
                "delta": {"tool_calls": [{"index": 0, "id": "call_a", "function": {"name": "Bash", "arguments": ""}}]},
            }
        ]
    },
    {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"command"'}}]}}]},
    {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": ': "ls"}'}}]}}]},
    {
        "choices": [
            {
                "index": 0,
                "delta": {
                    "tool_calls": [{"index": 1, "id": "call_b", "function": {"name": "Read", "arguments": "{}"}}]
                },
            }
        ]
    },
    {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
    {"choices": [], "usage": {"prompt_tokens": 50, "completion_tokens": 9}},
)


def test_stream_is_anthropics_event_sequence() -> None:
    stream = ChatToMessagesStream("alias")
    events = _events(stream.feed(STREAM))
    names = [n for n, _ in events]
    assert names == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert stream.ended
    starts = [e["content_block"] for n, e in events if n == "content_block_start"]
    assert [b["type"] for b in starts] == ["thinking", "text", "tool_use", "tool_use"]
    assert starts[2] == {"type": "tool_use", "id": "call_a", "name": "Bash", "input": {}}
    indexes = [e["index"] for n, e in events if n.startswith("content_block")]
    assert indexes == sorted(indexes) and indexes[-1] == 3
    partial = "".join(
        e["delta"]["partial_json"]
        for n, e in events
        if n == "content_block_delta" and e["delta"]["type"] == "input_json_delta" and e["index"] == 2
    )
    assert json.loads(partial) == {"command": "ls"}
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 9 and delta["usage"]["input_tokens"] == 50


@given(st.lists(st.integers(min_value=1, max_value=len(STREAM) - 1), max_size=30))
def test_stream_is_the_same_however_the_bytes_are_split(cuts: list[int]) -> None:
    whole = ChatToMessagesStream("m")
    expected = [(n, {k: v for k, v in e.items() if k != "message"}) for n, e in _events(whole.feed(STREAM))]
    stream = ChatToMessagesStream("m")
    out = b""
    bounds = [0, *sorted(set(cuts)), len(STREAM)]
    for a, b in itertools.pairwise(bounds):
        out += stream.feed(STREAM[a:b])
    out += stream.close()
    got = [(n, {k: v for k, v in e.items() if k != "message"}) for n, e in _events(out)]
    assert got == expected


def test_stream_cut_short_or_failing_ends_with_an_error_event() -> None:
    stream = ChatToMessagesStream("m")
    out = stream.feed(b'data: {"choices":[{"index":0,"delta":{"content":"Hi"}}]}\n\n') + stream.close()
    names = [n for n, _ in _events(out)]
    assert names[-1] == "error" and "message_stop" not in names
    failing = ChatToMessagesStream("m")
    events = _events(failing.feed(b'data: {"error": {"message": "model crashed"}}\n\n'))
    assert events[-1][1]["error"] == {"type": "api_error", "message": "upstream: model crashed"}
    assert failing.close() == b""


def test_errors_in_anthropics_shape() -> None:
    assert error_type(400) == "invalid_request_error" and error_type(429) == "rate_limit_error"
    assert (
        error_type(503) == "overloaded_error"
        and error_type(502) == "api_error"
        and error_type(418) == "invalid_request_error"
    )
    body = error_body(QueueFull("the pool's queue is full"), "req_1")
    assert body == {
        "type": "error",
        "error": {"type": error_type(QueueFull.status), "message": "the pool's queue is full"},
        "request_id": "req_1",
    }


def test_count_estimate_grows_with_the_prompt_and_counts_tools() -> None:
    small = messages_to_chat_request(
        {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    ).body
    big = dict(small, messages=[{"role": "user", "content": "word " * 400}])
    with_tools = dict(small, tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])
    assert estimate_input_tokens(small) == 1 + 4
    assert estimate_input_tokens(big) == 500 + 4
    assert estimate_input_tokens(with_tools) > estimate_input_tokens(small)
