"""The floor: what any design that keeps JetStream's max_ack_pending in the path must pay.

A minimal client publishes one work item (the request body as it is) to a work-queue stream on the
same nats-server and storage iop uses; a pull consumer with `max_ack_pending = 1` fetches it, answers
on core NATS to the reply subject the item names, and acks it. The latency is publish → answer at
the client, one request at a time. No HTTP, no parsing, no iop: iop's added latency above this is
what iop itself costs.

    python -m bench.floor --nats nats://127.0.0.1:4222 --size 800000 -n 20
    python -m bench.floor -c 1 -c 32 [--seconds 5]   rate and latency at each concurrency, on a
                                                   nats-server of its own (file store, as the edge's)

At a concurrency c, c clients each keep one item in flight and c pull loops (each its own pull
subscription, as an iop node's slots) serve a consumer with `max_ack_pending = c`: the floor's
own c=32 rate is what iop's c=32 throughput is judged against.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import nats
import nats.js.api as js_api

from bench import fixtures, load
from bench.procs import Owned, Proc, free_port, wait_until
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


async def measure_rate(
    url: str, body: bytes, concurrency: int, seconds: float, *, server_cpu: Callable[[], float] | None = None
) -> dict[str, Any]:
    """`concurrency` clients in a closed loop for `seconds` (after a warm-up): req/s, latency, CPU-ms per request."""
    client = await nats.connect(url, name="bench-floor-client", max_reconnect_attempts=0)
    worker = await nats.connect(url, name="bench-floor-worker", max_reconnect_attempts=0)
    js = client.jetstream()
    stream = f"{STREAM}_C{concurrency}"
    subject = f"{SUBJECT}.c{concurrency}"
    try:
        await js.add_stream(
            name=stream, subjects=[subject], retention=js_api.RetentionPolicy.WORK_QUEUE, max_msg_size=MAX_PAYLOAD
        )
        await js.add_consumer(
            stream,
            js_api.ConsumerConfig(
                durable_name="floor",
                ack_policy=js_api.AckPolicy.EXPLICIT,
                max_ack_pending=concurrency,
                filter_subject=subject,
            ),
        )
        stop = asyncio.Event()

        async def serve() -> None:
            psub = await worker.jetstream().pull_subscribe_bind("floor", stream)
            while not stop.is_set():
                try:
                    msgs = await psub.fetch(1, timeout=0.5)
                except TimeoutError:
                    continue
                for m in msgs:
                    assert m.headers is not None
                    await m.ack()
                    await worker.publish(m.headers["reply-to"], ANSWER)

        measuring = False
        ms: list[float] = []
        done = 0

        async def ask() -> None:
            nonlocal done
            inbox = client.new_inbox()
            answers: asyncio.Queue[bytes] = asyncio.Queue()

            async def on_answer(msg: Any) -> None:
                answers.put_nowait(msg.data)

            await client.subscribe(inbox, cb=on_answer)
            while not stop.is_set():
                t0 = time.perf_counter()
                await js.publish(subject, body, headers={"reply-to": inbox})
                await asyncio.wait_for(answers.get(), 10)
                if measuring:
                    ms.append(1000 * (time.perf_counter() - t0))
                    done += 1

        tasks = [asyncio.create_task(serve()) for _ in range(concurrency)]
        tasks += [asyncio.create_task(ask()) for _ in range(concurrency)]
        await asyncio.sleep(min(1.0, seconds / 3))  # warm-up: the loops run meanwhile, unmeasured
        measuring = True
        cpu0, server0, t0 = time.process_time(), server_cpu() if server_cpu else 0.0, time.perf_counter()
        await asyncio.sleep(seconds)  # the measured window: the closed loops run meanwhile
        wall, n = time.perf_counter() - t0, max(1, done)
        cpu = {"client+worker": round(1000 * (time.process_time() - cpu0) / n, 3)}
        if server_cpu is not None:
            cpu["nats"] = round(1000 * (server_cpu() - server0) / n, 3)
        measuring = False
        stop.set()
        await asyncio.wait(tasks, timeout=15)
        return {
            "concurrency": concurrency,
            "requests": done,
            "rps": round(done / wall, 1),
            "latency_ms": load.percentiles(ms),
            "cpu_ms_per_request": cpu,
        }
    finally:
        try:
            await js.delete_stream(stream)
        finally:
            await worker.close()
            await client.close()


def run_rates(
    url: str, body: bytes, concurrencies: list[int], seconds: float, server_cpu: Callable[[], float] | None = None
) -> dict[str, dict[str, Any]]:
    async def go() -> dict[str, dict[str, Any]]:
        return {str(c): await measure_rate(url, body, c, seconds, server_cpu=server_cpu) for c in concurrencies}

    with asyncio.Runner(loop_factory=load.loop_factory()) as runner:
        return runner.run(go())


def run(
    url: str, bodies: dict[str, bytes], n: int, *, memory: bool = False, server_cpu: Callable[[], float] | None = None
) -> dict[str, dict[str, Any]]:
    with asyncio.Runner(loop_factory=load.loop_factory()) as runner:
        return runner.run(measure(url, bodies, n, memory=memory, server_cpu=server_cpu))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nats", default=None, help="a nats-server's URL (default: start one of its own)")
    ap.add_argument("--size", type=int, action="append", default=None, help="body bytes (repeatable)")
    ap.add_argument("-n", type=int, default=20)
    ap.add_argument("-c", "--concurrency", type=int, action="append", default=None, help="rate at c (repeatable)")
    ap.add_argument("--seconds", type=float, default=5.0, help="measured seconds per concurrency")
    ap.add_argument("--memory", action="store_true", help="a memory stream instead of a file stream")
    a = ap.parse_args(argv)
    if a.nats is None:
        with tempfile.TemporaryDirectory(prefix="iop-bench-floor-") as tmp:
            owned = Owned(Path(tmp))
            try:
                proc, url = start_server(owned, Path(tmp))
                _main(a, url, proc.cpu_s)
            finally:
                owned.stop_all()
    else:
        _main(a, a.nats, None)


def _main(a: argparse.Namespace, url: str, server_cpu: Callable[[], float] | None) -> None:
    if a.concurrency:
        body = fixtures.body("chat", "fake-model", (a.size or [1000])[0], False)
        print(json.dumps(run_rates(url, body, a.concurrency, a.seconds, server_cpu), indent=1))
        return
    bodies = {str(s): b"x" * s for s in a.size or [1000]}
    print(json.dumps(run(url, bodies, a.n, memory=a.memory, server_cpu=server_cpu), indent=1))


def start_server(owned: Owned, workdir: Path) -> tuple[Proc, str]:
    """A nats-server of the floor's own, configured and stored as the edge's embedded one; Go's
    runtime at its defaults (the edge sets GOGC and GOMAXPROCS for its own, iop/nats/goruntime.py),
    so that the floor stays the yardstick it has been in every run recorded."""
    from iop.nats.bundle import nats_server_path

    port = free_port()
    conf = workdir / "floor-nats.conf"
    store = workdir / "floor-nats"
    conf.write_text(
        f'host: "127.0.0.1"\nport: {port}\nmax_payload: {MAX_PAYLOAD}\njetstream {{ store_dir: "{store}" }}\n'
    )
    proc = owned.start("floor-nats", [nats_server_path(), "-c", str(conf)])
    wait_until("floor nats-server", lambda: _listening(port), 15, [proc])
    return proc, f"nats://127.0.0.1:{port}"


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


if __name__ == "__main__":
    main()
