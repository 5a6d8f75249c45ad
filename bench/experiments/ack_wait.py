"""What a bounded wait costs on the event loop edge and node run, the ways iop has bounded one.

    python -m bench.experiments.ack_wait [--waits 50000]

Each wait is for a future resolved one loop turn later (as an ack, or an upstream's answer, that
comes in time): awaited bare; under `asyncio.timeout` around `asyncio.shield` (what
iop/edge/publish.py did for a publish's ack); as `_publish_work` does now, a future of its own that
the ack's done-callback or a `call_later` timer ends; under `asyncio.timeout` alone (what the
node's OpenAI adapter did for `timeout_s`); and as it does now, one timer that cancels the task.
Prints CPU µs per wait, each way twice, alternating.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import time
from collections.abc import Awaitable, Callable

import uvloop

Wait = Callable[[asyncio.AbstractEventLoop], Awaitable[object]]


def _end_wait(waiter: asyncio.Future[None], _: object) -> None:
    """As iop/edge/publish.py's: the ack came, or the time is up."""
    if not waiter.done():
        waiter.set_result(None)


async def bare(loop: asyncio.AbstractEventLoop) -> object:
    acked: asyncio.Future[int] = loop.create_future()
    loop.call_soon(acked.set_result, 1)
    return await acked


async def timeout_shield(loop: asyncio.AbstractEventLoop) -> object:
    acked: asyncio.Future[int] = loop.create_future()
    loop.call_soon(acked.set_result, 1)
    async with asyncio.timeout(2.0):
        return await asyncio.shield(acked)


async def timer_waiter(loop: asyncio.AbstractEventLoop) -> object:
    acked: asyncio.Future[int] = loop.create_future()
    loop.call_soon(acked.set_result, 1)
    waiter: asyncio.Future[None] = loop.create_future()
    acked.add_done_callback(functools.partial(_end_wait, waiter))
    expiry = loop.call_later(2.0, _end_wait, waiter, None)
    try:
        await waiter
    finally:
        expiry.cancel()
    return acked.result()


async def timeout_alone(loop: asyncio.AbstractEventLoop) -> object:
    async with asyncio.timeout(600):
        return await bare(loop)


async def timer_cancel(loop: asyncio.AbstractEventLoop) -> object:
    task = asyncio.current_task()
    assert task is not None
    fired = False

    def fire() -> None:
        nonlocal fired
        fired = True
        task.cancel()

    timer = loop.call_later(600, fire)
    try:
        return await bare(loop)
    except asyncio.CancelledError:
        if fired and task.uncancel() == 0:
            raise TimeoutError from None
        raise
    finally:
        timer.cancel()


async def main(waits: int) -> None:
    loop = asyncio.get_running_loop()
    ways: list[Wait] = [bare, timeout_shield, timer_waiter, timeout_alone, timer_cancel]
    for _ in range(2):
        for way in ways:
            for _ in range(2000):
                await way(loop)
            t0 = time.process_time()
            for _ in range(waits):
                await way(loop)
            print(f"{way.__name__:15s} {(time.process_time() - t0) / waits * 1e6:6.2f} us CPU per wait")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--waits", type=int, default=50_000)
    uvloop.run(main(ap.parse_args().waits))
