"""The edge hands back the memory of a burst of waiting requests once the burst has drained."""

from __future__ import annotations

import asyncio
import platform

from iop.edge import memory
from iop.edge.memory import BurstTrim
from iop.edge.scheduler import Scheduler


async def test_a_drained_burst_of_waiting_requests_is_trimmed_once() -> None:
    s = Scheduler(max_waiting=1000)
    s.add_provider("p", "n", 1)
    s.set_connected("p", True)
    s.add_pool("m", ["p"])
    trim = BurstTrim(lambda: s.waiting("m"), s.changed, burst=200, settle_s=0.05)
    trim.start()
    try:
        loop = asyncio.get_running_loop()
        held = await s.acquire("m", loop.time() + 30)
        waiters = [asyncio.create_task(s.acquire("m", loop.time() + 30)) for _ in range(300)]
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
        s.release(held)
    finally:
        trim.stop()


def test_give_back_trims_the_heap_where_glibc_is() -> None:
    glibc = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
    assert memory.give_back() is glibc
    rss = memory.rss_bytes()
    assert rss is None or rss > 0
