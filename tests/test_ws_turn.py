"""A WebSocket turn as bytes (iop/edge/ws_turn.py): the request spliced from raw JSON, the answer's
events cut out of SSE exactly as the general SSE parser reads them."""

from __future__ import annotations

import itertools
import json
import random

import msgspec
import pytest
from wsproto.frame_protocol import FrameProtocol

from iop.edge import ws_turn
from iop.edge.ws_protocol import text_frames
from iop.errors import BadRequest
from iop.openai.sse import SseDecoder

COMPLETED = {"type": "response.completed", "response": {"id": "resp_1", "status": "completed", "output": []}}
STREAMS = {
    "usual": b"".join(
        b"event: response.output_text.delta\ndata: " + json.dumps({"type": "x", "delta": d}).encode() + b"\n\n"
        for d in ["Hé", " wörld", "\\n", "data: no"]
    )
    + b"event: response.completed\ndata: "
    + json.dumps(COMPLETED).encode()
    + b"\n\n",
    "no event lines": b'data: {"type":"a"}\n\ndata: ' + json.dumps(COMPLETED).encode() + b"\n\ndata: [DONE]\n\n",
    "comments and ids": b': keep-alive\n\nid: 7\nevent: e\ndata: {"n":1}\n\nevent: f\ndata:{"n":2}\n\n',
    "several data lines": b'event: e\ndata: {"n":\ndata: 1}\n\ndata: {"n":2}\n\n',
    "CRLF": b'event: e\r\ndata: {"n":1}\r\n\r\nevent: response.failed\r\ndata: {"n":2}\r\n\r\n',
    "no final blank line": b'event: e\ndata: {"n":1}\n\nevent: e\ndata: {"n":2}',
}


def _decoded(stream: bytes) -> list[bytes]:
    decoder = SseDecoder()
    return [e.data for e in decoder.feed(stream) + decoder.finish() if e.data != b"[DONE]"]


def _fed(stream: bytes, cuts: list[int]) -> tuple[list[bytes], bytes | None]:
    frames = ws_turn.SseFrames()
    texts: list[bytes] = []
    bounds = [0, *cuts, len(stream)]
    for i, (a, b) in enumerate(itertools.pairwise(bounds)):
        texts += frames.feed(stream[a:b], more=i < len(bounds) - 2)
    return texts, frames.ended


@pytest.mark.parametrize("name", list(STREAMS))
def test_sse_frames_reads_what_the_sse_parser_reads_however_the_answer_is_cut(name: str) -> None:
    stream = STREAMS[name]
    rng = random.Random(name)
    expected = _decoded(stream)
    assert expected
    assert _fed(stream, [])[0] == expected
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(stream)), k=min(len(stream) - 1, rng.randint(1, 6))))
        assert _fed(stream, cuts)[0] == expected, cuts
    for at in range(1, len(stream)):
        assert _fed(stream, [at])[0] == expected, at


def test_sse_frames_keeps_the_final_event_and_makes_texts_valid_utf8() -> None:
    assert _fed(STREAMS["usual"], [40])[1] == json.dumps(COMPLETED).encode()
    assert _fed(STREAMS["no event lines"], [])[1] == json.dumps(COMPLETED).encode()  # its type says it
    assert _fed(STREAMS["CRLF"], [3])[1] == b'{"n":2}'  # its event name says it
    assert _fed(STREAMS["comments and ids"], [])[1] is None
    texts, _ = _fed(b'event: e\ndata: {"t":"\xff\xfe"}\n\n', [])
    assert texts == ['{"t":"\ufffd\ufffd"}'.encode()]


def test_a_continued_turn_is_spliced_from_the_bytes_it_came_as() -> None:
    event = b'{"type":"response.create","model":"m","previous_response_id":"resp_1","stream":false,"input":[ {"b":2} ]}'
    fields = ws_turn.event_fields(event)
    assert ws_turn.string_of(fields["previous_response_id"]) == "resp_1"
    items = ws_turn.joined(b'{"a":1}', ws_turn.items_of(fields["input"]))
    body = ws_turn.body_of(fields, items)
    assert json.loads(body) == {"stream": True, "model": "m", "input": [{"a": 1}, {"b": 2}]}
    # A turn that does not continue the socket's response goes on with its own input and id.
    assert json.loads(ws_turn.body_of(fields, None)) == {
        "stream": True,
        "model": "m",
        "previous_response_id": "resp_1",
        "input": [{"b": 2}],
    }
    # The earlier form nests the request; a string input is one user message.
    nested = ws_turn.event_fields(b'{"type":"response.create","response":{"model":"m","input":"hi"}}')
    assert json.loads(b"[" + ws_turn.items_of(nested["input"]) + b"]") == [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}
    ]
    assert ws_turn.items_of(msgspec.Raw(b"[ ]")) == b"" and ws_turn.items_of(msgspec.Raw(b"5")) == b""
    assert ws_turn.joined(b"", b"x") == b"x" and ws_turn.joined(b"x", b"") == b"x"


@pytest.mark.parametrize(
    ("event", "code"),
    [(b"{not json", "invalid_json"), (b"[1]", "invalid_event"), (b'{"type":"response.cancel"}', "invalid_event")],
)
def test_an_event_that_is_not_a_response_create_is_refused(event: bytes, code: str) -> None:
    with pytest.raises(BadRequest) as refused:
        ws_turn.event_fields(event)
    assert refused.value.code == code


def test_the_final_event_gives_the_response_the_socket_keeps() -> None:
    done = {"type": "response.completed", "response": {"id": "r", "status": "completed", "output": [{"x": 1}]}}
    ended = ws_turn.ended_of(json.dumps(done).encode())
    assert ended is not None and (ended.id, ended.status, ended.output, ended.compaction) == (
        "r",
        "completed",
        b'{"x": 1}',
        False,
    )
    compacted = {"response": {"id": "c", "status": "completed", "output": [{"type": "compaction"}]}}
    ended = ws_turn.ended_of(json.dumps(compacted).encode())
    assert ended is not None and ended.compaction
    mentioned = {"response": {"id": "c", "output": [{"type": "message", "text": '"compaction"'}]}}
    ended = ws_turn.ended_of(json.dumps(mentioned).encode())
    assert ended is not None and not ended.compaction
    assert ws_turn.ended_of(b'{"response": {"status": "failed"}}') is None
    assert ws_turn.ended_of(b"not json") is None and ws_turn.ended_of(None) is None


def test_text_frames_are_framed_as_wsproto_frames_them() -> None:
    proto = FrameProtocol(client=False, extensions=[])
    texts = [b"x" * n for n in (0, 1, 125, 126, 127, 300, 65535, 65536, 70000)]
    assert text_frames(texts) == b"".join(proto.send_data(t.decode(), fin=True) for t in texts)
