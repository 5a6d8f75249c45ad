"""The send that patches and keeps a streamed Responses answer (iop/responses/tap.py), however the
answer's bytes are cut: every lifecycle event says the state as the edge applied it, every other
event passes unchanged, and the final response is kept before its event leaves and after every
event before it has left."""

from __future__ import annotations

import json
from typing import Any

import pytest
from starlette.types import Message

from iop.responses.expand import Turn
from iop.responses.tap import KeepingSend

_LIFECYCLE = {"response.created", "response.in_progress", "response.completed"}


def _events(newline: str) -> bytes:
    response = {"id": "resp_up", "object": "response", "status": "in_progress", "output": [], "store": False}
    item = {"type": "message", "id": "msg_1", "role": "assistant", "content": [{"type": "output_text", "text": "a b"}]}
    done = {**response, "status": "completed", "output": [item]}
    events: list[dict[str, Any]] = [
        {"type": "response.created", "response": response},
        {"type": "response.in_progress", "response": response},
        {"type": "response.output_item.added", "output_index": 0, "item": {**item, "content": []}},
        {"type": "response.output_text.delta", "item_id": "msg_1", "delta": 'a "response": b'},
        {"type": "response.output_text.delta", "item_id": "msg_1", "delta": " b"},
        {"type": "response.output_item.done", "output_index": 0, "item": item},
        {"type": "response.completed", "response": done},
    ]
    frames = [f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in events]
    return "".join(frames).replace("\n", newline).encode()


def _parse(data: bytes) -> list[tuple[str, dict[str, Any]]]:
    """SSE as a client reads it: events split by blank lines, whatever the line breaks."""
    text = data.decode().replace("\r\n", "\n").replace("\r", "\n")
    out = []
    for frame in text.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in frame.split("\n") if ": " in line)
        if "data" in fields:
            out.append((fields.get("event", ""), json.loads(fields["data"])))
    return out


class _Store:
    def __init__(self, sent: list[Message]) -> None:
        self.sent = sent
        self.kept: list[tuple[dict[str, Any], int]] = []

    async def keep(self, owner: str, turn: Turn, response: dict[str, Any]) -> None:
        self.kept.append((json.loads(json.dumps(response)), len(self.sent)))


async def _through(pieces: list[bytes]) -> tuple[bytes, _Store, list[Message]]:
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    store = _Store(sent)
    turn = Turn({}, [], "resp_before", True)
    keeping = KeepingSend(send, store, "owner", turn, True)  # type: ignore[arg-type]
    await keeping({"type": "http.response.start", "status": 200, "headers": []})
    for piece in pieces:
        await keeping({"type": "http.response.body", "body": piece, "more_body": True})
    await keeping({"type": "http.response.body", "body": b""})
    return b"".join(m.get("body", b"") for m in sent), store, sent


@pytest.mark.parametrize("newline", ["\n", "\r\n", "\r"], ids=["lf", "crlf", "cr"])
async def test_a_streamed_answer_is_patched_and_kept_however_its_bytes_are_cut(newline: str) -> None:
    data = _events(newline)
    expected = _parse(data)
    cuts = [[], *([c] for c in range(1, len(data))), [40, 41, 300, 301, len(data) - 2]]
    for cut in cuts:
        pieces = [data[a:b] for a, b in zip([0, *cut], [*cut, len(data)], strict=True)]
        out, store, sent = await _through(pieces)
        got = _parse(out)
        assert [kind for kind, _ in got] == [kind for kind, _ in expected], cut
        for (kind, event), (_, before) in zip(got, expected, strict=True):
            if kind in _LIFECYCLE:
                r = event["response"]
                assert (r["store"], r["previous_response_id"], r["background"]) == (True, "resp_before", False), cut
                assert {k: v for k, v in r.items() if k not in ("store", "previous_response_id", "background")} == {
                    k: v for k, v in before["response"].items() if k != "store"
                }
            else:
                assert event == before, cut
        assert len(store.kept) == 1, cut
        kept, sent_before = store.kept[0]
        assert kept["status"] == "completed" and kept["output"][0]["id"] == "msg_1" and kept["store"] is True
        # Kept before the bytes that carry the final event leave, and after every event before it left.
        before_keep = b"".join(m.get("body", b"") for m in sent[:sent_before])
        assert before_keep == out[: out.index(b"event: response.completed")], cut


async def test_only_lifecycle_events_are_rewritten() -> None:
    """The deltas and item events between them leave byte for byte as the upstream sent them."""
    data = _events("\n")
    out, _, _ = await _through([data])
    for frame in data.split(b"\n\n"):
        if frame and b'"response": {' not in frame:
            assert frame + b"\n\n" in out


async def test_a_whole_answer_leaves_head_and_body_together_after_its_keep() -> None:
    """Neither part waits alone for the store's write: the head is held for the body (one write)."""
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    store = _Store(sent)
    keeping = KeepingSend(send, store, "owner", Turn({}, [], None, True), False)  # type: ignore[arg-type]
    response = {"id": "resp_up", "object": "response", "status": "completed", "output": [], "store": False}
    body = json.dumps(response).encode()
    await keeping({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    assert sent == []
    await keeping({"type": "http.response.body", "body": body[:10], "more_body": True})
    await keeping({"type": "http.response.body", "body": body[10:]})
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    assert store.kept and store.kept[0][1] == 0  # kept before either left
    assert json.loads(sent[1]["body"])["store"] is True


async def test_an_error_answer_passes_at_once() -> None:
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    keeping = KeepingSend(send, _Store(sent), "owner", Turn({}, [], None, True), False)  # type: ignore[arg-type]
    await keeping({"type": "http.response.start", "status": 429, "headers": []})
    assert [m["status"] for m in sent] == [429]
