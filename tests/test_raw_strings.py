"""A Responses request translated with its long texts left raw is the chat request a full decode gives."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from iop.nats.server import EmbeddedNats
from iop.openai.raw_strings import LONG, Placeholders
from iop.openai.responses_request import responses_to_chat_request
from iop.openai.tool_names import ToolMap
from tests.fakes import fake_upstream
from tests.harness import deployment, deployment_running
from tests.test_usage_chunk import one_provider

TEXT = 'caf\u00e9 "quoted" \\ back\\slash\n\ttab \u2713 \U0001f600 ' * (LONG // 16)
"""Long, with every escape JSON has and characters of one to four UTF-8 bytes."""


def turn(text: str) -> dict[str, Any]:
    return {
        "model": "alias",
        "instructions": "Be brief. " + text,
        "tools": [{"type": "function", "name": "read", "parameters": {"type": "object", "properties": {}}}],
        "input": [
            {"type": "message", "role": "developer", "content": text},
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": text}, {"type": "input_text", "text": "short"}],
            },
            {
                "type": "reasoning",
                "summary": [{"type": "summary_text", "text": text}],
                "content": [{"type": "reasoning_text", "text": text}],
            },
            {"type": "function_call", "call_id": "c1", "name": "read", "arguments": json.dumps({"path": text})},
            {"type": "function_call_output", "call_id": "c1", "output": text},
            {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": text}]},
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_image", "image_url": "data:image/png;base64," + "A" * LONG}],
            },
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]},
            {"type": "message", "role": "user", "content": "Go on."},
        ],
        "stream": True,
        "store": False,
    }


@pytest.mark.parametrize("vision", [False, True])
@pytest.mark.parametrize("text", [TEXT, "short"])
def test_placeholders_translate_to_the_same_chat_request_as_a_full_decode(text: str, vision: bool) -> None:
    body = json.dumps(turn(text), ensure_ascii=False).encode()
    expected = responses_to_chat_request(json.loads(body), "m", vision=vision, replay_reasoning=True)
    held = Placeholders()
    request = held.decode(body)
    assert len(held.raw) == (8 if text == TEXT else 1)  # the image URL is long either way; summaries decode
    out = held.encode(
        responses_to_chat_request(request, "m", tools=ToolMap.of(request), vision=vision, replay_reasoning=True)
    )
    assert out is not None
    assert json.loads(b"".join(out)) == expected
    # The long texts are sent as views of the client's body, not copied into one buffer with the rest.
    views = [p for p in out if isinstance(p, memoryview) and isinstance(p.obj, msgspec.Raw)]
    assert len(views) == len(out) // 2 and (len(views) >= 7 if text == TEXT else True)
    # The texts went through as the client's bytes, never built as strings.
    assert request["input"][0]["content"].startswith("\x00iop-raw-") == (text == TEXT)


@pytest.mark.parametrize(
    "extra",
    [
        {},  # the request's known fields alone: read in one pass
        {"x_vendor_field": {"a": [1, 2]}, "seed": 7},  # a field not known here: the request split field by field
    ],
)
def test_placeholders_keep_fields_outside_input_and_short_strings_decoded(extra: dict[str, Any]) -> None:
    body = json.dumps({**turn(TEXT), **extra}).encode()
    request = Placeholders().decode(body)
    full = json.loads(body)
    assert set(request) == set(full)
    assert {k: v for k, v in request.items() if k != "input"} == {k: v for k, v in full.items() if k != "input"}
    assert request["input"][-1] == full["input"][-1]


@pytest.mark.parametrize(
    "given", ["just text", [{"type": "message", "role": "user", "content": "x"}, "not an item"], None]
)
def test_an_input_that_is_not_a_list_of_items_decodes_as_a_full_decode_gives_it(given: Any) -> None:
    body = json.dumps({"model": "m", "input": given}).encode()
    assert Placeholders().decode(body) == json.loads(body)


def test_a_placeholder_changed_on_the_way_is_not_spliced() -> None:
    body = json.dumps(turn(TEXT)).encode()
    held = Placeholders()
    request = held.decode(body)
    # Escaped once more (as json.dumps would), cut, or transformed: the caller must fall back.
    assert held.encode({"x": json.dumps(request["input"][0]["content"])}) is None
    assert held.encode({"x": request["input"][0]["content"][:12]}) is None
    assert held.encode({"x": request["input"][0]["content"].upper()}) is None


def test_placeholders_refuse_what_a_full_decode_refuses() -> None:
    for body in (b'{"input": [', b"[1]", b'{"input": [{"type": "message", "content": "x"}'):
        with pytest.raises(msgspec.DecodeError):
            Placeholders().decode(body)


async def test_a_responses_turn_reaches_a_chat_upstream_with_its_texts_intact(nats_server: EmbeddedNats) -> None:
    request = {**turn(TEXT), "model": "m", "stream": False}
    async with (
        fake_upstream(api="chat") as up,
        deployment_running(deployment(one_provider(up.url)), nats_server.url) as h,
        h.http() as http,
    ):
        body = json.dumps(request, ensure_ascii=False).encode()
        r = await http.post("/v1/responses", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 200, r.text
    assert up.bodies == [responses_to_chat_request(request, "served-model")]
