"""A tenant's max_concurrent and rpm through three `iop edge` processes; cancels and a SIGKILLed edge leak nothing."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec
import nats.js.errors

from iop.edge.leases import LEASES_BUCKET, TTL_S, Share, lease_key
from iop.nats import connection
from iop.nats.server import EmbeddedNats
from tests.fakes import serve_asgi
from tests.harness import IopProcess, deployment, edge_process, eventually, running_node

YAML = """
edge:
  api_keys_env: IOP_TEST_KEYS
  queue: {timeout_s: 60, max_waiting: 500}
  nats: {url: "NATS"}
  tenants:
    conc: {max_concurrent: 3}
    rate: {rpm: 10}
models:
  - {alias: m, pool: [p]}
  - {alias: r, pool: [q]}
nodes:
  - id: n
    adapters:
      - {id: up, type: openai, base_url: "URL", api: both}
      - {id: mk, type: mock, latency_ms: 0, tokens: 2, token_interval_ms: 0}
    providers: [{id: p, adapter: up, capacity: 20}, {id: q, adapter: mk, capacity: 50}]
"""
KEYS = {"IOP_TEST_KEYS": "conc:kc,rate:kr"}


@dataclass
class HeldUpstream:
    """An OpenAI upstream that holds every request until `gate` opens or its caller hangs up, and
    counts what it holds: a request the node stops (its edge died) is no longer counted."""

    gate: asyncio.Event = field(default_factory=asyncio.Event)
    in_flight: int = 0
    peak: int = 0
    total: int = 0
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        self.in_flight += 1
        self.total += 1
        self.peak = max(self.peak, self.in_flight)
        self.changed.set()
        opened = asyncio.ensure_future(self.gate.wait())
        hung_up = asyncio.ensure_future(receive())  # the next event is the disconnect
        try:
            await asyncio.wait([opened, hung_up], return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.in_flight -= 1
            self.changed.set()
            for f in (opened, hung_up):
                f.cancel()
        if not opened.done() or opened.cancelled():
            return
        body = json.dumps(
            {
                "id": "c1",
                "object": "chat.completion",
                "model": "m",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
            }
        ).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})

    async def until(self, check: Any, timeout_s: float) -> None:
        async with asyncio.timeout(timeout_s):
            while not check():
                self.changed.clear()
                await self.changed.wait()


@asynccontextmanager
async def edges_running(cfg: Path, url: str, n: int) -> AsyncIterator[list[tuple[IopProcess, str, str]]]:
    """`n` edge processes: (process, base URL, edge id)."""
    async with AsyncExitStack() as stack:
        out = []
        for _ in range(n):
            proc, base = await stack.enter_async_context(edge_process(cfg, url, env=KEYS))
            edge_id = (await proc.wait_line(r"iop edge (\S+) serving")).group(1)
            out.append((proc, base, edge_id))
        yield out


def chat(model: str, i: int) -> dict[str, object]:
    return {"model": model, "messages": [{"role": "user", "content": f"q{i}"}]}


async def test_limits_hold_through_three_edge_processes_and_a_sigkilled_edges_share_returns(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    up = HeldUpstream()
    async with serve_asgi(up) as up_url, AsyncExitStack() as stack:
        text = YAML.replace("URL", up_url + "/v1").replace("NATS", nats_server.url)
        cfg = tmp_path / "iop.yaml"
        cfg.write_text(text)
        edges = await stack.enter_async_context(edges_running(cfg, nats_server.url, 3))
        await stack.enter_async_context(running_node(deployment(text), "n", nats_server.url))
        clients = [
            await stack.enter_async_context(httpx.AsyncClient(base_url=base, timeout=90)) for _, base, _ in edges
        ]
        nc = await connection.connect(nats_server.url, "test-reader")
        stack.push_async_callback(nc.close)
        kv = await nc.jetstream().key_value(LEASES_BUCKET)

        async def shares() -> dict[str, Share]:
            try:
                entry = await kv.get(lease_key("m", "conc"))
            except nats.js.errors.KeyNotFoundError:
                return {}
            return msgspec.msgpack.decode(entry.value or b"", type=dict[str, Share])

        async def all_see_the_node() -> bool:
            for http in clients:
                r = await http.get("/v1/models", headers={"authorization": "Bearer kc"})
                if r.status_code != 200:
                    return False
            for http in clients:
                st = (await http.get("/status", headers={"authorization": "Bearer kc"})).json()
                if not all(node["connected"] for node in st["nodes"]):
                    return False
            return True

        await eventually(all_see_the_node, timeout_s=20, every_s=0.1)

        # rpm: 30 requests at once through the three edges; the window admits exactly 10.
        rated = await asyncio.gather(
            *(
                clients[i % 3].post("/v1/chat/completions", json=chat("r", i), headers={"authorization": "Bearer kr"})
                for i in range(30)
            )
        )
        codes = sorted(r.status_code for r in rated)
        assert codes == [200] * 10 + [429] * 20, codes

        # max_concurrent: six requests on each edge, three run at a time, the rest wait (none refused).
        def send(i: int) -> asyncio.Task[httpx.Response]:
            return asyncio.create_task(
                clients[i % 3].post("/v1/chat/completions", json=chat("m", i), headers={"authorization": "Bearer kc"})
            )

        tasks = {i: send(i) for i in range(18)}
        await up.until(lambda: up.in_flight == 3, timeout_s=15)
        held = await shares()
        assert sum(s.held for s in held.values()) == 3, held
        victim = next(k for k, (_, _, edge_id) in enumerate(edges) if held.get(edge_id, Share(0, 0, 0)).held)
        others = [k for k in range(3) if k != victim]
        # The last two requests sent to another edge are cancelled (their clients hang up).
        cancelled = [i for i in tasks if i % 3 == others[0]][-2:]
        for i in cancelled:
            tasks[i].cancel()
        edges[victim][0].kill()  # SIGKILL, by its pid
        killed_at = time.monotonic()
        # Its requests stop on the node (the edge no longer answers its probes), then its units expire
        # and the other edges' waiters run: three again, never more.
        await up.until(lambda: up.in_flight < 3, timeout_s=15)
        await up.until(lambda: up.in_flight == 3, timeout_s=TTL_S + 10)
        returned_s = time.monotonic() - killed_at
        assert up.peak == 3
        up.gate.set()
        live = [i for i in tasks if i % 3 != victim and i not in cancelled]
        answers = [await tasks[i] for i in live]
        assert [r.status_code for r in answers] == [200] * len(live)
        for i in [*cancelled, *(i for i in tasks if i % 3 == victim)]:
            with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
                await tasks[i]
        assert up.peak == 3

        # Nothing left taken: the live edges give their units back, the dead one's entry has expired.
        async def nothing_held() -> bool:
            now = time.time()
            return all(s.held == 0 or s.expires < now for s in (await shares()).values())

        await eventually(nothing_held, timeout_s=10, every_s=0.1)
        up.gate.clear()
        again = [send(99 + 3 * k + others[1]) for k in range(4)]  # all on one live edge (99 % 3 == 0)
        await up.until(lambda: up.in_flight == 3, timeout_s=10)
        up.gate.set()
        assert [(await t).status_code for t in again] == [200] * 4
        assert up.peak == 3
        print(f"\nrpm: 10 of 30 admitted; max_concurrent 3 held; a SIGKILLed edge's units back in {returned_s:.1f}s")
