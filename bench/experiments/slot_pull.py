"""CPU of one pulled message: nats-py's `fetch(1)` against a slot's own pull (iop/node/pull.py).

    python -m bench.experiments.slot_pull [--messages 3000] [--rounds 3]

A nats-server of our own (memory stream), N messages published first, then one loop pulls them
one at a time and acks each: this process's CPU-µs per message, the two arms alternated every
round (fetch first in even rounds). Only the pull differs; nats-server's CPU is not counted.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from collections.abc import Awaitable, Callable

import nats
import nats.js.api as js_api
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from bench.experiments.bare_nats import bare_nats
from iop.node.pull import SlotPull

STREAM, SUBJECT, DURABLE = "SLOTPULL", "slotpull.work", "d"


async def arm(nc: NATS, kind: str, messages: int) -> tuple[float, float]:
    """(CPU-µs, wall-µs) per message pulled and acked by one loop of `kind`."""
    get: Callable[[], Awaitable[Msg | None]]
    if kind == "fetch":
        psub = await nc.jetstream().pull_subscribe_bind(durable=DURABLE, stream=STREAM)

        async def fetch_one() -> Msg | None:
            return (await psub.fetch(1, timeout=1.0))[0]

        get, close = fetch_one, psub.unsubscribe
    else:
        slot = SlotPull(nc, STREAM, DURABLE, 1.0)
        await slot.open()
        get, close = slot.next, slot.close
    for _ in range(messages):
        await nc.publish(SUBJECT, b"x" * 200)
    await nc.flush()
    cpu0, t0 = time.process_time(), time.perf_counter()
    for _ in range(messages):
        m = await get()
        assert m is not None
        await m.ack()
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
    await close()
    return 1e6 * cpu / messages, 1e6 * wall / messages


async def trials(url: str, messages: int, rounds: int) -> None:
    nc = await nats.connect(url)
    js = nc.jetstream()
    await js.add_stream(
        name=STREAM,
        subjects=[SUBJECT],
        retention=js_api.RetentionPolicy.WORK_QUEUE,
        storage=js_api.StorageType.MEMORY,
    )
    await js.add_consumer(
        STREAM,
        js_api.ConsumerConfig(
            durable_name=DURABLE,
            ack_policy=js_api.AckPolicy.EXPLICIT,
            max_ack_pending=messages,
            filter_subject=SUBJECT,
        ),
    )
    try:
        for r in range(rounds):
            for kind in ("fetch", "slot") if r % 2 == 0 else ("slot", "fetch"):
                cpu_us, wall_us = await arm(nc, kind, messages)
                print(
                    f"round {r} {kind:<5} {cpu_us:6.1f} CPU-µs/message  {wall_us:6.1f} µs wall"
                    f"  (load average {os.getloadavg()[0]:.2f})",
                    flush=True,
                )
    finally:
        await nc.close()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args(argv)
    with bare_nats("iop-slotpull-") as url:
        asyncio.run(trials(url, a.messages, a.rounds))


if __name__ == "__main__":
    main()
