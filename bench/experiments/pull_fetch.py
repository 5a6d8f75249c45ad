"""How a provider's fetch loops share JetStream pull subscriptions decides how busy its slots stay.

    python -m bench.experiments.pull_fetch [--capacity 4] [--service-ms 50] [--items 300]

A nats-server of our own, a work-queue stream and one consumer with max_ack_pending = capacity,
served by `capacity` loops of fetch(batch=1) as an iop node serves a provider. Like iop's edge
(late binding), the publisher sends the next item only when one finished, so the stream holds no
backlog: every slot handover is ack → finish → publish → deliver to a waiting pull. Run once with
every loop on one shared pull subscription and once with a subscription per loop; prints the mean
number of busy slots and how long each fetch waited for its item.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import nats
import nats.errors
from nats.js import api

from bench.experiments.bare_nats import bare_nats
from bench.load import percentiles


async def trial(url: str, shared: bool, capacity: int, service_s: float, items: int) -> dict[str, object]:
    nc_node, nc_edge = await nats.connect(url), await nats.connect(url)
    js_node, js_edge = nc_node.jetstream(), nc_edge.jetstream()
    stream = f"W{int(shared)}"
    await js_edge.add_stream(
        api.StreamConfig(name=stream, subjects=[f"{stream}.>"], retention=api.RetentionPolicy.WORK_QUEUE)
    )
    await js_edge.add_consumer(
        stream,
        api.ConsumerConfig(
            durable_name="p",
            filter_subject=f"{stream}.p",
            ack_policy=api.AckPolicy.EXPLICIT,
            max_ack_pending=capacity,
            ack_wait=30,
        ),
    )
    count = 1 if shared else capacity
    subs = [await js_node.pull_subscribe_bind(durable="p", stream=stream) for _ in range(count)]
    sent = done = busy = 0
    busy_area = 0.0
    last = time.monotonic()
    waits_ms: list[float] = []
    finished = asyncio.Event()

    def level(delta: int) -> None:
        nonlocal busy, busy_area, last
        now = time.monotonic()
        busy_area += busy * (now - last)
        last, busy = now, busy + delta

    async def publish() -> None:
        nonlocal sent
        if sent < items:
            sent += 1
            await js_edge.publish(f"{stream}.p", b"work")

    async def on_done(msg: object) -> None:
        await publish()  # the edge dispatches the next request when it hears one finished

    await nc_edge.subscribe(f"{stream}.done", cb=on_done)

    async def loop(i: int) -> None:
        nonlocal done
        psub = subs[i % count]
        while done < items:
            t0 = time.monotonic()
            try:
                msgs = await psub.fetch(1, timeout=1.0)
            except (nats.errors.TimeoutError, TimeoutError):
                continue
            waits_ms.append((time.monotonic() - t0) * 1000)
            for m in msgs:
                level(1)
                await asyncio.sleep(service_s)
                level(-1)
                await m.ack()
                await nc_node.publish(f"{stream}.done", b"")
                done += 1
        finished.set()

    loops = [asyncio.create_task(loop(i)) for i in range(capacity)]
    t0 = time.monotonic()
    for _ in range(capacity):
        await publish()
    try:
        await asyncio.wait_for(finished.wait(), timeout=items * service_s * 4 + 30)
    finally:
        wall = time.monotonic() - t0
        # The loops end on their own within a fetch timeout once all items are done (no cancel:
        # a cancelled fetch leaves its pull request at the server).
        await asyncio.wait(loops, timeout=3)
        for t in loops:
            t.cancel()
        await nc_node.close()
        await nc_edge.close()
    return {
        "subscriptions": "one shared by all loops" if shared else "one per loop",
        "items_per_s": round(done / wall, 1),
        "ideal_per_s": round(capacity / service_s, 1),
        "mean_busy_slots": round(busy_area / wall, 2),
        "fetch_wait_ms": percentiles(waits_ms),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--capacity", type=int, default=4)
    ap.add_argument("--service-ms", type=float, default=50.0)
    ap.add_argument("--items", type=int, default=300)
    a = ap.parse_args(argv)
    with bare_nats("iop-pull-") as url:
        for shared in (True, False):
            r = asyncio.run(trial(url, shared, a.capacity, a.service_ms / 1000, a.items))
            w = r["fetch_wait_ms"]
            assert isinstance(w, dict)
            print(
                f"{r['subscriptions']:<24} {r['items_per_s']:>6} items/s (ideal {r['ideal_per_s']}),"
                f" busy slots {r['mean_busy_slots']} of {a.capacity},"
                f" fetch wait p50 {w['p50']:.1f} ms p90 {w['p90']:.1f} ms"
            )


if __name__ == "__main__":
    main()
