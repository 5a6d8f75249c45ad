"""The NATS server restarts (same port, same file store) while requests run and wait."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import nats
from nats.js import JetStreamContext

from iop.edge.registry import LOST_AFTER_S
from iop.nats.server import EmbeddedNats
from tests.fakes import fake_upstream
from tests.harness import (
    broker_counts,
    deployment,
    eventually,
    one_provider_yaml,
    stream_messages,
    two_edges,
    until,
)


def ask(content: str) -> dict[str, object]:
    return {"model": "m", "messages": [{"role": "user", "content": content}]}


async def test_nats_restart_waiting_requests_are_served_once(tmp_path: Path) -> None:
    store = tmp_path / "nats"
    server = EmbeddedNats("127.0.0.1:0", store, lock=False)
    await server.start()
    url = server.url
    gate = asyncio.Event()
    try:
        async with fake_upstream(gate=gate) as up:
            dep = deployment(one_provider_yaml(up.url))
            async with two_edges(dep, url) as (h1, h2, http1, http2):
                # r1 runs (held by the upstream); r2, sent by a second edge, waits in the broker's
                # file store; r3 and r4 wait in the first edge's queue.
                running = {"r1": asyncio.create_task(http1.post("/v1/chat/completions", json=ask("r1")))}
                await up.wait_for(lambda u: u.in_flight == 1)
                running["r2"] = asyncio.create_task(http2.post("/v1/chat/completions", json=ask("r2")))
                nc = await nats.connect(url)
                js = nc.jetstream()
                await eventually(lambda: _counts_are(js, (1, 1)))
                await nc.close()
                for name in ("r3", "r4"):
                    running[name] = asyncio.create_task(http1.post("/v1/chat/completions", json=ask(name)))
                pool = h1.edge.scheduler.pools["m"]
                await until(lambda: len(pool.waiters) + pool.standing == 2, h1.edge.scheduler.changed)

                await server.stop()
                down = time.monotonic()
                # One more arrives while NATS is down.
                running["r5"] = asyncio.create_task(http1.post("/v1/chat/completions", json=ask("r5")))
                await until(lambda: len(pool.waiters) + pool.standing == 3, h1.edge.scheduler.changed)
                # The fault's length, not a synchronisation: down for longer than the edge's
                # heartbeat timeout, so missing heartbeats must not be taken for lost nodes.
                await asyncio.sleep(LOST_AFTER_S + 0.5)
                server = EmbeddedNats(server.address.removeprefix("nats://"), store, lock=False)
                await server.start()
                up_again = time.time()
                restarted = time.monotonic()
                # Edges and node reconnect by themselves; each edge hears the node again.
                for h in (h1, h2):
                    reg = h.edge.registry
                    st = reg.nodes["n"]
                    await until(lambda st=st: st.connected and (st.last_seen or 0) > up_again, reg.changed)  # type: ignore[misc]
                    assert h.edge.nc.stats["reconnects"] == 1
                back_s = time.monotonic() - restarted
                down_s = restarted - down
                gate.set()
                answers = {name: await task for name, task in running.items()}
            nc = await nats.connect(url)
            js = nc.jetstream()
            try:
                assert await broker_counts(js, "p") == (0, 0)
                assert await stream_messages(js) == 0
            finally:
                await nc.close()
        # Every request was served, and each reached the upstream exactly once.
        assert {name: a.status_code for name, a in answers.items()} == dict.fromkeys(running, 200)
        seen = sorted(m["content"] for b in up.bodies for m in b["messages"])
        assert seen == ["r1", "r2", "r3", "r4", "r5"]
    finally:
        gate.set()
        await server.stop()
    print(f"\nNATS restart: down {down_s:.2f}s; edges heard the node again {back_s:.2f}s after it was back")


async def _counts_are(js: JetStreamContext, want: tuple[int, int]) -> bool:
    return await broker_counts(js, "p") == want
