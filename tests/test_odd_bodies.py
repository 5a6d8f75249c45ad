"""Every field of a valid request, given a value of another JSON type or left out, is answered,
never a server error: a 400 in the API's error shape, or passed on when the field is the
upstream's to judge. One valid body per endpoint and upstream kind (passed through, translated for
a chat server), mutated one place at a time: each place left out, an object, an array, and one
scalar of the rest in turn, whole and streamed where the API streams.

What it caught: a Responses `tools[].type` that was an object broke the node's translation (502,
`TypeError: unhashable type`), and an item `id` that was one broke a kept turn mid-answer."""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from iop.nats.server import EmbeddedNats
from tests.fakes import fake_upstream
from tests.harness import deployment, deployment_running
from tests.test_responses_store import KEY_A, auth, one_provider
from tests.test_responses_store import keys as keys  # the fixture: the edge's key variables

Path = tuple[str | int, ...]
SCALARS: list[Any] = [1, -1.5, True, None, "", "\u0000", "x" * 300]
LEFT_OUT = object()

RESPONSES: dict[str, Any] = {
    "model": "m",
    "input": [
        {
            "type": "message",
            "role": "user",
            "content": [
                {"type": "input_text", "text": "hi"},
                {"type": "input_image", "image_url": "data:image/png;base64,AA=="},
            ],
        },
        {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "read", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "x"},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "t"}]},
    ],
    "tools": [{"type": "function", "name": "read", "parameters": {"type": "object"}}],
    "instructions": "be brief",
    "tool_choice": "auto",
    "text": {"format": {"type": "text"}},
    "reasoning": {"effort": "low"},
    "max_output_tokens": 50,
    "include": ["reasoning.encrypted_content"],
    "prompt_cache_key": "k",
    "metadata": {"a": "b"},
}
CHAT: dict[str, Any] = {
    "model": "m",
    "messages": [
        {"role": "system", "content": "s"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "data:,"}}],
        },
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "x"},
    ],
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
    "stream_options": {"include_usage": True},
    "max_tokens": 5,
    "user": "u",
    "response_format": {"type": "json_object"},
}
MESSAGES: dict[str, Any] = {
    "model": "m",
    "max_tokens": 10,
    "system": [{"type": "text", "text": "s", "cache_control": {"type": "ephemeral"}}],
    "messages": [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "hi"},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}},
            ],
        },
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "t", "signature": "s"},
                {"type": "tool_use", "id": "tu1", "name": "f", "input": {"a": 1}},
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "tu1", "content": [{"type": "text", "text": "r"}]}],
        },
    ],
    "tools": [{"name": "f", "description": "d", "input_schema": {"type": "object"}}],
    "tool_choice": {"type": "auto"},
    "thinking": {"type": "enabled", "budget_tokens": 1024},
    "stop_sequences": ["x"],
}
EMBEDDINGS: dict[str, Any] = {"model": "m", "input": ["a", "b"], "encoding_format": "float", "user": "u"}
COMPLETIONS: dict[str, Any] = {"model": "m", "prompt": ["a"], "max_tokens": 3, "stop": ["x"]}
COMPACT: dict[str, Any] = {"model": "m", "input": RESPONSES["input"], "instructions": "x"}
COUNT: dict[str, Any] = {k: v for k, v in MESSAGES.items() if k not in ("max_tokens", "stop_sequences")}

CASES = {
    "responses passed": ("responses", "/v1/responses", RESPONSES, True),
    "responses for a chat server": ("chat", "/v1/responses", RESPONSES, True),
    "chat": ("chat", "/v1/chat/completions", CHAT, True),
    "messages for a chat server": ("chat", "/v1/messages", MESSAGES, True),
    "compact passed": ("responses", "/v1/responses/compact", COMPACT, False),
    "compact for a chat server": ("chat", "/v1/responses/compact", COMPACT, False),
    "count_tokens": ("chat", "/v1/messages/count_tokens", COUNT, False),
    "embeddings": ("chat,embeddings", "/v1/embeddings", EMBEDDINGS, False),
    "completions": ("chat,completions", "/v1/completions", COMPLETIONS, False),
}


def _places(value: Any, at: Path = ()) -> Iterator[Path]:
    if at:
        yield at
    if isinstance(value, dict):
        for key, inner in value.items():
            yield from _places(inner, (*at, key))
    elif isinstance(value, list):
        for n, inner in enumerate(value):
            yield from _places(inner, (*at, n))


def mutations(body: dict[str, Any]) -> Iterator[tuple[Path, Any, dict[str, Any]]]:
    """`body` with one place changed: left out (a key), an object, an array, a scalar in turn."""
    for n, place in enumerate(_places(body)):
        for value in (LEFT_OUT, {"a": 1}, ["x"], SCALARS[n % len(SCALARS)]):
            changed = copy.deepcopy(body)
            parent: Any = changed
            for step in place[:-1]:
                parent = parent[step]
            if value is LEFT_OUT:
                if isinstance(parent, list):
                    continue
                del parent[place[-1]]
            else:
                parent[place[-1]] = value
            yield place, value, changed


@pytest.mark.parametrize("case", list(CASES))
async def test_no_field_of_another_type_is_a_server_error(nats_server: EmbeddedNats, case: str) -> None:
    api, path, body, streams = CASES[case]
    async with (
        fake_upstream(api=api) as up,
        deployment_running(deployment(one_provider(up.url, f"[{api}]")), nats_server.url) as h,
        h.http() as http,
    ):
        headers = {**auth(KEY_A), "anthropic-version": "2023-06-01"}
        valid = await http.post(path, json=body, headers=headers)
        assert valid.status_code == 200, valid.text
        failures: list[str] = []
        statuses: Counter[int] = Counter()
        for stream in (False, True) if streams else (False,):
            for place, value, changed in mutations({**body, "stream": True} if stream else body):
                try:
                    answer = await http.post(path, json=changed, headers=headers)
                except httpx.HTTPError as exc:  # a stream broken off mid-answer
                    failures.append(f"{place} = {value!r}, stream {stream}: {type(exc).__name__}")
                    continue
                statuses[answer.status_code] += 1
                if answer.status_code >= 500 or "event: error" in answer.text:
                    failures.append(f"{place} = {value!r}, stream {stream}: {answer.status_code} {answer.text[:160]}")
        assert not failures, "\n".join(failures[:20]) + f"\n({len(failures)} in all)"
        # Both outcomes were met: the mutations reached the checks and the upstream alike.
        assert statuses[200] and sum(n for s, n in statuses.items() if 400 <= s < 500), statuses
