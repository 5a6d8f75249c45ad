"""Two edges on a 3-server R3 cluster keep one pool as busy as one edge does on the same load.

The measurement is bench/edgeshare.py's (real processes: three nats-servers, three nodes, two
edges, the bench upstream recording every slot's in-flight changes); the CI figures are its
shortest that still hold on a loaded 2-core machine: service times of 500 ms against handovers of
5-15 ms (at 250 ms, single rounds under a load average of 3-4 differed by up to 2 points either
way), and each one-edge run next to a two-edge run so that the others' load hits both alike.
"""

from __future__ import annotations

from pathlib import Path

from bench.cluster import start_cluster
from bench.edgeshare import CAPACITIES, Options, measure


async def test_two_edges_keep_the_pool_within_two_points_of_one_edge(tmp_path: Path) -> None:
    servers = await start_cluster(tmp_path, "iop-share")
    try:
        url = ",".join(s.url for s in servers)
        opts = Options(seconds=6.0, clients=16, latency_ms=500.0, rounds=2)
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
    assert out["two_edges"] >= out["one_edge"] - 0.02, out
