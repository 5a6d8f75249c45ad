"""A natively served body goes upstream as the client's bytes with only `model` and usage options replaced."""

from __future__ import annotations

import json

import pytest

from iop.errors import BadRequest
from iop.openai.passthrough import native_body

BODY = (
    b'{"messages":[{"role":"user","content":"caf\xc3\xa9 \\"quoted\\"\\n"}],  "model" : "alias",'
    b'"tools":[ {"type":"function"} ],"temperature":0.5}'
)


def test_native_body_replaces_only_the_model_and_keeps_every_other_byte() -> None:
    out, asked = native_body(BODY, "served-model", chat_stream=False)
    assert asked is False
    assert json.loads(out) == {**json.loads(BODY), "model": "served-model"}
    # The other fields' values are the client's bytes, spacing and escapes included, in order.
    assert out == (
        b'{"messages":[{"role":"user","content":"caf\xc3\xa9 \\"quoted\\"\\n"}],"model":"served-model",'
        b'"tools":[ {"type":"function"} ],"temperature":0.5}'
    )


def test_native_body_is_the_same_object_when_nothing_changes() -> None:
    assert native_body(BODY, None, chat_stream=False) == (BODY, False)
    assert native_body(BODY, None, chat_stream=False)[0] is BODY


def test_native_body_of_a_chat_stream_asks_for_usage_keeping_the_clients_options() -> None:
    out, asked = native_body(b'{"model":"a","stream_options":{"include_obfuscation":false}}', None, chat_stream=True)
    assert asked is True
    assert json.loads(out)["stream_options"] == {"include_obfuscation": False, "include_usage": True}
    out, asked = native_body(b'{"model":"a","stream_options":{"include_usage":true}}', "m", chat_stream=True)
    assert asked is False
    assert json.loads(out) == {"model": "m", "stream_options": {"include_usage": True}}
    out, asked = native_body(b'{"model":"a"}', None, chat_stream=True)
    assert (asked, json.loads(out)) == (True, {"model": "a", "stream_options": {"include_usage": True}})


@pytest.mark.parametrize("body", [b"[1,2]", b'{"model":', b'"text"'])
def test_native_body_refuses_a_body_that_is_not_a_json_object(body: bytes) -> None:
    with pytest.raises(BadRequest) as err:
        native_body(body, "m", chat_stream=False)
    assert err.value.code == "invalid_json"
