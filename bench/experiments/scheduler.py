"""The edge's pool scheduler alone: one acquire + release per dispatch, by the size of the pool.

    python -m bench.experiments.scheduler [--sizes 3,30,300] [--dispatches 20000] [--tenants 1,1000]

Runs iop.edge.scheduler.Scheduler in this process with every provider connected and free (the
c=1 case of the scale benchmark), so the figure is the scheduler's own CPU per dispatch.

With --tenants, a saturated pool (capacity 4) with two requests of every tenant waiting: each
admission is one release that grants the next waiter in the fair order and one new request that
queues, the asyncio tasks included; CPU per admission with fair queueing on and off.

With --announcer, one provider of capacity 4 and a request at a time taken and given back, a loop
turn after each, without and with the edge's slot announcer (iop/edge/share.py, no other edge
heard) beside it: what the announcer costs a request.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import deque

from iop.cli.common import run_async
from iop.edge.scheduler import Scheduler
from iop.edge.share import SlotShare
from iop.edge.slots import Grant


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
        grant = await sched.acquire_grant("pool", loop.time() + 10)
        sched.release(grant.slot, grant)
    return (time.perf_counter() - t0) / dispatches * 1e6


async def per_admission_us(tenants: int, admissions: int, fair: bool) -> tuple[float, float]:
    """CPU per admission, whole (the asyncio tasks included), and of the release that grants alone.

    Two passes over the same saturated pool: the first reads the CPU clock only around the whole
    loop, the second around each release too. A `process_time` pair per admission cost 4.6 µs of
    the whole figure on a VM, where reading a process's CPU clock is a system call, not the vDSO's."""
    sched = Scheduler(max_waiting=10 * tenants + 100, fair=fair)
    sched.add_provider("p", "node", 4)
    sched.set_connected("p", True)
    sched.add_pool("pool", ["p"])
    deadline = asyncio.get_running_loop().time() + 600
    held: deque[Grant] = deque([await sched.acquire_grant("pool", deadline, tenant="t0") for _ in range(4)])
    tasks: set[asyncio.Task[None]] = set()

    def ask(tenant: str) -> None:
        async def one() -> None:
            held.append(await sched.acquire_grant("pool", deadline, tenant=tenant))

        task = asyncio.create_task(one())
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    for i in range(2 * tenants):
        ask(f"t{i % tenants}")
    await asyncio.sleep(0)  # every task queues in its first step
    assert sched.waiting("pool") == 2 * tenants
    t0 = time.process_time()
    for k in range(admissions):
        g = held.popleft()
        sched.release(g.slot, g)
        ask(f"t{k % tenants}")
        await asyncio.sleep(0)
        await asyncio.sleep(0)
    us = (time.process_time() - t0) / admissions * 1e6
    granting = 0.0
    for k in range(admissions):
        g = held.popleft()
        r0 = time.process_time()
        sched.release(g.slot, g)
        granting += time.process_time() - r0
        ask(f"t{k % tenants}")
        await asyncio.sleep(0)
        await asyncio.sleep(0)
    for t in list(tasks):
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return us, granting / admissions * 1e6


async def per_request_us(requests: int, announcer: bool) -> float:
    """CPU per request taken and given back, a loop turn after each; `announcer`: a SlotShare beside it."""
    sched = Scheduler(max_waiting=1000)
    sched.add_provider("p", "node", 4)
    sched.set_connected("p", True)
    sched.add_pool("pool", ["p"])
    share = SlotShare(sched, "bench-edge") if announcer else None
    task = asyncio.create_task(share.announce()) if share is not None else None
    loop = asyncio.get_running_loop()
    await asyncio.sleep(0)
    t0 = time.process_time()
    for _ in range(requests):
        grant = await sched.acquire_grant("pool", loop.time() + 10, tenant="t")
        await asyncio.sleep(0)
        sched.release(grant.slot, grant)
        await asyncio.sleep(0)
    us = (time.process_time() - t0) / requests * 1e6
    if task is not None:
        task.cancel()
    return us


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="3,30,300")
    ap.add_argument("--dispatches", type=int, default=20_000)
    ap.add_argument("--tenants", default="", help="e.g. 1,1000: CPU per admission on a saturated pool instead")
    ap.add_argument("--announcer", action="store_true", help="what the slot announcer costs a request instead")
    a = ap.parse_args(argv)
    if a.announcer:
        for _ in range(3):
            bare, beside = (run_async(per_request_us(a.dispatches, on)) for on in (False, True))
            print(f"{bare:6.2f} us CPU per request alone, {beside:6.2f} with the announcer: +{beside - bare:.2f} us")
        return
    if a.tenants:
        for n in (int(x) for x in a.tenants.split(",") if x):
            for fair in (True, False):
                us, grant_us = run_async(per_admission_us(n, a.dispatches, fair))
                print(
                    f"{n:5} tenants waiting, fair queueing {'on ' if fair else 'off'}: {us:6.1f} us CPU per admission,"
                    f" {grant_us:5.1f} us of it the release that grants"
                )
        return
    for n in (int(x) for x in a.sizes.split(",") if x):
        us = run_async(per_dispatch_us(n, max(1, a.dispatches // max(1, n // 30))))
        print(f"{n:5} providers in the pool: {us:8.1f} us per acquire + release")


if __name__ == "__main__":
    main()
