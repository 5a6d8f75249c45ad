"""usage.py and wire.Usage: one type from the upstream's usage object, through NATS, into each API's shape."""

from __future__ import annotations

from typing import Any

import msgspec

from iop import wire
from iop.openai.translate_stream import ChatToResponsesStream
from iop.openai.usage import Usage, chat_usage, responses_usage, usage_from_chat, usage_from_responses

CHAT_USAGE: dict[str, Any] = {
    "prompt_tokens": 120,
    "completion_tokens": 30,
    "total_tokens": 150,
    "prompt_tokens_details": {"cached_tokens": 100},
    "completion_tokens_details": {"reasoning_tokens": 12},
}


def test_usage_from_chat_and_responses_agree_and_keep_the_details() -> None:
    from_chat = usage_from_chat(CHAT_USAGE)
    assert from_chat == Usage(120, 30, cached_tokens=100, reasoning_tokens=12)
    assert usage_from_responses(responses_usage(from_chat)) == from_chat
    assert usage_from_chat(chat_usage(from_chat)) == from_chat


def test_usage_details_the_upstream_did_not_report_are_none_and_read_zero_in_answers() -> None:
    usage = usage_from_chat({"prompt_tokens": 3, "completion_tokens": 2, "prompt_tokens_details": None})
    assert usage == Usage(3, 2, None, None)
    assert chat_usage(usage)["prompt_tokens_details"] == {"cached_tokens": 0}
    assert chat_usage(usage)["completion_tokens_details"] == {"reasoning_tokens": 0}
    shaped = responses_usage(usage)
    assert shaped["input_tokens_details"]["cached_tokens"] == 0 and shaped["total_tokens"] == 5


def test_usage_counts_that_are_not_counts_read_zero() -> None:
    usage = usage_from_responses(
        {"input_tokens": -4, "output_tokens": "7", "input_tokens_details": {"cached_tokens": -1}}
    )
    assert usage == Usage(0, 0, cached_tokens=0, reasoning_tokens=None)


def test_usage_a_translated_stream_reports_reaches_the_wire_whole() -> None:
    stream = ChatToResponsesStream({}, "m")
    chunk = {"choices": [], "usage": CHAT_USAGE}
    stream.feed(b"data: " + msgspec.json.encode(chunk) + b"\n\ndata: [DONE]\n\n")
    done = wire.Done("r1", 3, stream.usage)
    decoded = wire.decode_reply(wire.encode(done))
    assert isinstance(decoded, wire.Done) and decoded.usage == Usage(120, 30, 100, 12)


class _TwoCounts(msgspec.Struct, array_like=True):
    """wire.Usage as nodes before the details sent it."""

    input_tokens: int = 0
    output_tokens: int = 0


def test_usage_on_the_wire_is_read_by_older_and_newer_peers() -> None:
    assert msgspec.msgpack.decode(wire.encode(_TwoCounts(7, 5)), type=wire.Usage) == Usage(7, 5, None, None)
    assert msgspec.msgpack.decode(wire.encode(Usage(7, 5, 4, 1)), type=_TwoCounts) == _TwoCounts(7, 5)
