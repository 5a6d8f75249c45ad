"""A Responses turn the edge keeps that names no state (no `store`, `previous_response_id` or
`background` key, no item_reference) goes on as the bytes it came in, `store: false` spliced in,
and is kept as the expansion would keep it: the same request reaches the upstream, the same record
and item entries reach the store."""

from __future__ import annotations

import json
from typing import Any

import pytest
from nats.aio.client import Client as NATS

from iop.edge.heads import parse_head
from iop.nats.server import EmbeddedNats
from iop.openai.passthrough import LEAD
from iop.responses.expand import Responses
from tests.fakes import fake_upstream
from tests.harness import deployment, deployment_running
from tests.test_responses_cache import edge
from tests.test_responses_chain_reads import OWNER
from tests.test_responses_chain_reads import nc as nc  # the fixture: one edge's connection
from tests.test_responses_store import KEY_A, auth, one_provider
from tests.test_responses_store import keys as keys  # the fixture: the edge's key variables

ITEMS: list[dict[str, Any]] = [
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": 'say "id": é'}]},
    {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "read", "arguments": '{"id":"x"}'},
    {"type": "function_call_output", "call_id": "c1", "output": "a\\nb"},
    {"type": "message", "id": "msg_1", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
    {"type": "reasoning", "id": "not a valid id", "summary": []},
    {"type": "reasoning", "id": {"not": ["a", "string"]}, "summary": []},
]

AS_SENT = {
    "model first": b'{"model":"m","input":' + json.dumps(ITEMS).encode() + b',"stream":true}',
    "model later": b'{"instructions":"be brief","input":' + json.dumps(ITEMS).encode() + b',"model":"m"}',
    "spaces": b' \n{ "model" : "m" , "input" : ' + json.dumps(ITEMS, indent=2).encode() + b" }",
    "escaped model": b'{"model":"\\u006d","input":[]}',
    "string input": b'{"model":"m","input":"say \\"hi\\" \\u00e9"}',
    "store true": b'{"model":"m", "store": true,"input":' + json.dumps(ITEMS).encode() + b"}",
    "store true, model later": b'{"store":true,"input":[],"model":"m","model":"m"}',
    "a nested store key": b'{"model":"m","input":[],"tools":[{"type":"function","name":"f","parameters":{"store":1}}]}',
}
NOT_AS_SENT: dict[str, dict[str, Any]] = {
    "store null": {"model": "m", "input": ITEMS, "store": None},
    "previous": {"model": "m", "input": ITEMS, "store": True, "previous_response_id": "resp_x"},
    "background": {"model": "m", "input": ITEMS, "background": False},
    "a reference": {"model": "m", "input": [{"type": "item_reference", "id": "fc_1"}]},
}


def turn_lead_is_the_models(sent: bytes, lead: int) -> bool:
    """`lead` is where the one leading `model` of `sent` ends, or 0 when the node must read the body."""
    found = LEAD.match(sent)
    if not lead:
        return found is None or sent.count(b'"model"') > 1
    return found is not None and found.end() == lead and sent.count(b'"model"') == 1


def _items(sent: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"type": "message", "role": "user", "content": sent}] if isinstance(sent, str) else sent


@pytest.mark.parametrize("name", list(NOT_AS_SENT))
def test_a_turn_that_names_state_or_an_option_is_expanded_as_before(name: str) -> None:
    head = parse_head("responses", json.dumps(NOT_AS_SENT[name]).encode())
    assert head.stateful and not head.as_sent


@pytest.mark.parametrize("ids_from", ["head", "scan", "a head of another length"])
@pytest.mark.parametrize("name", list(AS_SENT))
async def test_a_turn_kept_as_sent_dispatches_and_keeps_what_its_expansion_would(
    nc: NATS, name: str, ids_from: str
) -> None:
    body = AS_SENT[name]
    head = parse_head("responses", body)
    assert head.stateful and head.as_sent
    sent_input = json.loads(body)["input"]
    # The head's decode read every item's string id (what the edge passes on; any other JSON as
    # None: never an id, and not held while the request waits), none for a text input.
    expected_ids = [i.get("id") if isinstance(i.get("id"), str) else None for i in _items(sent_input)]
    assert head.ids == (None if isinstance(sent_input, str) else expected_ids)
    responses: Responses = await edge(nc)
    assert responses.store is not None
    ids = {"head": head.ids, "scan": None, "a head of another length": [*(head.ids or []), "fc_9"]}[ids_from]
    fast = responses.as_sent(body, head.lead, head.as_sent == "rewrite", ids)
    # Its items are read after its dispatch, not before: then they are what the keep writes.
    assert fast.unread is not None and fast.items_json is None and not fast.index
    responses.read_sent(fast)
    slow = await responses.expand(json.loads(body), OWNER)
    sent = fast.encoded()
    assert json.loads(sent) == {**json.loads(body), "store": False}
    # Its index entries: every item with a usable id, as the bytes it came in.
    with_ids = [i for i in _items(sent_input) if i.get("id") in ("fc_1", "msg_1")]
    assert [(i, json.loads(raw)) for i, raw in fast.index] == [(i["id"], i) for i in with_ids]
    assert turn_lead_is_the_models(sent, fast.lead)
    # What the expansion would dispatch, but for a text input, which it would send as its message.
    expanded = json.loads(slow.encoded())
    assert {**json.loads(sent), "input": _items(json.loads(sent)["input"])} == expanded
    assert head.as_sent == ("rewrite" if "store" in json.loads(body) else "splice")
    if head.as_sent == "rewrite":
        # Its top-level members once each, store false, the others' values as they came.
        assert sent.count(b'"model"') == 1
    elif head.lead:
        # The client's bytes, one member added: after the leading model (the node still finds it
        # there), or first.
        assert sent == body[: head.lead] + b',"store":false' + body[head.lead :]
        assert fast.lead == head.lead
    else:
        assert sent.replace(b'"store":false,', b"", 1) == body
    for n, turn in enumerate((fast, slow)):
        answer = {"id": f"resp_{n}", "output": [{"type": "message", "id": f"out_{n}", "role": "assistant"}]}
        await responses.keep(OWNER, turn, answer)
    got = [await responses.store.response(OWNER, f"resp_{n}") for n in range(2)]
    assert got[0] is not None and got[1] is not None
    assert got[0].input == got[1].input == _items(json.loads(body)["input"])
    # Its size (what a next turn's limit counts) is the input as the client encoded it.
    assert got[1].size <= got[0].size <= got[1].size + body.count(b" ") + body.count(b"\n")
    for item in _items(json.loads(body)["input"]):
        found_item = await responses.store.item(OWNER, item["id"]) if "id" in item else None
        if item.get("id") in ("fc_1", "msg_1"):
            assert found_item == item
    assert await responses.store.item(OWNER, "fc_9") is None


async def test_the_upstream_gets_the_clients_bytes_and_the_turn_is_kept(nats_server: EmbeddedNats) -> None:
    body = AS_SENT["model first"].replace(b',"stream":true', b"")
    async with (
        fake_upstream(api="responses") as up,
        deployment_running(deployment(one_provider(up.url, "responses")), nats_server.url) as h,
        h.http() as http,
    ):
        answer = await http.post(
            "/v1/responses", content=body, headers={**auth(KEY_A), "content-type": "application/json"}
        )
        assert answer.status_code == 200, answer.text
        kept: dict[str, Any] = answer.json()
        assert kept["store"] is True
        # The node set the provider's model in place; nothing else of the client's bytes changed.
        assert up.raw_bodies == [body.replace(b'"model":"m"', b'"model":"served-model","store":false', 1)]
        read = await http.get(f"/v1/responses/{kept['id']}/input_items", headers=auth(KEY_A))
        assert read.status_code == 200, read.text
        # Newest first; an item sent without a string id is listed with one derived from its place.
        listed = read.json()["data"]
        assert len(listed) == len(ITEMS) and all(isinstance(i["id"], str) for i in listed)
        sent_first = zip(listed, ITEMS[::-1], strict=True)
        own = [{k: v for k, v in i.items() if k != "id" or isinstance(s.get("id"), str)} for i, s in sent_first]
        assert own == [{k: v for k, v in s.items() if k != "id" or isinstance(v, str)} for s in ITEMS[::-1]]
        follow = await http.post(
            "/v1/responses",
            json={"model": "m", "input": [{"type": "item_reference", "id": "fc_1"}]},
            headers=auth(KEY_A),
        )
        assert follow.status_code == 200, follow.text
        assert up.bodies[-1]["input"] == [ITEMS[1]]


@pytest.mark.parametrize("name", [n for n in NOT_AS_SENT if n != "store null"])  # that one is a 400
async def test_an_expanded_turn_with_an_id_that_is_no_string_is_kept(nats_server: EmbeddedNats, name: str) -> None:
    # The expansion path: an object as an item's id is passed on and kept, never a reference (it
    # was a 500: the keep looked the id up among the referenced ones, a set).
    async with (
        fake_upstream(api="responses") as up,
        deployment_running(deployment(one_provider(up.url, "responses")), nats_server.url) as h,
        h.http() as http,
    ):
        first = await http.post("/v1/responses", json={"model": "m", "input": ITEMS}, headers=auth(KEY_A))
        assert first.status_code == 200, first.text
        odd = {"type": "reasoning", "id": {"not": "a string"}, "summary": []}
        body = {**NOT_AS_SENT[name], "input": [*_items(NOT_AS_SENT[name]["input"]), odd]}
        if "previous_response_id" in body:
            body["previous_response_id"] = first.json()["id"]
        answer = await http.post("/v1/responses", json=body, headers=auth(KEY_A))
        assert answer.status_code == 200, answer.text
        assert up.bodies[-1]["input"][-1] == odd
        read = await http.get(f"/v1/responses/{answer.json()['id']}/input_items", headers=auth(KEY_A))
        assert read.status_code == 200, read.text
        listed = read.json()["data"][0]  # newest first
        assert listed["type"] == "reasoning" and isinstance(listed["id"], str)
