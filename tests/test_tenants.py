"""Tenants: the deployment file's policies, a request's tenant, allowed models, live refresh."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from iop import config
from iop.contracts.refresh import diff
from iop.contracts.usage import parse_query
from iop.edge.keys import EdgeKeys, Key
from iop.edge.ledger import RequestRecord
from iop.edge.tenants import Tenants
from iop.edge.usage_query import read_records
from iop.errors import ConfigError
from iop.nats.server import EmbeddedNats
from tests.harness import EdgeHandle, deployment, deployment_running, until

MODULE_LOOP = pytest.mark.asyncio(loop_scope="module")

BASE = """
models:
  - {alias: chat-small, pool: [p1]}
  - {alias: chat-large, pool: [p1]}
  - {alias: other, pool: [p1]}
nodes:
  - id: n1
    adapters: [{type: mock, id: m, latency_ms: 0, tokens: 2, token_interval_ms: 0}]
    providers: [{id: p1, adapter: m, capacity: 4}]
"""

TENANTS = """
edge:
  tenants:
    alice:
      models: ["chat-*"]
      priority: interactive
      weight: 2
      max_concurrent: 3
      pools: {chat-large: {max_concurrent: 1, rpm: 5}}
      keys: [alice-ci]
    bob: {tokens_per_day: 1000}
  tenant_defaults: {models: [other]}
"""


def test_tenant_policies_parse_with_their_defaults() -> None:
    dep = deployment(TENANTS + BASE)
    alice = dep.edge.tenants["alice"]
    assert alice.priority == "interactive" and alice.weight == 2.0 and alice.keys == ["alice-ci"]
    assert alice.allows("chat-small") and alice.allows("chat-large") and not alice.allows("other")
    assert alice.max_concurrent_on("chat-large") == 1 and alice.max_concurrent_on("chat-small") == 3
    bob = dep.edge.tenants["bob"]
    assert bob.priority == "standard" and bob.weight == 1.0 and bob.allows("other") and bob.limited
    assert not alice.pools["chat-large"].tpm and not deployment(BASE).edge.tenant_defaults.limited


def test_tenant_of_a_key_is_its_name_unless_a_tenant_lists_it() -> None:
    tenants = Tenants(deployment(TENANTS + BASE).edge)
    assert tenants.of_key("alice-ci").name == "alice"
    assert tenants.of_key("alice").policy.priority == "interactive"
    carol = tenants.of_key("carol")
    assert carol.name == "carol" and carol.policy.models == ["other"]


def test_bad_tenant_policies_are_named_by_path() -> None:
    bad = """
edge:
  tenants:
    alice: {rpm: 0, prio: x, priority: urgent, weight: 0, pools: {nope: {rpm: 1}}, keys: [bob]}
    bob: {tpm: -1}
    "no spaces": {}
  tenant_defaults: {keys: [x]}
"""
    with pytest.raises(ConfigError) as caught:
        config.parse(bad + BASE)
    problems = "\n".join(caught.value.problems)
    for expected in (
        "edge.tenants.alice.rpm: must be at least 1",
        "edge.tenants.alice.prio: unknown field; did you mean 'priority'?",
        "edge.tenants.alice.priority: expected one of",
        "edge.tenants.alice.weight: must be greater than 0",
        "edge.tenants.alice.pools.nope: no pool alias 'nope'",
        "edge.tenants.alice.keys[0]: key 'bob' already belongs to tenant 'bob'",
        "edge.tenants.bob.tpm: must be at least 1",
        "edge.tenants.no spaces:",
        "edge.tenant_defaults.keys: the defaults belong to no key",
    ):
        assert expected in problems, problems
    with pytest.raises(ConfigError, match=r"edge.tenants: expected a mapping, got a list"):
        config.parse("edge: {tenants: [alice]}\n" + BASE)


def test_refresh_diff_names_a_changed_tenant() -> None:
    old = deployment(TENANTS + BASE)
    new = deployment(TENANTS.replace("tokens_per_day: 1000", "tokens_per_day: 2000") + BASE)
    lines = [c.line() for c in diff(old, new)]
    assert len(lines) == 1 and lines[0].startswith("tenant edge.tenants.bob: "), lines


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def edge(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[EdgeHandle]:
    server = EmbeddedNats("127.0.0.1:0", Path(tmp_path_factory.mktemp("nats")))
    await server.start()
    keys = EdgeKeys(clients=[Key("alice", b"ka"), Key("alice-ci", b"kci"), Key("carol", b"kc")], admins=[])
    try:
        async with deployment_running(deployment(TENANTS + BASE), server.url, keys) as h:
            yield h
    finally:
        await server.stop()


def chat(model: str) -> dict[str, object]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}]}


async def records(h: EdgeHandle, n: int) -> list[RequestRecord]:
    ledger = h.edge.ledger
    assert ledger is not None
    await until(lambda: ledger.written >= n, ledger.changed, timeout_s=10)
    got: list[RequestRecord] = []
    await read_records(h.edge.js, parse_query("1h", None, None), got.extend)
    return got


@MODULE_LOOP
async def test_a_model_outside_the_tenants_list_is_not_found_and_the_ledger_names_the_tenant(
    edge: EdgeHandle,
) -> None:
    async with edge.http() as http:
        ok = await http.post("/v1/chat/completions", json=chat("chat-small"), headers={"authorization": "Bearer kci"})
        assert ok.status_code == 200, ok.text
        refused = await http.post("/v1/chat/completions", json=chat("other"), headers={"authorization": "Bearer ka"})
        assert refused.status_code == 404
        assert refused.json()["error"]["code"] == "model_not_found"
        assert refused.json()["error"]["param"] == "model"
        carol = await http.post("/v1/chat/completions", json=chat("other"), headers={"authorization": "Bearer kc"})
        assert carol.status_code == 200
    got = {(r.key, r.tenant, r.status) for r in await records(edge, 3)}
    assert {("alice-ci", "alice", 200), ("alice", "alice", 404), ("carol", "carol", 200)} <= got


@MODULE_LOOP
async def test_models_lists_only_the_tenants_models(edge: EdgeHandle) -> None:
    async with edge.http() as http:
        alice = await http.get("/v1/models", headers={"authorization": "Bearer ka"})
        assert [m["id"] for m in alice.json()["data"]] == ["chat-small", "chat-large"]
        carol = await http.get("/v1/models", headers={"authorization": "Bearer kc"})
        assert [m["id"] for m in carol.json()["data"]] == ["other"]
        hidden = await http.get("/v1/models/other", headers={"authorization": "Bearer ka"})
        assert hidden.status_code == 404 and hidden.json()["error"]["param"] == "model"
        shown = await http.get("/v1/models/chat-large", headers={"authorization": "Bearer ka"})
        assert shown.status_code == 200 and shown.json()["id"] == "chat-large"


@MODULE_LOOP
async def test_a_background_response_for_a_model_outside_the_tenants_list_is_refused_before_it_queues(
    edge: EdgeHandle,
) -> None:
    body = {"model": "other", "input": "hi", "background": True}
    async with edge.http() as http:
        refused = await http.post("/v1/responses", json=body, headers={"authorization": "Bearer ka"})
        assert refused.status_code == 404 and refused.json()["error"]["param"] == "model", refused.text


@MODULE_LOOP
async def test_count_tokens_for_a_model_outside_the_tenants_list_is_not_found(edge: EdgeHandle) -> None:
    body = {"model": "other", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    async with edge.http() as http:
        refused = await http.post("/v1/messages/count_tokens", json=body, headers={"authorization": "Bearer ka"})
        assert refused.status_code == 404 and refused.json()["error"]["type"] == "not_found_error", refused.text
        counted = await http.post("/v1/messages/count_tokens", json=body, headers={"authorization": "Bearer kc"})
        assert counted.status_code == 200 and counted.json()["input_tokens"] > 0, counted.text


@MODULE_LOOP
async def test_refresh_applies_a_changed_tenant_policy_live(edge: EdgeHandle) -> None:
    wider = TENANTS.replace('models: ["chat-*"]', 'models: ["chat-*", other]')
    result = await edge.edge.refresh_to(deployment(wider + BASE))
    assert result.error is None and any(c.startswith("tenant edge.tenants.alice") for c in result.changes)
    async with edge.http() as http:
        r = await http.post("/v1/chat/completions", json=chat("other"), headers={"authorization": "Bearer ka"})
        assert r.status_code == 200, r.text
    await edge.edge.refresh_to(deployment(TENANTS + BASE))


@MODULE_LOOP
async def test_usage_groups_by_tenant(edge: EdgeHandle) -> None:
    await records(edge, 3)
    async with edge.http() as http:
        r = await http.get("/usage", params={"by": "tenant", "since": "1h"}, headers={"authorization": "Bearer kci"})
    assert r.status_code == 200, r.text
    rows = r.json()["rows"]
    assert [row["tenant"] for row in rows] == ["alice"]
