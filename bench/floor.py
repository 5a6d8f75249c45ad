"""The floor: what any design that keeps JetStream's max_ack_pending in the path must pay.

A minimal client publishes one work item (the request body as it is) to a work-queue stream on the
same nats-server and storage iop uses; a pull consumer with `max_ack_pending = 1` fetches it, answers
on core NATS to the reply subject the item names, and acks it. The latency is publish → answer at
the client, one request at a time. No HTTP, no parsing, no iop: iop's added latency above this is
what iop itself costs.

    python -m bench.floor --nats nats://127.0.0.1:4222 --size 800000 -n 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import nats
import nats.js.api as js_api

from bench import load
from iop.nats.server import MAX_PAYLOAD

STREAM = "BENCH_FLOOR"
SUBJECT = "benchfloor.work"
ANSWER = b'{"id":"chatcmpl-floor","object":"chat.completion","choices":[]}'


async def measure(
    url: str, bodies: dict[str, bytes], n: int, *, memory: bool = False, server_cpu: Callable[[], float] | None = None
) -> dict[str, dict[str, Any]]:
    """Per body name: latency percentiles (ms) of `n` publish → answer round trips, after 3 warm ones,
    and the CPU-ms per round trip of this process (client and worker) and of the server (`server_cpu`)."""
    client = await nats.connect(url, name="bench-floor-client", max_reconnect_attempts=0)
    worker = await nats.connect(url, name="bench-floor-worker", max_reconnect_attempts=0)
    js = client.jetstream()
    out: dict[str, dict[str, Any]] = {}
    try:
        storage = js_api.StorageType.MEMORY if memory else js_api.StorageType.FILE
        await js.add_stream(
            name=STREAM,
            subjects=[SUBJECT],
            retention=js_api.RetentionPolicy.WORK_QUEUE,
            storage=storage,
            max_msg_size=MAX_PAYLOAD,
        )
        await js.add_consumer(
            STREAM,
            js_api.ConsumerConfig(
                durable_name="floor",
                ack_policy=js_api.AckPolicy.EXPLICIT,
                max_ack_pending=1,
                filter_subject=SUBJECT,
            ),
        )
        psub = await worker.jetstream().pull_subscribe_bind("floor", STREAM)
        stop = asyncio.Event()

        async def serve() -> None:
            while not stop.is_set():
                try:
                    msgs = await psub.fetch(1, timeout=1.0)
                except TimeoutError:
                    continue
                for m in msgs:
                    assert m.headers is not None
                    await worker.publish(m.headers["reply-to"], ANSWER)
                    await m.ack()

        server = asyncio.create_task(serve())
        inbox = client.new_inbox()
        answers: asyncio.Queue[bytes] = asyncio.Queue()

        async def on_answer(msg: Any) -> None:
            answers.put_nowait(msg.data)

        await client.subscribe(inbox, cb=on_answer)
        for name, body in bodies.items():
            ms: list[float] = []
            cpu0 = server0 = 0.0
            for i in range(n + 3):
                if i == 3:
                    cpu0, server0 = time.process_time(), server_cpu() if server_cpu else 0.0
                t0 = time.perf_counter()
                await js.publish(SUBJECT, body, headers={"reply-to": inbox})
                await asyncio.wait_for(answers.get(), 10)
                if i >= 3:
                    ms.append(1000 * (time.perf_counter() - t0))
            cpu = {"client+worker": round(1000 * (time.process_time() - cpu0) / n, 3)}
            if server_cpu is not None:
                cpu["nats"] = round(1000 * (server_cpu() - server0) / n, 3)
            out[name] = {"latency_ms": load.percentiles(ms), "bytes": len(body), "cpu_ms_per_request": cpu}
        stop.set()
        await server
    finally:
        try:
            await js.delete_stream(STREAM)
        finally:
            await worker.close()
            await client.close()
    return out


def run(
    url: str, bodies: dict[str, bytes], n: int, *, memory: bool = False, server_cpu: Callable[[], float] | None = None
) -> dict[str, dict[str, Any]]:
    with asyncio.Runner(loop_factory=load.loop_factory()) as runner:
        return runner.run(measure(url, bodies, n, memory=memory, server_cpu=server_cpu))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nats", required=True)
    ap.add_argument("--size", type=int, action="append", default=None, help="body bytes (repeatable)")
    ap.add_argument("-n", type=int, default=20)
    ap.add_argument("--memory", action="store_true", help="a memory stream instead of a file stream")
    a = ap.parse_args(argv)
    bodies = {str(s): b"x" * s for s in a.size or [1000]}
    print(json.dumps(run(a.nats, bodies, a.n, memory=a.memory), indent=1))


if __name__ == "__main__":
    main()
