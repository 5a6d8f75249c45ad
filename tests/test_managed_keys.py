"""Managed keys: made, rotated and revoked by an admin on one edge, known to every edge at once."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from iop.edge.keys import EdgeKeys, Key
from iop.edge.managed import KEYS_BUCKET, ManagedKeys, StoredKey, digest
from iop.nats.server import EmbeddedNats
from tests.harness import EdgeHandle, deployment, eventually, running_edge, running_node

MODULE_LOOP = pytest.mark.asyncio(loop_scope="module")

YAML = """
edge:
  tenants:
    team-a: {rpm: 1000}
models:
  - {alias: m, pool: [p1]}
nodes:
  - id: n1
    adapters: [{type: mock, id: mk, latency_ms: 0, tokens: 2, token_interval_ms: 0}]
    providers: [{id: p1, adapter: mk, capacity: 8}]
"""
KEYS = EdgeKeys(clients=[Key("env", b"env-key")], admins=[Key("ops", b"admin-key")])
ADMIN = {"authorization": "Bearer admin-key"}


def test_an_expired_or_unknown_managed_key_opens_nothing() -> None:
    managed = ManagedKeys()
    secret = b"iop-sk-" + b"x" * 43
    managed._learn(
        StoredKey(id="key_0", name="old", tenant="t", created=0, expires=time.time() - 1, digest=digest(secret))
    )
    assert managed.lookup(secret) is None
    managed._learn(StoredKey(id="key_0", name="old", tenant="t", created=0, digest=digest(secret)))
    found = managed.lookup(secret)
    assert found is not None and found.tenant == "t" and found.name == "old"
    assert managed.lookup(b"iop-sk-" + b"y" * 43) is None and managed.lookup(b"env-key") is None


class Two:
    def __init__(self, a: EdgeHandle, b: EdgeHandle, http_a: httpx.AsyncClient, http_b: httpx.AsyncClient) -> None:
        self.a, self.b, self.http_a, self.http_b = a, b, http_a, http_b


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def two(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Two]:
    server = EmbeddedNats("127.0.0.1:0", Path(tmp_path_factory.mktemp("nats")))
    await server.start()
    dep = deployment(YAML)
    try:
        async with AsyncExitStack() as stack:
            a = await stack.enter_async_context(running_edge(dep, server.url, KEYS))
            b = await stack.enter_async_context(running_edge(dep, server.url, KEYS))
            await stack.enter_async_context(running_node(dep, "n1", server.url))
            for h in (a, b):
                await h.edge.registry.wait_connected(["n1"], timeout_s=10)
            yield Two(a, b, await stack.enter_async_context(a.http()), await stack.enter_async_context(b.http()))
    finally:
        await server.stop()


def chat() -> dict[str, object]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


async def status_with(http: httpx.AsyncClient, secret: str) -> int:
    r = await http.post("/v1/chat/completions", json=chat(), headers={"authorization": f"Bearer {secret}"})
    return r.status_code


@MODULE_LOOP
async def test_a_key_made_on_one_edge_works_on_the_other_with_its_tenant(two: Two) -> None:
    made = await two.http_a.post("/admin/keys", json={"name": "alice-laptop", "tenant": "team-a"}, headers=ADMIN)
    assert made.status_code == 200, made.text
    secret, key_id = made.json()["key"], made.json()["id"]
    assert secret.startswith("iop-sk-") and len(secret) == 50

    async def known() -> bool:
        return key_id in two.b.edge.managed_keys.by_id

    await eventually(known, timeout_s=2)
    r = await two.http_b.post("/v1/chat/completions", json=chat(), headers={"authorization": f"Bearer {secret}"})
    assert r.status_code == 200
    assert r.headers["x-ratelimit-limit-requests"] == "1000"  # team-a's policy, not alice-laptop's
    assert await status_with(two.http_b, "env-key") == 200  # the environment's keys keep working
    listed = (await two.http_b.get("/admin/keys", headers=ADMIN)).json()["keys"]
    assert [(k["id"], k["name"], k["tenant"]) for k in listed] == [(key_id, "alice-laptop", "team-a")]
    assert "key" not in listed[0] and "digest" not in listed[0]
    # The bucket holds a digest, never the key.
    kv = await two.a.edge.js.key_value(KEYS_BUCKET)
    stored = (await kv.get("k." + key_id)).value or b""
    assert secret.encode() not in stored and digest(secret.encode()).encode() in stored


@MODULE_LOOP
async def test_a_revoked_key_is_refused_on_every_edge_within_a_second(two: Two) -> None:
    made = (await two.http_a.post("/admin/keys", json={"name": "ci"}, headers=ADMIN)).json()
    secret = made["key"]

    async def works_on_b() -> bool:
        return await status_with(two.http_b, secret) == 200

    await eventually(works_on_b, timeout_s=2)
    revoked = await two.http_a.delete(f"/admin/keys/{made['id']}", headers=ADMIN)
    assert revoked.status_code == 200 and revoked.json()["revoked"] is True
    t0 = time.monotonic()

    async def refused_on_b() -> bool:
        return await status_with(two.http_b, secret) == 401

    took = await eventually(refused_on_b, timeout_s=1.0, every_s=0.01)
    print(f"\nrevoked on edge A, refused on edge B {took * 1000:.0f} ms later")
    assert time.monotonic() - t0 < 1.0
    assert await status_with(two.http_a, secret) == 401
    gone = await two.http_b.delete(f"/admin/keys/{made['id']}", headers=ADMIN)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "key_not_found"


@MODULE_LOOP
async def test_rotation_refuses_the_old_secret_and_admin_endpoints_refuse_client_keys(two: Two) -> None:
    made = (await two.http_a.post("/admin/keys", json={"name": "bot"}, headers=ADMIN)).json()
    rotated = await two.http_b.post(f"/admin/keys/{made['id']}/rotate", headers=ADMIN)
    assert rotated.status_code == 200
    new = rotated.json()["key"]
    assert new != made["key"] and rotated.json()["id"] == made["id"]
    assert await status_with(two.http_b, made["key"]) == 401
    assert await status_with(two.http_b, new) == 200
    for key in ("env-key", new):
        r = await two.http_a.get("/admin/keys", headers={"authorization": f"Bearer {key}"})
        assert r.status_code in (401, 403)
    bad = await two.http_a.post("/admin/keys", json={"name": "no spaces"}, headers=ADMIN)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "name"


@MODULE_LOOP
async def test_iop_keys_create_prints_the_key_once(two: Two) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "iop",
        "keys",
        "create",
        "from-cli",
        "--expires-days",
        "30",
        "--edge",
        two.a.url,
        "--admin-key",
        "admin-key",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, err.decode()
    secret = out.decode().strip()
    assert secret.startswith("iop-sk-") and "shown only now" in err.decode() and secret not in err.decode()
    assert await status_with(two.http_a, secret) == 200
