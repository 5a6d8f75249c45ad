"""A provider's lifecycle policy, an operator's drain and enable, routing by expected finish, deadlines:
through a real edge (two of them, for the shared drains), a node, nats-server and a failing fake upstream.

One deployment for the module: pool `m` has a fast and a slow mock provider; pool `flaky` has
`bad` (a fake upstream answering 500, with a policy) and `good` (a mock).
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio

from iop.edge.keys import EdgeKeys
from iop.nats.server import EmbeddedNats
from tests.fakes import FakeUpstream, fake_upstream
from tests.harness import EdgeHandle, deployment, deployment_running, eventually, running_edge

pytestmark = pytest.mark.asyncio(loop_scope="module")

CLIENT = "sk-client-lifecycle"
ADMIN = "sk-admin-lifecycle"


def yaml(bad_url: str) -> str:
    return f"""
edge: {{api_keys_env: IOP_LC_KEYS, admin_keys_env: IOP_LC_ADMIN, queue: {{timeout_s: 5}}}}
models:
  - {{alias: m, pool: [fast, slow]}}
  - {{alias: flaky, pool: [bad, good]}}
nodes:
  - id: n
    adapters:
      - {{id: quick, type: mock, latency_ms: 5, tokens: 8, token_interval_ms: 1}}
      - {{id: sluggish, type: mock, latency_ms: 150, tokens: 8, token_interval_ms: 40}}
      - {{id: up, type: openai, base_url: "{bad_url}"}}
    providers:
      - {{id: fast, adapter: quick, capacity: 4}}
      - {{id: slow, adapter: sluggish, capacity: 8}}
      - id: bad
        adapter: up
        capacity: 2
        policy: {{window_s: 60, min_requests: 3, max_error_rate: 0.5}}
      - {{id: good, adapter: quick, capacity: 2}}
"""


@dataclass
class Rig:
    h: EdgeHandle
    second: EdgeHandle
    http: httpx.AsyncClient
    upstream: FakeUpstream


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def rig(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Rig]:
    server = EmbeddedNats("127.0.0.1:0", Path(tmp_path_factory.mktemp("nats")))
    await server.start()
    env = {"IOP_LC_KEYS": CLIENT, "IOP_LC_ADMIN": f"ops:{ADMIN}"}
    try:
        async with fake_upstream(fail_status=500) as up:
            dep = deployment(yaml(up.url))
            keys = EdgeKeys.from_settings(dep.edge, env)
            async with (
                deployment_running(dep, server.url, keys) as h,
                running_edge(dep, server.url, keys) as second,
                h.http() as http,
            ):
                await second.edge.registry.wait_connected(["n"], timeout_s=10)
                yield Rig(h, second, http, up)
    finally:
        await server.stop()


def as_client(**extra: str) -> dict[str, str]:
    return {"authorization": f"Bearer {CLIENT}", **extra}


ADMIN_AUTH = {"authorization": f"Bearer {ADMIN}"}


async def chat(
    http: httpx.AsyncClient, model: str, *, stream: bool = True, headers: dict[str, str] | None = None
) -> httpx.Response:
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return await http.post("/v1/chat/completions", json=body, headers=as_client(**(headers or {})))


async def test_routing_sends_requests_to_the_faster_provider_once_both_are_measured(rig: Rig) -> None:
    sched = rig.h.edge.scheduler
    # Each unmeasured provider goes first once (whatever of this module ran before on this worker).
    for _ in range(2):
        assert (await chat(rig.http, "m")).status_code == 200
    assert set(sched.router.figures) >= {"fast", "slow"}
    # Then the quick one takes every request although the slow one has twice its free slots.
    got = [(await chat(rig.http, "m")).headers["x-iop-provider"] for _ in range(6)]
    assert got == ["fast"] * 6, got
    figures = sched.router.figures
    assert figures["fast"].decode_tok_s is not None and figures["slow"].decode_tok_s is not None
    assert figures["fast"].decode_tok_s > 3 * figures["slow"].decode_tok_s
    status = (await rig.http.get("/status", headers=as_client())).json()
    fast = next(p for n in status["nodes"] for p in n["providers"] if p["id"] == "fast")
    assert fast["ttft_ms"] is not None and fast["decode_tok_s"] is not None


async def test_deadline_nobody_can_meet_is_refused_at_once(rig: Rig) -> None:
    for _ in range(2):  # both measured (each unmeasured provider goes first once), whatever ran before
        assert (await chat(rig.http, "m")).status_code == 200
    await eventually(_measured(rig, "fast", "slow"))
    t0 = time.monotonic()
    r = await chat(rig.http, "m", headers={"x-iop-deadline-ms": "1"})
    assert r.status_code == 504, r.text
    assert r.json()["error"]["code"] == "deadline_unmeetable"
    assert time.monotonic() - t0 < 1.0
    assert sum(p.in_flight for p in rig.h.edge.scheduler.providers.values()) == 0
    ok = await chat(rig.http, "m", headers={"x-iop-deadline-ms": "5000"})
    assert ok.status_code == 200 and ok.headers["x-iop-provider"] == "fast"


async def test_deadline_header_that_is_not_a_positive_number_is_a_400_naming_it(rig: Rig) -> None:
    for bad in ("soon", "-5", "0"):
        r = await chat(rig.http, "m", headers={"x-iop-deadline-ms": bad})
        assert r.status_code == 400, (bad, r.text)
        assert r.json()["error"]["param"] == "x-iop-deadline-ms"


async def test_policy_drains_a_failing_provider_and_a_passing_qualification_brings_it_back(rig: Rig) -> None:
    sched, lc = rig.h.edge.scheduler, rig.h.edge.lifecycle
    for _ in range(6):
        r = await chat(rig.http, "flaky", stream=False)
        assert r.status_code == 200  # failed over to `good`: the client never sees the failing one
        if sched.providers["bad"].drained:
            break
    assert sched.providers["bad"].drained
    assert lc.drains["bad"].by == "policy" and "error rate" in lc.drains["bad"].reason
    # Out of the pool: requests go to the other provider, none reaches the failing upstream.
    before = rig.upstream.total
    assert (await chat(rig.http, "flaky", stream=False)).headers["x-iop-provider"] == "good"
    assert rig.upstream.total == before
    # Shared: the other edge, which saw none of these failures, holds it out too.
    await eventually(_drained("bad", rig.second))
    status = (await rig.http.get("/status", headers=as_client())).json()
    bad = next(p for n in status["nodes"] for p in n["providers"] if p["id"] == "bad")
    assert bad["drained"].startswith("policy: error rate")
    metrics = (await rig.http.get("/metrics", headers=as_client())).text
    assert 'iop_provider_drained{by="policy",node="n",provider="bad"} 1.0' in metrics
    # A qualification run whose protocol checks all pass brings it back, on every edge.
    r = await rig.http.put("/admin/qualify/results/bad", content=_report("bad", "pass"), headers=ADMIN_AUTH)
    assert r.status_code == 200, r.text
    await eventually(_drained("bad", rig.h, rig.second, want=False))


async def test_failed_protocol_check_drains_a_provider_with_a_policy(rig: Rig) -> None:
    r = await rig.http.put("/admin/qualify/results/bad", content=_report("bad", "fail"), headers=ADMIN_AUTH)
    assert r.status_code == 200, r.text
    await eventually(_drained("bad", rig.h))
    assert rig.h.edge.lifecycle.drains["bad"].by == "checks"
    r = await rig.http.post("/admin/providers/bad/enable", headers=ADMIN_AUTH)
    assert r.status_code == 200 and r.json() == {"provider": "bad", "drained": False, "was_drained": True}


async def test_operator_drain_and_enable_with_the_admin_key_on_every_edge(rig: Rig) -> None:
    r = await rig.http.post("/admin/providers/slow/drain", json={"reason": "maintenance"}, headers=ADMIN_AUTH)
    assert r.status_code == 200, r.text
    assert r.json()["drain"]["who"].startswith("ops")
    assert rig.h.edge.scheduler.providers["slow"].drains == {"lifecycle": "operator: maintenance"}
    await eventually(_drained("slow", rig.second))
    # Every request of the pool goes to the other provider meanwhile, with no error.
    got = await asyncio.gather(*(chat(rig.http, "m") for _ in range(6)))
    assert {r.status_code for r in got} == {200} and {r.headers["x-iop-provider"] for r in got} == {"fast"}
    # A passing qualification does not undo an operator's drain; enable does.
    await rig.http.put("/admin/qualify/results/slow", content=_report("slow", "pass"), headers=ADMIN_AUTH)
    assert rig.h.edge.lifecycle.drains["slow"].by == "operator"
    r = await rig.http.post("/admin/providers/slow/enable", headers=ADMIN_AUTH)
    assert r.status_code == 200 and r.json()["drained"] is False
    await eventually(_drained("slow", rig.h, rig.second, want=False))


async def test_drain_and_enable_are_refused_with_a_client_key_or_for_an_unknown_provider(rig: Rig) -> None:
    for path in ("/admin/providers/fast/drain", "/admin/providers/fast/enable"):
        r = await rig.http.post(path, headers=as_client())
        assert r.status_code == 403, (path, r.text)
        r = await rig.http.post(path)
        assert r.status_code == 401, (path, r.text)
    assert not rig.h.edge.scheduler.providers["fast"].drained
    r = await rig.http.post("/admin/providers/nobody/drain", headers=ADMIN_AUTH)
    assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_provider"
    r = await rig.http.post("/admin/providers/fast/drain", content=b'{"why": 1}', headers=ADMIN_AUTH)
    assert r.status_code == 400
    assert not rig.h.edge.scheduler.providers["fast"].drained


def _report(provider: str, status: str) -> bytes:
    """The parts of a qualification report the edge reads (`iop qualify` sends the whole one)."""
    return (
        f'{{"provider": "{provider}", "summary": {{"date": "2026-12-01T00:00:00Z", "verdict": "test"}},'
        f' "checks": [{{"id": "chat_stream", "group": "protocol", "status": "{status}"}}]}}'
    ).encode()


def _measured(rig: Rig, *providers: str) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return all(rig.h.edge.scheduler.router.figures.get(p) is not None for p in providers)

    return check


def _drained(provider: str, *edges: EdgeHandle, want: bool = True) -> Callable[[], Awaitable[bool]]:
    """Whether every one of `edges` holds `provider` out of its pools (`want`), or has it back."""

    async def check() -> bool:
        return all(e.edge.scheduler.providers[provider].drained is want for e in edges)

    return check


async def test_cli_provider_drain_and_enable(rig: Rig) -> None:
    async def iop(*args: str) -> tuple[int, str]:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "iop",
            "provider",
            *args,
            "--edge",
            rig.h.url,
            "--admin-key",
            ADMIN,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        out, _ = await asyncio.wait_for(proc.communicate(), 30)
        return proc.returncode or 0, out.decode()

    assert await iop("drain", "good", "--reason", "disk swap") == (0, "good: drained (disk swap)\n")
    assert rig.h.edge.lifecycle.drains["good"].reason == "disk swap"
    enabled, refused = await asyncio.gather(iop("enable", "good"), iop("drain", "nobody"))
    assert enabled == (0, "good: back in its pools\n")
    code, out = refused
    assert code != 0 and out.count("\n") == 1 and "nobody" in out and "Traceback" not in out
