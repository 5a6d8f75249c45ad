"""What storing a large record costs nats-server as its stream grows, by the server's Go collector setting.

    python -m bench.experiments.kv_put [--gogc 100,400] [--size 3000000] [--rounds 14] [--puts 30]

For each `GOGC` value, a nats-server of its own (file store) and a bucket configured as iop's
response store (history 1, an age limit, direct gets); then rounds of `--puts` puts of `--size`
random bytes under fresh keys, one at a time, each awaiting its ack (iop/nats/acked.py, as the
store writes), the stream growing by every round; then the stream purged and 3 rounds more.
Each line: the put's p50, nats-server CPU-ms and minor page faults per put, its resident memory,
and the stream's size, with the machine's other busy cores beside it. iop starts its embedded
server with `GOGC=400` (iop/nats/goruntime.py, `GO_GC`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

from bench.experiments.bare_nats import bare_nats
from bench.procs import busy_cores, children_of, comm, cpu_s, machine_ticks, rss_bytes
from iop.nats.server import MAX_PAYLOAD

BUCKET = "put"


def _faults(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


async def _run(url: str, pid: int, size: int, rounds: int, puts: int) -> None:
    import nats
    from nats.js import api

    from iop.nats.acked import AckedPublishes

    nc = await nats.connect(url, max_reconnect_attempts=0)
    js = nc.jetstream()
    acked = AckedPublishes(nc)
    await acked.start()
    cfg = api.KeyValueConfig(bucket=BUCKET, history=1, ttl=3600, max_bytes=8 << 30, direct=True)
    await js.create_key_value(cfg)
    data = os.urandom(size)
    key = 0

    async def one_round(label: str) -> None:
        nonlocal key
        times = []
        cpu0, faults0, ticks0, t0 = cpu_s(pid), _faults(pid), machine_ticks(), time.monotonic()
        own0 = cpu_s(os.getpid()) + cpu0
        for _ in range(puts):
            key += 1
            t = time.perf_counter()
            await acked.publish(f"$KV.{BUCKET}.k{key}", [data])
            times.append(time.perf_counter() - t)
        cpu1, faults1, ticks1, t1 = cpu_s(pid), _faults(pid), machine_ticks(), time.monotonic()
        own = (cpu_s(os.getpid()) + cpu1 - own0) / (t1 - t0)
        foreign = max(0.0, busy_cores(ticks0, ticks1) - own)
        info = await js.stream_info(f"KV_{BUCKET}")
        print(
            f"  {label:14} p50 {statistics.median(times) * 1e3:5.2f} ms  nats CPU {(cpu1 - cpu0) / puts * 1e3:5.2f} ms"
            f"  faults {(faults1 - faults0) / puts:4.0f}  rss {rss_bytes(pid) >> 20:3d} MiB"
            f"  stream {info.state.bytes >> 20:5d} MiB  foreign cores {foreign:.2f}",
            flush=True,
        )

    for r in range(rounds):
        await one_round(f"round {r}")
    await js.purge_stream(f"KV_{BUCKET}")
    for r in range(3):
        await one_round(f"after purge {r}")
    await nc.close()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gogc", default="100,400", help="GOGC values to compare, one server each")
    ap.add_argument("--size", type=int, default=3_000_000)
    ap.add_argument("--rounds", type=int, default=14)
    ap.add_argument("--puts", type=int, default=30)
    a = ap.parse_args(argv)
    if not 0 < a.size <= MAX_PAYLOAD - 4096:
        ap.error(f"--size: 1 to {MAX_PAYLOAD - 4096} bytes (one message of the server's max_payload)")
    for value in (v.strip() for v in a.gogc.split(",") if v.strip()):
        os.environ["GOGC"] = value  # the server started next inherits it
        print(f"GOGC={value}", flush=True)
        with bare_nats("kv-put", max_payload=MAX_PAYLOAD) as url:
            pid = next(p for p in children_of(os.getpid()) if "nats" in comm(p))
            asyncio.run(_run(url, pid, a.size, a.rounds, a.puts))


if __name__ == "__main__":
    main()
