"""The edge's pool scheduler alone: one acquire + release per dispatch, by the size of the pool.

    python -m bench.experiments.scheduler [--sizes 3,30,300] [--dispatches 20000]

Runs iop.edge.scheduler.Scheduler in this process with every provider connected and free (the
c=1 case of the scale benchmark), so the figure is the scheduler's own CPU per dispatch.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from iop.edge.scheduler import Scheduler


async def per_dispatch_us(providers: int, dispatches: int) -> float:
    sched = Scheduler(max_waiting=1000)
    ids = [f"p{i}" for i in range(providers)]
    for pid in ids:
        sched.add_provider(pid, "node", 1)
        sched.set_connected(pid, True)
    sched.add_pool("pool", ids)
    loop = asyncio.get_running_loop()
    t0 = time.perf_counter()
    for _ in range(dispatches):
        slot = await sched.acquire("pool", loop.time() + 10)
        sched.release(slot)
    return (time.perf_counter() - t0) / dispatches * 1e6


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="3,30,300")
    ap.add_argument("--dispatches", type=int, default=20_000)
    a = ap.parse_args(argv)
    for n in (int(x) for x in a.sizes.split(",") if x):
        us = asyncio.run(per_dispatch_us(n, max(1, a.dispatches // max(1, n // 30))))
        print(f"{n:5} providers in the pool: {us:8.1f} us per acquire + release")


if __name__ == "__main__":
    main()
