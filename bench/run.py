"""iop's benchmarks, one command: python -m bench [--quick] [--rounds N] [--only ...] [--out FILE]

Starts the bench upstream, the edge and the nodes as processes of its own (from this source tree
with `python -m iop`, or from an archive with --archive), runs the scenarios of issues #7 and #19 — each
one DIRECT vs VIA IOP where that comparison exists, alternating the order every round — prints a
table with medians [min..max] and every target with PASS/MISS and its gap, and writes the JSON.

    latency     added p50/p99 latency and TTFB, chat + responses, stream or not, c=1 and c=32
    throughput  req/s at c=32 and CPU seconds per 1,000 requests in edge and node
    relay       SSE events/s through one edge: one long stream, and 64 streams
    capacity    10,000 requests on a pool of capacities 2, 4, 4: over-cap, utilisation, queue wait
    scale       dispatch, /status and its summary view at 3, 30, 300 providers
    memory      10,000 requests waiting at the edge: memory per waiting request, and after they left
    startup     the archive's first and warm start to a served request
    affinity    prefix-cache affinity: 16 sessions x 20 growing turns on a pool 2/4/4 whose providers
                simulate a prefix cache; warm-turn rate and time to first token with and without
    lifecycle   model servers the node runs itself: cold start and swap latency with fake servers that
                take a known time to load (docs/lifecycle.md)
    fairness    a pool of capacity 4 (200 ms answers), a tenant flooding at 10x its rate and a quiet
                one: the quiet tenant's queue wait alone, with fair queueing and with FIFO
    fairedges   a flooder on one edge, a quiet tenant on another (capacity 4, 200 ms): the quiet
                tenant's queue wait alone and beside the flooder's backlog on the other edge
    limits      10,000 requests through three edges on one NATS: a tenant's max_concurrent, rpm and tpm
                never exceeded (counts at the upstream and of the answers)
    routing     a mixed pool (a fast and a slow provider): routing by expected finish time against
                free-slot ranking at the same offered load; mean and p99 latency, throughput
    bodies      agent-sized bodies (1 KB .. 3 MB), chat and Responses, against direct and the floor
                (a bare JetStream work-queue round trip); edge memory with 200 of them waiting
    chain       stored-state expansion: previous_response_id at the end of 1-, 10- and 50-turn chains
    wsturns     one agent session of 20 turns replayed over WebSocket mode and over HTTP through
                iop, and over HTTP to the upstream directly: the added time per turn
    messages    a Claude-Code-like turn (2 KB, 800 KB) as /v1/messages through iop against the same
                chat request through iop and direct: the translation's cost, end to end and in process

Everything listens on 127.0.0.1; every load is bounded in count and time; only processes started
here are ended, by PID, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.abtest import AbOptions, run_ab
from bench.affinity import AffinityOptions, run_affinity
from bench.bodies import APIS as BODY_APIS
from bench.bodies import BodiesOptions, run_bodies
from bench.capacity import CapacityOptions, run_capacity
from bench.chain import ChainOptions, run_chain
from bench.fairedges import FairEdgesOptions, run_fairedges
from bench.fairness import FairnessOptions, run_fairness
from bench.lifecycle import LifecycleOptions, run_lifecycle
from bench.limits import LimitsOptions, run_limits
from bench.messages import MessagesOptions, render_messages, run_messages
from bench.procs import REPO, Owned, git_state, install_signal_handlers, loadavg, log, machine
from bench.report import judge, render
from bench.routing import RoutingOptions, run_routing
from bench.scale import ScaleOptions, run_memory, run_scale
from bench.startup import StartupOptions, run_startup
from bench.tracing import TracingOptions, run_tracing
from bench.wsturns import WsTurnsOptions, run_wsturns

SCENARIOS = (
    "latency",
    "throughput",
    "relay",
    "capacity",
    "scale",
    "memory",
    "startup",
    "affinity",
    "bodies",
    "lifecycle",
    "fairness",
    "fairedges",
    "limits",
    "routing",
    "tracing",
    "wsturns",
    "chain",
    "messages",
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="a smoke run: 1 round, short runs, small counts (< 2 min)")
    ap.add_argument("--rounds", type=int, default=None, help="alternating DIRECT/IOP rounds (default 5, quick 1)")
    ap.add_argument("--seconds", type=float, default=None, help="time bound of one measured run (default 3, quick 0.8)")
    ap.add_argument("--only", default=",".join(SCENARIOS), help="comma-separated: " + ",".join(SCENARIOS))
    ap.add_argument("--storage", choices=["file", "memory"], default="file", help="where JetStream keeps work")
    ap.add_argument("--archive", type=Path, default=None, help="run iop from this .pyz instead of the source tree")
    ap.add_argument(
        "--loop",
        choices=["default", "uvloop", "asyncio"],
        default="default",
        help="event loop of edge and nodes: iop's default, or forced with IOP_LOOP",
    )
    ap.add_argument("--procs", type=int, default=1, help="load generator processes")
    ap.add_argument("--standby", type=int, default=None, help="capacity, fairness: edge.queue.standby")
    ap.add_argument("--anticipate", type=float, default=None, help="fairness, fairedges: edge.queue.anticipate_ms")
    ap.add_argument(
        "--fairness-arms", default="alone,fair,fifo", help="fairness: which runs (alone, fair, fifo), comma-separated"
    )
    ap.add_argument("--no-admission", action="store_true", help="fairness: skip the admission CPU rounds")
    ap.add_argument("--cap-requests", type=int, default=None, help="capacity: requests (default 10,000, quick 1,000)")
    ap.add_argument("--cap-latency", default="uniform:20:100", help="capacity: upstream latency (ms) spec")
    ap.add_argument(
        "--cap-streams", choices=["half", "none"], default="half", help="capacity: every other request streams"
    )
    ap.add_argument("--waiting", type=int, default=10_000, help="memory: requests held waiting, also with --quick")
    ap.add_argument(
        "--body-sizes", default=None, help="bodies: comma-separated body bytes (default 1000,100000,800000,3000000)"
    )
    ap.add_argument(
        "--body-apis",
        default=None,
        help="bodies: comma-separated arms (default chat,responses,responses→chat,responses stored)",
    )
    ap.add_argument(
        "--body-pairs",
        type=int,
        default=None,
        help="bodies: direct/iop pairs per cell (20, quick 10); messages: triples (100, quick 30)",
    )
    ap.add_argument(
        "--body-latency",
        default="0",
        help="bodies: the upstream's delay before its first byte, e.g. fixed:100 (default 0)",
    )
    ap.add_argument(
        "--chain-lengths",
        default=None,
        help="chain: turns of each chain, comma-separated (default 1,10,50; 400 is ~850 KB of input)",
    )
    ap.add_argument("--routing-rates", default=None, help="routing: offered loads, req/s (default 1,2,4,8)")
    ap.add_argument("--routing-requests", type=int, default=None, help="routing: least requests per run (60)")
    ap.add_argument("--out", type=Path, default=None, help="JSON file (default bench/results/<date>.json)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (configs, logs)")
    ap.add_argument("--render", type=Path, default=None, metavar="JSON", help="only print the tables of a saved run")
    a = ap.parse_args(argv)
    if a.render is not None:
        saved = json.loads(a.render.read_text())
        judge(saved)
        print(_render(saved))
        return 0
    only = {x.strip() for x in a.only.split(",") if x.strip()}
    if unknown := only - set(SCENARIOS):
        ap.error(f"unknown scenario(s): {', '.join(sorted(unknown))}")
    body_apis = [x.strip() for x in (a.body_apis or "").split(",") if x.strip()]
    if strange := [x for x in body_apis if x not in BODY_APIS]:
        ap.error(f"--body-apis: no arm {', '.join(strange)} (there are {', '.join(BODY_APIS)})")
    chain_lengths = [x.strip() for x in (a.chain_lengths or "").split(",") if x.strip()]
    if strange := [x for x in chain_lengths if not x.isdigit() or int(x) < 1]:
        ap.error(f"--chain-lengths: not a number of turns: {', '.join(strange)}")
    rounds = a.rounds or (1 if a.quick else 5)
    seconds = a.seconds or (0.8 if a.quick else 3.0)
    out = a.out or REPO / "bench" / "results" / f"{time.strftime('%Y-%m-%d-%H%M%S')}.json"
    workdir = Path(tempfile.mkdtemp(prefix="iop-bench-"))
    # Inherited by every iop process (and simnodes) started here; "default" measures what users get.
    if a.loop == "default":
        os.environ.pop("IOP_LOOP", None)
    else:
        os.environ["IOP_LOOP"] = a.loop
    install_signal_handlers()
    owned = Owned(workdir)
    result: dict[str, Any] = {
        "meta": {
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "machine": machine(),
            "git": git_state(),
            "loadavg_start": loadavg(),
            "options": {
                "quick": a.quick,
                "rounds": rounds,
                "seconds": seconds,
                "only": sorted(only),
                "storage": a.storage,
                "loop": a.loop,
                "archive": str(a.archive) if a.archive else None,
                "procs": a.procs,
            },
            "workdir": str(workdir),
        },
        "scenarios": {},
    }
    t0 = time.monotonic()
    scenarios = result["scenarios"]
    failures: dict[str, str] = result["meta"].setdefault("failures", {})

    def attempt(name: str, fn: Callable[[], Any]) -> None:
        # One scenario failing (a process died, a timeout) must not cost the others' figures.
        log(f"== {name}")
        try:
            scenarios[name] = fn()
        except KeyboardInterrupt:
            raise
        except Exception as exc:
            failures[name] = f"{type(exc).__name__}: {exc}"
            log(f"{name} failed: {failures[name]}")
            owned.stop_all()

    try:
        if only & {"latency", "throughput", "relay"}:
            ab = AbOptions(rounds=rounds, seconds=seconds, procs=a.procs, storage=a.storage, archive=a.archive)
            if a.quick:
                ab.relay_one_tokens, ab.relay_many_tokens = 5_000, 300
            attempt("ab", lambda: run_ab(owned, workdir, ab, only))
        if "capacity" in only:
            cap = CapacityOptions(
                requests=a.cap_requests or (1_000 if a.quick else 10_000),
                latency=a.cap_latency,
                stream_share=a.cap_streams,
                storage=a.storage,
                archive=a.archive,
                standby=a.standby,
            )
            attempt("capacity", lambda: run_capacity(owned, workdir, cap))
        sc = ScaleOptions(
            seconds=seconds,
            rounds=1 if a.quick else 3,
            status_gets=20 if a.quick else 40,
            # Issue 19's burst: 10,000 even in a quick run (about 30 s to fill here).
            waiting=a.waiting,
            storage=a.storage,
            archive=a.archive,
        )
        if "scale" in only:
            attempt("scale", lambda: run_scale(owned, workdir, sc))
        if "memory" in only:
            attempt("memory", lambda: run_memory(owned, workdir, sc))
        if "startup" in only:
            st = StartupOptions(rounds=1 if a.quick else 3, archive=a.archive)
            attempt("startup", lambda: run_startup(owned, workdir, st))
        if "affinity" in only:
            af = AffinityOptions(storage=a.storage, archive=a.archive)
            if a.quick:
                af.turns = 10
            attempt("affinity", lambda: run_affinity(owned, workdir, af))
        if "fairness" in only:
            fq = FairnessOptions(
                storage=a.storage,
                archive=a.archive,
                standby=a.standby,
                anticipate_ms=a.anticipate,
                arms=tuple(a.fairness_arms.split(",")),
            )
            if a.no_admission:
                fq.admission_rounds = 0
            if a.quick:
                fq.flood_requests, fq.alone_requests = 200, 10
                fq.admission_rounds, fq.admissions = 1, 3000
            attempt("fairness", lambda: run_fairness(owned, workdir, fq))
        if "fairedges" in only:
            fe = FairEdgesOptions(archive=a.archive, anticipate_ms=a.anticipate)
            if a.quick:
                fe.flood_requests, fe.alone_requests = 100, 5
            attempt("fairedges", lambda: run_fairedges(owned, workdir, fe))
        if "limits" in only:
            li = LimitsOptions(archive=a.archive)
            if a.quick:
                li.requests = 1_000
            attempt("limits", lambda: run_limits(owned, workdir, li))
        if "bodies" in only:
            bo = BodiesOptions(storage=a.storage, archive=a.archive)
            if a.quick:
                bo.requests = 10
            if a.body_pairs:
                bo.requests = a.body_pairs
            if a.body_sizes:
                bo.sizes = [int(x) for x in a.body_sizes.split(",") if x.strip()]
            if body_apis:
                bo.apis = body_apis
            bo.latency = a.body_latency
            attempt("bodies", lambda: run_bodies(owned, workdir, bo))
        if "tracing" in only:
            to = TracingOptions(rounds=1 if a.quick else 3, seconds=1.5 if a.quick else 3.0, archive=a.archive)
            attempt("tracing", lambda: run_tracing(owned, workdir, to))
        if "wsturns" in only:
            wo = WsTurnsOptions(rounds=a.rounds or (2 if a.quick else 6), turns=10 if a.quick else 20)
            attempt("wsturns", lambda: run_wsturns(owned, workdir, wo))
        if "chain" in only:
            ch = ChainOptions.quick() if a.quick else ChainOptions()
            if chain_lengths:
                ch.lengths = [int(n) for n in chain_lengths]
            attempt("chain", lambda: run_chain(owned, workdir, ch))
        if "messages" in only:
            mo = MessagesOptions(storage=a.storage, archive=a.archive)
            mo.requests = a.body_pairs or (30 if a.quick else 100)
            attempt("messages", lambda: run_messages(owned, workdir, mo))
        if "lifecycle" in only:
            lc = LifecycleOptions(archive=a.archive, swaps=2 if a.quick else 6)
            attempt("lifecycle", lambda: run_lifecycle(owned, workdir, lc))
        if "routing" in only:
            ro = RoutingOptions(storage=a.storage, archive=a.archive)
            if a.quick:
                ro.requests, ro.rounds, ro.min_seconds = 20, 1, 0.0
            if a.routing_rates:
                ro.rates_per_s = tuple(float(x) for x in a.routing_rates.split(",") if x.strip())
            if a.routing_requests:
                ro.requests = a.routing_requests
            attempt("routing", lambda: run_routing(owned, workdir, ro))
    except KeyboardInterrupt:
        log("interrupted: stopping our processes")
        result["meta"]["interrupted"] = True
    finally:
        owned.stop_all()
        result["meta"]["loadavg_end"] = loadavg()
        result["meta"]["duration_s"] = round(time.monotonic() - t0, 1)
        judge(result)
        result["table"] = _render(result)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
        if not a.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    print(result["table"])
    print(f"\nJSON: {out}  ({result['meta']['duration_s']} s)")
    for name, why in failures.items():
        print(f"FAILED {name}: {why.splitlines()[0]}")
    return 1 if failures or result["meta"].get("interrupted") else 0


def _render(result: dict[str, Any]) -> str:
    out = render(result)
    if msg := result.get("scenarios", {}).get("messages"):
        out += "\n\n" + render_messages(msg)
    return out


if __name__ == "__main__":
    sys.exit(main())
