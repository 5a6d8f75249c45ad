"""The edge hands back the memory of a burst of waiting requests once the burst has drained."""

from __future__ import annotations

import asyncio
import gc
import json
import platform

import httpx

from iop.edge import memory
from iop.edge.memory import BurstTrim
from iop.edge.scheduler import Scheduler
from iop.nats.server import EmbeddedNats
from tests.harness import deployment, deployment_running, until


async def test_a_drained_burst_of_waiting_requests_is_trimmed_once() -> None:
    s = Scheduler(max_waiting=1000)
    s.add_provider("p", "n", 1)
    s.set_connected("p", True)
    s.add_pool("m", ["p"])
    trim = BurstTrim(lambda: s.waiting("m"), s.queued_high, burst=200, settle_s=0.05, poll_s=0.02)
    trim.start()
    try:
        loop = asyncio.get_running_loop()
        held = await s.acquire_grant("m", loop.time() + 30)
        waiters = [asyncio.create_task(s.acquire_grant("m", loop.time() + 30)) for _ in range(300)]
        async with asyncio.timeout(5):
            while s.waiting("m") < 300:
                s.changed.clear()
                await s.changed.wait()
        assert trim.trims == 0  # waiting, not drained
        for w in waiters:
            w.cancel()  # the clients leave
        await asyncio.gather(*waiters, return_exceptions=True)
        assert s.waiting("m") == 0
        await asyncio.wait_for(trim.trimmed.wait(), 5)
        assert trim.trims == 1
        s.release(held.slot, held)
    finally:
        trim.stop()


async def test_a_burst_that_came_and_went_between_two_reads_is_trimmed() -> None:
    # The count is read every poll, not on every change: its high-water mark keeps the burst.
    high = memory.HighWater()
    trim = BurstTrim(lambda: 0, high, burst=200, settle_s=0.01, poll_s=0.01)
    high.saw(150)
    high.saw(250)
    trim.start()
    try:
        await asyncio.wait_for(trim.trimmed.wait(), 5)
        assert trim.trims == 1 and high.mark == 0
    finally:
        trim.stop()


def test_give_back_trims_the_heap_where_glibc_is() -> None:
    glibc = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
    assert memory.give_back() is glibc
    rss = memory.rss_bytes()
    assert rss is None or rss > 0


MIB = 1024 * 1024


async def test_bodies_being_received_share_the_waiting_budget_and_their_memory_is_given_back(
    nats_server: EmbeddedNats,
) -> None:
    dep = deployment(
        "edge: {queue: {max_waiting_mb: 40}}\nmodels: [{alias: m, pool: [p]}]\n"
        "nodes: [{id: n, adapters: [{id: s, type: mock, latency_ms: 0}],"
        " providers: [{id: p, adapter: s, capacity: 4}]}]"
    )
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * (16 * MIB)}]}).encode()
    async with deployment_running(dep, nats_server.url) as h:
        host, port = h.url.removeprefix("http://").rsplit(":", 1)
        bodies = h.edge.bodies
        head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        head += b"content-length: %d\r\n\r\n" % len(body)
        slow = []
        for _ in range(2):  # two slow uploads, 15 MiB of 16 sent: 30 MiB being received
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(head + body[: 15 * MIB])
            slow.append((reader, writer))
        await until(lambda: bodies.bytes >= 30 * MIB - 256 * 1024, bodies.changed, timeout_s=20)
        # A third cannot fit 40 MiB with them: refused as it arrives, in the API's shape, not kept.
        async with httpx.AsyncClient(base_url=h.url, timeout=20) as http:
            r = await http.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "bodies_over_budget", r.text
        assert r.headers["retry-after"] == "1"
        assert bodies.bytes < 31 * MIB
        trims = h.edge.body_trim.trims
        for reader, writer in slow:  # the slow ones finish, and are served
            writer.write(body[15 * MIB :])
            async with asyncio.timeout(20):
                status = (await reader.readline()).split()[1]
            assert status == b"200"
            writer.close()
        await until(lambda: bodies.bytes == 0, bodies.changed)
        # The burst drained: its memory goes back to the OS once.
        await until(lambda: h.edge.body_trim.trims > trims, h.edge.body_trim.trimmed, timeout_s=10)


async def test_a_served_request_leaves_no_reference_cycle_of_iop_or_uvicorn(nats_server: EmbeddedNats) -> None:
    # A request's objects go when it ends, by reference count: a cycle among them waits for the
    # collector, and with every request one the edge spent a tenth of its CPU collecting.
    dep = deployment(
        "models: [{alias: m, pool: [p]}]\n"
        "nodes: [{id: n, adapters: [{id: s, type: mock, latency_ms: 0}],"
        " providers: [{id: p, adapter: s, model: mock, capacity: 4}]}]\n"
    )
    bodies = [
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True},
    ]
    async with deployment_running(dep, nats_server.url) as h, h.http() as http:

        async def round_trip() -> None:
            for body in bodies:
                assert (await http.post("/v1/chat/completions", json=body)).status_code == 200
            for stream in (False, True):
                r = await http.post("/v1/responses", json={"model": "m", "input": "hi", "stream": stream})
                assert r.status_code == 200

        await round_trip()  # first-use caches filled before what is counted
        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            for _ in range(5):
                await round_trip()
            gc.collect()
            ours = sorted(
                {
                    f"{type(o).__module__}.{type(o).__qualname__}"
                    for o in gc.garbage
                    if type(o).__module__.startswith(("iop.", "uvicorn."))
                }
            )
        finally:
            gc.set_debug(0)
            gc.garbage.clear()  # the cycles it held are garbage again: freed here, not in a later test
            gc.collect()
    assert ours == []
