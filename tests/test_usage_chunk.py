"""Native chat streams always ask the upstream for usage; a client that did not ask never sees it."""

from __future__ import annotations

import itertools
import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from iop.nats.server import EmbeddedNats
from iop.openai.usage_chunk import UsageChunkFilter, ask_for_usage
from tests.fakes import fake_upstream
from tests.harness import deployment, deployment_running, sse_events

BASE = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m"}
TEXT = {
    **BASE,
    "choices": [{"index": 0, "delta": {"content": 'say "usage", "choices":[] here'}, "finish_reason": None}],
}
USAGE = {**BASE, "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}}
STREAM = (
    b"data: " + json.dumps(TEXT).encode() + b"\n\n"
    b": keep-alive\n\n"
    b"data: " + json.dumps(USAGE).encode() + b"\r\n\r\n"
    b"data: [DONE]\n\n"
)
WITHOUT_USAGE = STREAM.replace(b"data: " + json.dumps(USAGE).encode() + b"\r\n\r\n", b"")


def test_usage_is_asked_for_unless_the_client_did() -> None:
    payload: dict[str, Any] = {"stream": True, "stream_options": {"include_obfuscation": False}}
    assert ask_for_usage(payload) is True
    assert payload["stream_options"] == {"include_obfuscation": False, "include_usage": True}
    assert ask_for_usage(payload) is False


@given(st.lists(st.integers(min_value=0, max_value=len(STREAM)), max_size=8))
def test_usage_chunk_filter_drops_only_the_usage_chunk_wherever_the_stream_is_cut(cuts: list[int]) -> None:
    points = sorted({0, len(STREAM), *cuts})
    strip = UsageChunkFilter()
    out = b"".join(strip.feed(STREAM[a:b]) for a, b in itertools.pairwise(points)) + strip.close()
    assert out == WITHOUT_USAGE


def test_usage_chunk_filter_gives_done_as_the_usage_chunk_arrives_and_drops_what_follows() -> None:
    strip = UsageChunkFilter()
    before_done = STREAM[: STREAM.index(b"data: [DONE]")]
    # The client's stream is complete before the upstream's own [DONE] has arrived.
    assert strip.feed(before_done) == WITHOUT_USAGE
    assert strip.feed(b"data: [DONE]\n\n") == b""
    assert strip.close() == b""


def one_provider(url: str) -> str:
    return f"""
models: [{{alias: m, pool: [p]}}]
nodes:
  - id: n
    adapters: [{{id: up, type: openai, base_url: "{url}", api: chat}}]
    providers: [{{id: p, adapter: up, model: served-model, capacity: 2}}]
"""


async def test_native_chat_stream_usage_reaches_only_clients_that_asked(nats_server: EmbeddedNats) -> None:
    async with (
        fake_upstream(api="chat") as up,
        deployment_running(deployment(one_provider(up.url)), nats_server.url) as h,
        h.http() as http,
    ):
        bodies = []
        for options in (None, {"include_usage": True}):
            request: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
            if options is not None:
                request["stream_options"] = options
            r = await http.post("/v1/chat/completions", json=request)
            assert r.status_code == 200
            bodies.append(r.text)
    unasked, asked = bodies
    assert (
        '"usage"' not in unasked
        and "data: [DONE]" in unasked
        and "w0 w1 w2" in "".join(e["choices"][0]["delta"].get("content") or "" for e in sse_events(unasked))
    )
    assert '"usage"' in asked
    # Both reached the upstream asking for usage.
    assert [b["stream_options"] for b in up.bodies] == [{"include_usage": True}, {"include_usage": True}]
