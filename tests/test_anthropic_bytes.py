"""The Messages → chat translation on a body's bytes (`chat_body_of`): the decoded translation's
chat body exactly, its texts kept as the client's JSON; anything it does not take goes decoded."""

from __future__ import annotations

import copy
import json
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from iop.anthropic.request import chat_body_of, messages_to_chat_request
from iop.errors import BadRequest
from tests.test_anthropic_translate import CLAUDE_CODE_TURN


def _both(request: Any, model: str | None = "m") -> None:
    body = json.dumps(request, ensure_ascii=False).encode()  # with spaces: the client's bytes, not msgspec's
    got, dropped = chat_body_of(body, model)
    want = messages_to_chat_request(copy.deepcopy(request), model)
    assert msgspec.json.decode(got) == want.body
    assert dropped == want.dropped_tools


def test_claude_codes_turn_is_the_decoded_translation() -> None:
    _both(CLAUDE_CODE_TURN)
    _both(CLAUDE_CODE_TURN, None)


def test_texts_with_escapes_joins_errors_images_and_documents() -> None:
    request = {
        "model": "m",
        "max_tokens": 5,
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: a"},
            {"type": "text", "text": "\\u0078-anthropic-billing-header: escaped"},  # a text, not an escape
            {"type": "text", "text": 'quotes " and \\ and\nlines \u00e9\U0001f600'},
        ],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "a\tb"}, {"type": "text", "text": ""}]},
            {"role": "system", "content": [{"type": "text", "text": "s1"}, {"type": "text", "text": "s2"}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "one "},
                    {"type": "redacted_thinking", "data": "x"},
                    {"type": "text", "text": "two"},
                    {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": [1, 2.5, None, "é"]}},
                    {"type": "tool_use", "id": "t2", "name": "g"},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "is_error": True, "content": "boom"},
                    {"type": "tool_result", "tool_use_id": "t2", "is_error": True},
                    {"type": "tool_result", "tool_use_id": "t3", "content": []},
                    {
                        "type": "tool_result",
                        "tool_use_id": "t4",
                        "content": [{"type": "text", "text": "x"}, {"type": "image", "source": {}}],
                    },
                    {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "doc"}},
                    {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}},
                ],
            },
            {"role": "assistant", "content": []},
            {"role": "user", "content": "go"},
        ],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}, {"type": "bash_20250124", "name": "bash"}],
        "tool_choice": {"type": "tool", "name": "f"},
        "stream": True,
        "top_k": 3,
    }
    _both(request)
    only_billing = {**request, "system": [{"type": "text", "text": "x-anthropic-billing-header: a"}]}
    _both(only_billing)
    _both({**request, "system": "plain"})


@pytest.mark.parametrize(
    "change",
    [
        {"messages": []},
        {"messages": "no"},
        {"messages": [{"role": "tool", "content": "x"}]},
        {"messages": [{"role": "user", "content": [{"type": "video"}]}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]},
        {"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]},
        {"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": 1}]}]},
        {"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "file"}}]}]},
        {"messages": [{"role": "user", "content": 7}]},
        {"system": [{"type": "image"}]},
        {"max_tokens": 0},
        {"tools": "x"},
    ],
)
def test_what_the_decoded_translation_refuses_is_refused_the_same(change: dict[str, Any]) -> None:
    request = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], **change}
    with pytest.raises(BadRequest) as want:
        messages_to_chat_request(request)
    with pytest.raises(BadRequest) as got:
        chat_body_of(json.dumps(request).encode())
    assert (got.value.message, got.value.param) == (want.value.message, want.value.param)


_text = st.text(max_size=12)
_block = st.one_of(
    st.builds(lambda t: {"type": "text", "text": t}, _text),
    st.builds(lambda i, n: {"type": "tool_use", "id": i, "name": n, "input": {"k": n}}, _text, _text),
    st.builds(
        lambda i, c, e: {"type": "tool_result", "tool_use_id": i, "content": c, "is_error": e},
        _text,
        st.one_of(st.none(), _text, st.lists(st.builds(lambda t: {"type": "text", "text": t}, _text), max_size=3)),
        st.booleans(),
    ),
    st.just({"type": "thinking", "thinking": "t", "signature": "s"}),
)
_turn = st.builds(
    lambda role, content: {"role": role, "content": content},
    st.sampled_from(["user", "assistant", "system", "tool"]),
    st.one_of(_text, st.lists(_block, max_size=4)),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_turn, min_size=1, max_size=5), st.one_of(st.none(), _text, st.lists(_block, max_size=2)))
def test_any_request_translates_as_decoded_or_is_refused_alike(turns: list[Any], system: Any) -> None:
    request: dict[str, Any] = {"model": "m", "max_tokens": 5, "messages": turns}
    if system is not None:
        request["system"] = system
    try:
        want = messages_to_chat_request(copy.deepcopy(request))
    except BadRequest as exc:
        with pytest.raises(BadRequest) as got:
            chat_body_of(json.dumps(request).encode())
        assert got.value.message == exc.message
        return
    got_body, _ = chat_body_of(json.dumps(request).encode())
    assert msgspec.json.decode(got_body) == want.body
