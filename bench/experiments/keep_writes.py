"""What keeping a small Responses turn costs the edge's process, its writes sent one way or another.

    python -m bench.experiments.keep_writes [--turns 3200] [--concurrency 32] [--rounds 6]

A kept turn writes its record and an index entry per output item to the response store, all before
its answer goes out. This keeps turns of one output item each (`Responses.expand` and `keep`, as
the edge does for a request that leaves `store` out), `--concurrency` at a time on a nats-server of
its own, and reads this process's CPU per turn (the acks read by nats-py included) with the
writes sent in one coroutine (`AckedPublishes.publish_many`, the store's way) and as a task per
write (`asyncio.gather` of a publish each), alternating rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

from bench.experiments.bare_nats import bare_nats
from iop import edgeconf
from iop.cli.common import run_async
from iop.nats import connection
from iop.responses.expand import Responses
from iop.responses.store import ResponseStore


async def _task_per_write(self: ResponseStore, writes: list[tuple[str, bytes]], ahead: Any = None) -> list[int]:
    (key, data), *rest = writes
    return list(await asyncio.gather(self._put(key, data, ahead), *(self._put(k, d) for k, d in rest)))


def _answer(n: int) -> dict[str, Any]:
    part = {"type": "output_text", "text": "hello", "annotations": []}
    item = {"type": "message", "id": f"msg_{n:024x}", "role": "assistant", "status": "completed", "content": [part]}
    return {"id": f"resp_{n:024x}", "output": [item]}


async def _run(url: str, turns: int, concurrency: int, rounds: int) -> None:
    nc = await connection.connect(url, "keep-writes")
    responses = Responses(await ResponseStore.open(nc, edgeconf.ResponsesSettings()))
    arms = {"one coroutine": ResponseStore._put_all, "a task per write": _task_per_write}
    n = 0

    async def client(count: int) -> None:
        nonlocal n
        for _ in range(count):
            n += 1
            turn = await responses.expand({"model": "m", "input": "hi"}, "owner")
            await responses.keep("owner", turn, _answer(n))

    per: dict[str, list[float]] = {name: [] for name in arms}
    try:
        for r in range(rounds):
            for name in list(arms) if r % 2 == 0 else list(reversed(arms)):
                ResponseStore._put_all = arms[name]  # type: ignore[method-assign]
                cpu0 = time.process_time()
                await asyncio.gather(*(client(turns // concurrency) for _ in range(concurrency)))
                per[name].append((time.process_time() - cpu0) / (turns // concurrency * concurrency) * 1e6)
    finally:
        ResponseStore._put_all = arms["one coroutine"]  # type: ignore[method-assign]
        await nc.close()
    for name, us in per.items():
        rounds_us = ", ".join(f"{u:.1f}" for u in us)
        print(f"{name:17} {statistics.median(us):6.1f} us CPU per kept turn (rounds: {rounds_us})")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=3200)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=6)
    a = ap.parse_args(argv)
    with bare_nats("keep-writes") as url:
        run_async(_run(url, a.turns, a.concurrency, a.rounds))


if __name__ == "__main__":
    main()
