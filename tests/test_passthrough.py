"""A natively served body goes upstream as the client's bytes with only `model` and usage options replaced."""

from __future__ import annotations

import json

import pytest

from iop.edge.heads import parse_head
from iop.errors import BadRequest
from iop.nats.server import EmbeddedNats
from iop.openai.passthrough import native_parts
from tests.fakes import fake_upstream
from tests.harness import deployment, deployment_running, one_provider_yaml


def native_body(body: bytes, model: str | None, chat_stream: bool, lead: int = 0) -> tuple[bytes, bool]:
    """The bytes that go upstream: the pieces `native_parts` gives, one after the other (the
    same object when there is one piece)."""
    parts, asked = native_parts(body, model, chat_stream, lead)
    return (parts[0] if len(parts) == 1 else b"".join(parts)), asked  # type: ignore[return-value]


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


# --- the edge's `lead`: the body's only top-level model is its first key (iop/edge/heads.py) ---------

LEADING = b'{ "model" : "alias",  "messages":[{"role":"user","content":"caf\xc3\xa9 \\"q\\""}] ,\n "temperature":0.5}'


@pytest.mark.parametrize(
    ("body", "api", "lead"),
    [
        (LEADING, "chat", len(b'{ "model" : "alias"')),
        (b'{"model":"m","input":"x","tools":[{"type":"function","model":"nested"}]}', "responses", 12),
        (b'{"model":"\xc3\xa9","input":"x"}', "responses", 13),
        # Anything else the node reads whole: model not first, twice, escaped, a chat with stream_options.
        (b'{"messages":[{"role":"user","content":"x"}],"model":"m"}', "chat", 0),
        (b'{"model":"m","messages":[{"role":"user","content":"x"}],"model":"m"}', "chat", 0),
        (b'{"model":"m","input":"x","model":"other"}', "responses", 0),
        (b'{"model":"m","messages":[{"role":"user","content":"x"}],"mod\\u0065l":"x"}', "chat", 0),
        (b'{"model":"\\u006d","messages":[{"role":"user","content":"x"}]}', "chat", 0),
        (b'{"model":"m","messages":[{"role":"user","content":"x"}],"stream_options":null}', "chat", 0),
    ],
)
def test_the_edge_says_where_the_only_top_level_model_ends(body: bytes, api: str, lead: int) -> None:
    assert parse_head(api, body).lead == lead  # type: ignore[arg-type]


@pytest.mark.parametrize("model", ["served", None, "alias"])
@pytest.mark.parametrize("chat_stream", [False, True])
def test_a_body_with_a_lead_goes_upstream_as_the_scan_makes_it_with_the_clients_bytes_after_the_model(
    model: str | None, chat_stream: bool
) -> None:
    lead = parse_head("chat", LEADING).lead
    fast, asked = native_body(LEADING, model, chat_stream, lead)
    scanned, asked_too = native_body(LEADING, model, chat_stream)
    assert (json.loads(fast), asked) == (json.loads(scanned), asked_too)
    assert fast.endswith(LEADING[lead:])  # every byte after the model as the client sent it
    if model in (None, "alias") and not chat_stream:
        assert fast is LEADING  # nothing to change: not even a copy
    parts, _ = native_parts(LEADING, model, chat_stream, lead)
    assert b"".join(parts) == fast
    if len(parts) > 1:  # the client's bytes after the model are a view of its body, not a copy
        assert isinstance(parts[-1], memoryview) and parts[-1].obj is LEADING


def test_a_lead_that_does_not_describe_the_body_is_not_believed() -> None:
    body = b'{"messages":[],"model":"a"}'
    out, _ = native_body(body, "served", False, lead=12)
    assert json.loads(out) == {"messages": [], "model": "served"}
    out, _ = native_body(b'{"model":"abc","x":1}', "served", False, lead=9)  # not where the model ends
    assert json.loads(out) == {"model": "served", "x": 1}


async def test_the_node_sets_the_model_in_the_clients_own_bytes_and_a_second_model_key_never_reaches_upstream(
    nats_server: EmbeddedNats,
) -> None:
    body = LEADING.replace(b'"alias"', b'"m"')
    twice = b'{"model":"m","messages":[{"role":"user","content":"x"}],"model":"m"}'
    async with fake_upstream() as up:
        dep = deployment(one_provider_yaml(up.url).replace("adapter: up,", "adapter: up, model: served,"))
        async with deployment_running(dep, nats_server.url) as h, h.http() as http:
            for sent in (body, twice):
                r = await http.post("/v1/chat/completions", content=sent, headers={"content-type": "application/json"})
                assert r.status_code == 200, r.text
    # The first: spacing and all as the client wrote it, but the model, which no scan rewrote.
    assert up.raw_bodies[0] == b'{"model":"served"' + body[len(b'{ "model" : "m"') :]
    # The second had two: the node read it whole, and the upstream got one model, the node's.
    assert up.raw_bodies[1].count(b'"model"') == 1 and json.loads(up.raw_bodies[1])["model"] == "served"
