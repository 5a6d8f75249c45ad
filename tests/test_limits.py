"""Tenants' rpm, tpm and budgets: the window arithmetic, then real edges sharing one NATS."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path

import httpx
import nats.js.errors
import pytest
import pytest_asyncio

from iop.edge.keys import EdgeKeys, Key
from iop.edge.limits import LIMITS_BUCKET, Admission, Limiter, estimate_tokens, tenant_key
from iop.edge.tenants import PoolLimits, Tenant, TenantPolicy
from iop.edge.window import SLOTS, TenantUse, Window, decode_use, duration
from iop.errors import RateLimited
from iop.nats import connection
from iop.nats.server import EmbeddedNats
from tests.harness import EdgeHandle, deployment, eventually, running_edge, running_node

MODULE_LOOP = pytest.mark.asyncio(loop_scope="module")


def policy(**kw: object) -> TenantPolicy:
    return TenantPolicy(**kw)  # type: ignore[arg-type]


def test_window_never_admits_more_than_rpm_in_any_window() -> None:
    w = Window(60.0)
    use, p = TenantUse(), policy(rpm=7)
    rng = random.Random(3)
    now, admitted = 1_000_000.0, []
    for _ in range(3000):
        now += rng.expovariate(1 / 2.0)  # ~30 a minute against a limit of 7
        if w.admit(use, p, "m", 0, now).refusal is None:
            admitted.append(now)
    assert len(admitted) > 7 * (now - 1_000_000) / 61 * 0.9  # the limit is used, not just kept
    for i, t in enumerate(admitted):
        assert sum(1 for u in admitted[i:] if u < t + 60) <= 7


def test_window_retry_time_is_when_the_request_is_admitted() -> None:
    w = Window(60.0)
    use, p = TenantUse(), policy(rpm=2, tpm=1000)
    t0 = 5_000_000.25
    assert w.admit(use, p, "m", 100, t0).refusal is None
    assert w.admit(use, p, "m", 100, t0 + 10).refusal is None
    refused = w.admit(use, p, "m", 100, t0 + 20)
    assert refused.refusal is not None and refused.refusal.limit == "rpm"
    retry = refused.refusal.retry_s
    assert retry is not None and 40 < retry <= 42  # t0's slot leaves 61 slots after it began
    assert w.admit(use, p, "m", 100, t0 + 20 + retry - 0.05).refusal is not None
    assert w.admit(use, p, "m", 100, t0 + 20 + retry).refusal is None
    too_big = w.admit(TenantUse(), p, "m", 1001, t0)
    assert too_big.refusal is not None and too_big.refusal.retry_s is None


def test_window_tpm_counts_tokens_and_corrections() -> None:
    w = Window(60.0)
    use, p = TenantUse(), policy(tpm=1000)
    now = 7_000_000.0
    first = w.admit(use, p, "m", 600, now)
    assert first.refusal is None and first.tokens is not None and first.tokens.remaining == 400
    over = w.admit(use, p, "m", 600, now + 1)
    assert over.refusal is not None and over.refusal.limit == "tpm"
    w.correct(use, "m", first.slot, first.day, first.month, -500, now + 1)  # it used 100
    assert w.admit(use, p, "m", 600, now + 2).refusal is None


def test_window_day_budget_resets_at_utc_midnight_and_pool_limits_apply_per_alias() -> None:
    w = Window(60.0)
    use = TenantUse()
    p = TenantPolicy(tokens_per_day=1000, pools={"big": PoolLimits(rpm=1)})
    midnight = 86400.0 * 20000
    assert w.admit(use, p, "big", 900, midnight - 100).refusal is None
    spent = w.admit(use, p, "small", 200, midnight - 90)
    assert spent.refusal is not None and spent.refusal.limit == "tokens_per_day"
    assert spent.refusal.retry_s == pytest.approx(90)
    assert w.admit(use, p, "small", 50, midnight - 80).refusal is None
    pool = w.admit(use, p, "big", 10, midnight - 70)
    assert pool.refusal is not None and pool.refusal.limit == "pool_rpm"
    assert w.admit(use, p, "big", 500, midnight + 1).refusal is None  # a new day, the pool's minute past


def test_reset_durations_read_like_openais() -> None:
    assert [duration(s) for s in (0.0172, 1.0, 1.5, 59.999, 360.0, 3725.0)] == [
        "18ms",
        "1s",
        "1.5s",
        "60s",
        "6m0s",
        "1h2m5s",
    ]


def test_token_estimate_counts_the_body_and_the_output_it_allows() -> None:
    body = b'{"model":"m","max_tokens":50,"messages":[]}'
    assert estimate_tokens(body) == -(-len(body) // 4) + 50
    assert estimate_tokens(b"not json") == 2
    assert tenant_key("ops@example.com") == "t.ops=40example.com"


async def test_two_edges_writing_one_tenants_use_lose_races_cleanly_and_never_admit_past_rpm(
    nats_server: EmbeddedNats,
) -> None:
    # Two limiters (two edges' worth) write one tenant's use back by compare-and-set, by hand
    # (not nats-py's kv.update): rounds of requests to both at once make their writes race, and
    # each lost write is read again and decided again, so the window admits exactly its rpm.
    conns = [await connection.connect(nats_server.url, f"edge-{i}") for i in range(2)]
    limiters = [Limiter(), Limiter()]
    try:
        for nc, limits in zip(conns, limiters, strict=True):
            await limits.open(nc.jetstream(), 1, nc)
        tenant = Tenant("racer", policy(rpm=50))
        admitted = refused = 0
        for _ in range(6):
            got = await asyncio.gather(
                *(limiters[i % 2].admit(tenant, "m", b"{}") for i in range(20)), return_exceptions=True
            )
            admitted += sum(isinstance(g, Admission) for g in got)
            refused += sum(isinstance(g, RateLimited) for g in got)
        assert (admitted, refused) == (50, 70)
        assert sum(lim.conflicts for lim in limiters) > 0  # the writes did race
        assert sum(lim.writes for lim in limiters) >= 3  # one creation, then updates by hand
    finally:
        for nc in conns:
            await nc.close()


# --- real edges on one NATS ------------------------------------------------------------------------

WINDOW_S = 2.0
"""The edges' window in these tests: rpm/tpm mean per WINDOW_S seconds (60 in production)."""

YAML = """
edge:
  queue: {timeout_s: 30}
  tenants:
    rate: {rpm: 5}
    toks: {tpm: 400}
    quota: {tokens_per_day: 300}
    retry: {rpm: 2}
    gone: {tpm: 1000}
models:
  - {alias: m, pool: [p1]}
  - {alias: nobody, pool: [p2]}
  - {alias: long, pool: [p3]}
nodes:
  - id: n1
    adapters:
      - {type: mock, id: mk, latency_ms: 0, tokens: 2, token_interval_ms: 0}
      - {type: mock, id: long, latency_ms: 0, tokens: 100, token_interval_ms: 0}
    providers: [{id: p1, adapter: mk, capacity: 64}, {id: p3, adapter: long, capacity: 64}]
  - id: n2
    adapters: [{type: mock, id: mk2}]
    providers: [{id: p2, adapter: mk2, capacity: 1}]
"""
KEYS = EdgeKeys(clients=[Key(n, n.encode()) for n in ("rate", "toks", "quota", "retry", "gone", "free")], admins=[])


class Edges:
    def __init__(self, handles: list[EdgeHandle], clients: list[httpx.AsyncClient]) -> None:
        self.handles = handles
        self.clients = clients
        self.admitted: list[tuple[str, int, int]] = []
        """(tenant, slot, tokens counted in the end) of every admission, any edge, once it ended."""


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def edges(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Edges]:
    server = EmbeddedNats("127.0.0.1:0", Path(tmp_path_factory.mktemp("nats")))
    await server.start()
    dep = deployment(YAML)
    try:
        async with AsyncExitStack() as stack:
            handles = [await stack.enter_async_context(running_edge(dep, server.url, KEYS)) for _ in range(3)]
            await stack.enter_async_context(running_node(dep, "n1", server.url))
            clients = [await stack.enter_async_context(h.http()) for h in handles]
            out = Edges(handles, clients)
            for h in handles:
                await h.edge.registry.wait_connected(["n1"], timeout_s=10)
                _short_window(h.edge.limits, out)
            yield out
    finally:
        await server.stop()


def _short_window(limits: Limiter, out: Edges) -> None:
    limits.window = Window(WINDOW_S)
    settle = limits.settle

    def counted(admission: Admission, used: int | None, reached_node: bool) -> None:
        final = used if used is not None else (admission.tokens if reached_node else 0)
        out.admitted.append((admission.tenant, admission.decision.slot, final))
        settle(admission, used, reached_node)

    limits.settle = counted  # type: ignore[method-assign]


def chat(model: str = "m", **kw: object) -> dict[str, object]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], **kw}


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def most_in_a_window(admitted: list[tuple[int, int]]) -> tuple[int, int]:
    """The most requests and tokens any SLOTS + 1 consecutive slots hold."""
    slots = sorted(admitted)
    most_requests = most_tokens = 0
    for start, _ in slots:
        inside = [t for s, t in slots if start <= s <= start + SLOTS]
        most_requests, most_tokens = max(most_requests, len(inside)), max(most_tokens, sum(inside))
    return most_requests, most_tokens


@MODULE_LOOP
async def test_rpm_and_tpm_hold_across_three_edges(edges: Edges) -> None:
    statuses: dict[str, list[int]] = {"rate": [], "toks": []}
    # `toks` asks for answers of 100 tokens (~120 with the prompt, as many as estimated): ~3 fit in a window.
    bodies = {"rate": chat(), "toks": chat("long", max_tokens=100)}

    async def client(i: int, key: str) -> None:
        http = edges.clients[i % 3]
        end = time.monotonic() + WINDOW_S * 2.2
        while time.monotonic() < end:
            r = await http.post("/v1/chat/completions", json=bodies[key], headers=auth(key))
            statuses[key].append(r.status_code)
            if r.status_code == 429:
                assert r.json()["error"]["code"] == "rate_limit_exceeded"
                assert r.headers["x-ratelimit-remaining-" + ("requests" if key == "rate" else "tokens")]
                await asyncio.sleep(0.01)  # pace: a client that backs off, not a busy loop

    await asyncio.gather(*(client(i, key) for i in range(6) for key in ("rate", "toks")))
    for tenant, rpm, tpm in (("rate", 5, None), ("toks", None, 400)):
        mine = [(s, t) for name, s, t in edges.admitted if name == tenant]
        requests, tokens = most_in_a_window(mine)
        print(
            f"\n{tenant}: {len(mine)} admitted of {len(statuses[tenant])} through 3 edges; most in a window: "
            f"{requests} requests, {tokens} tokens"
        )
        assert set(statuses[tenant]) == {200, 429}
        # Never over the limit, and the limit reached (a limiter refusing too much fails too).
        if rpm is not None:
            assert requests == rpm
        if tpm is not None:
            assert tpm - 130 <= tokens <= tpm
    writes = sum(h.edge.limits.writes for h in edges.handles)
    conflicts = sum(h.edge.limits.conflicts for h in edges.handles)
    print(f"KV writes {writes}, compare-and-set conflicts {conflicts}")


@MODULE_LOOP
async def test_a_refusal_says_when_to_retry_and_that_time_admits(edges: Edges) -> None:
    http = edges.clients[0]
    for _ in range(2):
        ok = await http.post("/v1/chat/completions", json=chat(), headers=auth("retry"))
        assert ok.status_code == 200
        assert ok.headers["x-ratelimit-limit-requests"] == "2"
    assert ok.headers["x-ratelimit-remaining-requests"] == "0"
    sent = time.time()
    refused = await edges.clients[1].post("/v1/chat/completions", json=chat(), headers=auth("retry"))
    answered, asked = time.time(), time.monotonic()
    assert refused.status_code == 429
    error = refused.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and error["type"] == "requests"
    reset = refused.headers["x-ratelimit-reset-requests"]
    wait = float(reset.removesuffix("ms")) / 1000 if reset.endswith("ms") else float(reset.removesuffix("s"))
    # The wait is the shared state's: when the oldest admission (made on another edge) leaves the
    # window, from the moment the refusing edge decided (between sending and the answer).
    kv = await edges.handles[0].edge.js.key_value(LIMITS_BUCKET)
    window = edges.handles[1].edge.limits.window
    oldest = min(s.at for s in decode_use((await kv.get(tenant_key("retry"))).value or b"").window)
    leaves = window.leaves_at(oldest)
    assert leaves - answered - 0.02 <= wait <= leaves - sent + 0.02
    assert int(refused.headers["retry-after"]) == max(1, -(-wait // 1))
    await asyncio.sleep(max(0.0, asked + wait - time.monotonic()))
    on_time = await edges.clients[2].post("/v1/chat/completions", json=chat(), headers=auth("retry"))
    assert on_time.status_code == 200, on_time.text
    metrics = await edges.clients[1].get("/metrics", headers=auth("free"))  # the edge that refused
    assert 'iop_limit_refusals_total{limit="rpm",tenant="retry"}' in metrics.text
    status = (await edges.clients[1].get("/status", headers=auth("free"))).json()
    retry = next(t for t in status["tenants"] if t["tenant"] == "retry")
    assert retry["rpm"] == 2 and retry["seen"]  # its window has passed by now: the counts may be 0
    unlimited = await http.post("/v1/chat/completions", json=chat(), headers=auth("free"))
    assert unlimited.status_code == 200 and "x-ratelimit-limit-requests" not in unlimited.headers


@MODULE_LOOP
async def test_a_spent_budget_is_insufficient_quota_until_midnight_on_every_edge(edges: Edges) -> None:
    body = chat(max_tokens=100)  # ~120 tokens estimated, ~22 used: the corrections make room
    refused, served = None, 0
    for i in range(40):
        r = await edges.clients[i % 3].post("/v1/chat/completions", json=body, headers=auth("quota"))
        if r.status_code == 429:
            refused = r
            break
        assert r.status_code == 200
        served += 1
    assert refused is not None and served >= 5
    assert refused.json()["error"]["code"] == "insufficient_quota"
    midnight = (time.time() // 86400 + 1) * 86400
    assert abs(int(refused.headers["retry-after"]) - (midnight - time.time())) < 5
    # Kept in the bucket, not in an edge: a limiter started now (a restarted edge) sees it spent.
    fresh = Limiter()
    await fresh.open(edges.handles[0].edge.js, 1)
    tenant = edges.handles[0].edge.tenants.get("quota")
    with pytest.raises(Exception, match="token budget spent"):
        await fresh.admit(tenant, "m", b'{"max_tokens": 100}')


@MODULE_LOOP
async def test_a_request_cancelled_before_a_node_started_it_gives_its_tokens_back(edges: Edges) -> None:
    h = edges.handles[0]
    since = h.edge.limits.window.slot(time.time())
    kv = await h.edge.js.key_value(LIMITS_BUCKET)

    async def counted(tokens: bool) -> bool:
        try:
            entry = await kv.get(tenant_key("gone"))
        except nats.js.errors.KeyNotFoundError:
            return False  # not admitted yet
        slots = [s for s in decode_use(entry.value or b"").window if s.at >= since]
        return [s.requests for s in slots] == [1] and (sum(s.tokens for s in slots) > 0) == tokens

    # p2's node never connects: the request is admitted, then waits for a node to start it.
    waiting = asyncio.create_task(
        edges.clients[0].post("/v1/chat/completions", json=chat("nobody", max_tokens=50), headers=auth("gone"))
    )
    await eventually(lambda: counted(tokens=True), timeout_s=5)
    waiting.cancel()  # the client goes away: its connection closes
    with contextlib.suppress(asyncio.CancelledError):
        await waiting
    await eventually(lambda: counted(tokens=False), timeout_s=5)
