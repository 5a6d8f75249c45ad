"""answer.py: every byte a writer emits is what the openai SDK's typed models and stream helpers accept."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Literal

import openai
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response

from iop.errors import BadRequest, QueueFull, UpstreamError
from iop.openai.answer import AnswerWriter, Usage, answer_writer
from tests.harness import responses_events, sdk_client, sse

PIECES = ["Hel", "lo", ", wor", "ld — ü ✓", "\n", '"quoted"']
TEXT = "".join(PIECES)


def run(writer: AnswerWriter, pieces: list[str], usage: Usage, finish_reason: str = "stop") -> bytes:
    out = writer.start()
    for piece in pieces:
        out += writer.delta(piece)
    return out + writer.finish(usage, finish_reason)


def chat_chunks(raw: bytes) -> list[ChatCompletionChunk]:
    events = sse(raw)
    assert events[-1].data == "[DONE]"
    chunks = [ChatCompletionChunk.model_validate_json(e.data) for e in events[:-1]]
    assert len({c.id for c in chunks}) == 1
    return chunks


def test_answer_chat_stream_chunks_validate_and_concatenate() -> None:
    writer = answer_writer("chat", True, "mock-1", {"stream_options": {"include_usage": True}})
    assert writer.content_type == "text/event-stream"
    chunks = chat_chunks(run(writer, PIECES, Usage(input_tokens=7, output_tokens=6)))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == TEXT
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert all(c.model == "mock-1" and c.id.startswith("chatcmpl-") for c in chunks)
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (7, 6, 13)


def test_answer_chat_stream_without_include_usage_sends_no_usage_chunk() -> None:
    chunks = chat_chunks(run(answer_writer("chat", True, "m"), PIECES, Usage(1, 2), "length"))
    assert all(c.usage is None and c.choices for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_answer_chat_stream_sdk_accumulates_the_message() -> None:
    writer = answer_writer("chat", True, "m", {"stream_options": {"include_usage": True}})
    client = sdk_client(run(writer, PIECES, Usage(3, 4)), writer.content_type)
    with client.chat.completions.stream(model="m", messages=[{"role": "user", "content": "hi"}]) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.content == TEXT
    assert final.usage is not None and final.usage.total_tokens == 7


def test_answer_chat_body_is_a_chat_completion() -> None:
    writer = answer_writer("chat", False, "m")
    assert writer.content_type == "application/json"
    assert writer.start() == b"" and writer.delta("x") == b""
    body = ChatCompletion.model_validate_json(writer.finish(Usage(5, 1), "length"))
    assert body.choices[0].message.content == "x" and body.choices[0].finish_reason == "length"
    assert body.usage is not None and (body.usage.prompt_tokens, body.usage.total_tokens) == (5, 6)
    assert body.id.startswith("chatcmpl-")


def test_answer_chat_body_through_the_sdk() -> None:
    writer = answer_writer("chat", False, "m")
    raw = run(writer, PIECES, Usage(2, 2))
    completion = sdk_client(raw, writer.content_type).chat.completions.create(model="m", messages=[])
    assert completion.choices[0].message.content == TEXT


def test_answer_responses_stream_event_sequence() -> None:
    request = {"model": "alias", "input": "hi", "instructions": "be brief", "tools": [], "stream": True}
    writer = answer_writer("responses", True, "mock-1", request)
    assert writer.content_type == "text/event-stream"
    opening = writer.start()
    assert [e.type for e in responses_events(opening)] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    raw = opening
    for piece in PIECES:
        raw += writer.delta(piece)
    raw += writer.finish(Usage(input_tokens=9, output_tokens=6))
    events = responses_events(raw)
    types = [e.type for e in events]
    assert types[4:-4] == ["response.output_text.delta"] * len(PIECES)
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    item_id = events[2].item.id
    assert item_id.startswith("msg_")
    assert all(e.item_id == item_id for e in events if e.type == "response.output_text.delta")
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == TEXT
    assert events[-4].text == TEXT
    final = events[-1].response
    assert final.id.startswith("resp_") and final.id == events[0].response.id
    assert final.status == "completed" and final.output_text == TEXT and final.instructions == "be brief"
    assert final.usage is not None
    assert (final.usage.input_tokens, final.usage.output_tokens, final.usage.total_tokens) == (9, 6, 15)
    assert final.usage.input_tokens_details.cached_tokens == 0


def test_answer_responses_stream_length_is_incomplete() -> None:
    writer = answer_writer("responses", True, "m", {"max_output_tokens": 6})
    events = responses_events(run(writer, PIECES, Usage(1, 6), "length"))
    last = events[-1]
    assert last.type == "response.incomplete"
    assert last.response.status == "incomplete"
    assert last.response.incomplete_details is not None
    assert last.response.incomplete_details.reason == "max_output_tokens"
    assert last.response.output_text == TEXT
    assert last.response.output[0].status == "incomplete"


def test_answer_responses_stream_sdk_accumulates_the_response() -> None:
    writer = answer_writer("responses", True, "m", {"input": "hi"})
    client = sdk_client(run(writer, PIECES, Usage(3, 4)), writer.content_type)
    with client.responses.stream(model="m", input="hi") as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == TEXT
    assert final.output_text == TEXT and final.usage is not None and final.usage.total_tokens == 7


def test_answer_responses_body_is_a_response() -> None:
    writer = answer_writer("responses", False, "m", {"temperature": 0.2, "metadata": {"k": "v"}})
    assert writer.start() == b""
    raw = run(writer, PIECES, Usage(4, 6))
    body = Response.model_validate_json(raw)
    assert body.status == "completed" and body.output_text == TEXT
    assert body.temperature == 0.2 and body.metadata == {"k": "v"}
    assert body.usage is not None and body.usage.total_tokens == 10
    sdk = sdk_client(raw, writer.content_type).responses.create(model="m", input="hi")
    assert sdk.output_text == TEXT


def test_answer_responses_body_length_is_incomplete() -> None:
    body = Response.model_validate_json(run(answer_writer("responses", False, "m"), ["a"], Usage(), "length"))
    assert body.status == "incomplete"
    assert body.incomplete_details is not None and body.incomplete_details.reason == "max_output_tokens"


def test_answer_empty_answer_is_still_a_message() -> None:
    events = responses_events(run(answer_writer("responses", True, "m"), [], Usage()))
    assert events[-1].response.output_text == ""
    chunks = chat_chunks(run(answer_writer("chat", True, "m"), [""], Usage()))
    assert [c.choices[0].finish_reason for c in chunks] == [None, "stop"]


@pytest.mark.parametrize("midway", [False, True])
def test_answer_responses_stream_fail_is_response_failed(midway: bool) -> None:
    writer = answer_writer("responses", True, "m")
    raw = writer.start() + (writer.delta("partial") if midway else b"")
    raw += writer.fail(UpstreamError("the command timed out", code="cli_timeout"))
    events = responses_events(raw)
    assert events[-1].type == "response.failed"
    failed = events[-1].response
    assert failed.status == "failed" and failed.error is not None
    assert failed.error.message == "the command timed out" and failed.error.code == "server_error"
    assert failed.output_text == ("partial" if midway else "")
    assert writer.finish(Usage()) == b"" and writer.delta("late") == b""


def test_answer_responses_stream_fail_maps_queue_full_to_rate_limit() -> None:
    writer = answer_writer("responses", True, "m")
    events = responses_events(writer.fail(QueueFull("busy")))
    assert [e.type for e in events] == ["response.created", "response.in_progress", "response.failed"]
    assert events[-1].response.error.code == "rate_limit_exceeded"


def test_answer_chat_stream_fail_raises_in_the_sdk() -> None:
    writer = answer_writer("chat", True, "m")
    raw = writer.start() + writer.delta("par") + writer.fail(UpstreamError("upstream went away"))
    error = json.loads(sse(raw)[-1].data)["error"]
    assert error == {
        "message": "upstream went away",
        "type": "server_error",
        "param": None,
        "code": "upstream_error",
    }
    client = sdk_client(raw, writer.content_type)
    with pytest.raises(openai.APIError, match="upstream went away"):
        list(client.chat.completions.create(model="m", messages=[], stream=True))


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_answer_body_fail_is_an_openai_error(api: Literal["chat", "responses"]) -> None:
    writer = answer_writer(api, False, "m")
    writer.delta("ignored")
    body = json.loads(writer.fail(BadRequest("bad thing")))
    error = {"message": "bad thing", "type": "invalid_request_error", "param": None, "code": "invalid_request"}
    assert body == {"error": error}


def test_answer_stream_deltas_encode_only_the_text() -> None:
    # The hot path: a delta's bytes are a fixed envelope plus the encoded text.
    writer = answer_writer("responses", True, "m")
    writer.start()
    first, second = writer.delta("a"), writer.delta("b")
    assert first.replace(b'"a"', b'"b"').replace(b":4,", b":5,") == second


def _lines(raw: bytes) -> Iterator[str]:
    yield from raw.decode().splitlines()


def test_answer_frames_are_plain_sse() -> None:
    chat = run(answer_writer("chat", True, "m"), ["x"], Usage())
    assert all(line.startswith("data: ") or line == "" for line in _lines(chat))
    responses = run(answer_writer("responses", True, "m"), ["x"], Usage())
    assert all(line.startswith(("event: ", "data: ")) or line == "" for line in _lines(responses))
    assert responses.endswith(b"\n\n") and chat.endswith(b"data: [DONE]\n\n")


def test_answer_responses_fail_reports_a_too_long_prompt_as_context_length_exceeded() -> None:
    # Codex reacts to this code (it is missing from the SDK's Literal, so this reads the raw JSON).
    writer = answer_writer("responses", True, "m")
    message = "upstream: This model's maximum context length is 4096 tokens. However, you requested 5000 tokens."
    error = json.loads(sse(writer.fail(BadRequest(message, code="upstream_bad_request")))[-1].data)["response"]["error"]
    assert error == {"code": "context_length_exceeded", "message": message, "type": "upstream_bad_request"}
