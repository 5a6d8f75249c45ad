"""A stored response as the event stream that gave it (`GET /v1/responses/{id}?stream=true`).

The store keeps the final response object, not its events: the replay is the stream a client
would have read, one delta per text, with its own sequence numbers, so `starting_after=N`
resumes it from any of them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgspec

_encode = msgspec.json.Encoder().encode
_FINAL = {"completed": "response.completed", "incomplete": "response.incomplete", "failed": "response.failed"}


def replay_events(response: dict[str, Any]) -> list[dict[str, Any]]:
    """The events of `response`, numbered from 0."""
    events = list(_events(response))
    for n, event in enumerate(events):
        event["sequence_number"] = n
    return events


def sse(events: list[dict[str, Any]]) -> bytes:
    return b"".join(b"event: " + e["type"].encode() + b"\ndata: " + _encode(e) + b"\n\n" for e in events)


def _events(response: dict[str, Any]) -> Iterator[dict[str, Any]]:
    output = [item for item in response.get("output") or [] if isinstance(item, dict)]
    start = {**response, "status": "in_progress", "output": [], "usage": None, "completed_at": None}
    yield {"type": "response.created", "response": start}
    yield {"type": "response.in_progress", "response": start}
    for index, item in enumerate(output):
        yield from _item(index, item)
    yield {"type": _FINAL.get(str(response.get("status")), "response.completed"), "response": response}


def _item(index: int, item: dict[str, Any]) -> Iterator[dict[str, Any]]:
    kind = item.get("type")
    where = {"item_id": item.get("id"), "output_index": index}
    opened = {**item, "status": "in_progress"}
    if kind in ("message", "reasoning"):
        opened["content"] = []
    if kind == "function_call":
        opened["arguments"] = ""
    yield {"type": "response.output_item.added", "output_index": index, "item": opened}
    if kind in ("message", "reasoning"):
        text_event = "response.output_text" if kind == "message" else "response.reasoning_text"
        for j, part in enumerate(item.get("content") or []):
            at = {**where, "content_index": j}
            empty = {**part, "text": ""} if "text" in part else part
            yield {"type": "response.content_part.added", **at, "part": empty}
            if part.get("type") in ("output_text", "reasoning_text"):
                text = part.get("text", "")
                logprobs: dict[str, Any] = {"logprobs": []} if kind == "message" else {}
                yield {"type": f"{text_event}.delta", **at, "delta": text, **logprobs}
                yield {"type": f"{text_event}.done", **at, "text": text, **logprobs}
            yield {"type": "response.content_part.done", **at, "part": part}
    elif kind == "function_call":
        arguments = item.get("arguments", "")
        yield {"type": "response.function_call_arguments.delta", **where, "delta": arguments}
        done = {**where, "name": item.get("name"), "arguments": arguments}
        yield {"type": "response.function_call_arguments.done", **done}
    yield {"type": "response.output_item.done", "output_index": index, "item": item}
