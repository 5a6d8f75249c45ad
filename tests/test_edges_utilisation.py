"""Two edges on a 3-server R3 cluster keep one pool as busy as one edge does on the same load.

The measurement is bench/edgeshare.py's (real processes: three nats-servers, three nodes, two
edges, the bench upstream recording every slot's in-flight changes), one round of 500 ms answers
with each one-edge run next to a two-edge run, so that the others' load hits both alike.

What sharing by announcements buys over heartbeats alone is about 2 points, as large as the
spread between single rounds on a loaded machine: that figure is the benchmark's to measure
(`python -m bench.edgeshare`, docs/scale-out.md). This test holds what cannot vary with load:
nothing fails, no provider is ever past its capacity, the load waited, and two edges are not
grossly worse than one (10 points: a whole provider left idle for a third of the run).
"""

from __future__ import annotations

from pathlib import Path

from bench.cluster import start_cluster
from bench.edgeshare import CAPACITIES, Options, measure


async def test_two_edges_keep_the_pool_busy_and_never_past_capacity(tmp_path: Path) -> None:
    servers = await start_cluster(tmp_path, "iop-share")
    try:
        url = ",".join(s.url for s in servers)
        opts = Options(seconds=6.0, clients=16, latency_ms=500.0, rounds=1)
        out = await measure(url, ",".join(s.address for s in servers), tmp_path, opts)
    finally:
        for s in servers:
            await s.stop()
    print(f"\nutilisation: one edge {out['one_edge']}, two edges {out['two_edges']}, lost {out['points_lost']} points")
    # 8 slots for 6 s of 500 ms answers: about 96 per run; far fewer means the load never waited.
    slots = sum(CAPACITIES)
    for r in out["runs"]:
        assert r["ok"] >= 0.75 * slots * opts.seconds / (opts.latency_ms / 1000), r
        assert r["failed"] == 0 and r["over_cap"] == 0, r
        assert r["window_s"] >= 0.75 * opts.seconds, r
    assert out["two_edges"] >= out["one_edge"] - 0.10, out
