"""Where one small chat request's time goes at c=1, step by step across the edge and the node.

    python -m bench.experiments.c1_timeline [--requests 2000] [--stream]

Starts the bench upstream, an edge and a node whose processes are this module: each marks, on the
machine's monotonic clock (one clock for every process), the steps of a request it sees. Then a
closed loop of one keep-alive connection sends small chat requests, and for each request the marks
of both processes between its arrival at the edge and its end are put in order. Printed: the p50,
in µs from the request's first byte at the edge, of every step, and the p50 of each step's time
since the step before it, so the gaps between processes (a NATS hop, a wake-up) show beside the
time inside each. The marks cost about a microsecond each; compare steps, not absolute times.

Edge: `in` (the request's first read), `api` (the endpoint starts), `publish` / `published` (the
work item's publish, begun and done), `rx` (nats-py parsed a message), `reply` (the reply handler
runs), `out` (the answer's first write), `end` (the endpoint returns).
Node: `n.rx` (nats-py parsed a message), `n.item` (the pull's handler has the item), `n.run` (the
run starts), `n.post` (the upstream request's send), `n.up` (the upstream's first bytes),
`n.ack` (the work message's ack), `n.flush` (the replies' publish).
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_MARKS: list[tuple[int, str]] = []
_ON = [False]


def _mark(tag: str) -> None:
    if _ON[0]:
        _MARKS.append((time.monotonic_ns(), tag))


def _wrap(owner: Any, name: str, tag: str, after: str | None = None) -> None:
    """Mark `tag` when `owner.name` is called (and `after` when it returns); sync or async alike."""
    import inspect

    original = getattr(owner, name)
    if inspect.iscoroutinefunction(original):

        async def coro(*args: Any, **kwargs: Any) -> Any:
            _mark(tag)
            try:
                return await original(*args, **kwargs)
            finally:
                if after:
                    _mark(after)

        setattr(owner, name, coro)
    else:

        def plain(*args: Any, **kwargs: Any) -> Any:
            _mark(tag)
            try:
                return original(*args, **kwargs)
            finally:
                if after:
                    _mark(after)

        setattr(owner, name, plain)


def _run_as(role: str, args: list[str]) -> None:
    """Run `iop` with the marks in place; SIGUSR1 starts them, SIGUSR2 writes them to $C1_TIMELINE.<role>."""
    from nats.aio.client import Client
    from nats.aio.msg import Msg

    def start(*_: Any) -> None:
        _MARKS.clear()
        _ON[0] = True

    def dump(*_: Any) -> None:
        _ON[0] = False
        Path(f"{os.environ['C1_TIMELINE']}.{role}").write_text(json.dumps(_MARKS))

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, dump)
    prefix = "" if role == "edge" else "n."
    _wrap(Client, "_process_msg", prefix + "rx")
    if role == "edge":
        from iop.edge import api, dispatch, http, relay

        _wrap(http.LimitedHttpProtocol, "data_received", "in")
        _wrap(api.ApiEndpoint, "__call__", "api", "end")
        _wrap(dispatch.Attempt, "send", "publish", "published")
        _wrap(relay.Relay, "_on_reply", "reply")
        _wrap(http.HeadWithBody, "write", "out")
    else:
        from iop.node import http1, pull, running

        _wrap(pull.SlotPull, "_on_msg", "n.item")
        _wrap(running.RunningRequests, "_run", "n.run")
        _wrap(http1.HttpPool, "post", "n.post")
        _wrap(http1._Conn, "data_received", "n.up")
        _wrap(Msg, "ack", "n.ack")
        _wrap(running._Outbox, "flush", "n.flush")
    sys.argv = ["iop", *args]
    runpy.run_module("iop", run_name="__main__", alter_sys=True)


ORDER = ("in", "api", "publish", "n.rx", "n.item", "n.run", "n.post", "n.up", "n.ack", "n.flush", "rx", "reply", "out")
"""The steps of one request in the order they happen, each taken at its first mark in the request."""


def _requests(edge: list[tuple[int, str]], node: list[tuple[int, str]]) -> list[dict[str, float]]:
    """Per request, each step's first mark in µs after its `in`: a request runs from an `in` with no
    request open to its `end`; the node's marks in that span are its."""
    marks = sorted(edge + node)
    rows: list[dict[str, float]] = []
    cur: dict[str, int] | None = None
    for t, tag in marks:
        if cur is None:
            if tag == "in":
                cur = {"in": t}
            continue
        if tag == "end":
            cur["end"] = t
            if all(k in cur for k in ORDER):
                rows.append({k: (v - cur["in"]) / 1000 for k, v in cur.items()})
            cur = None
        elif tag not in cur and (tag != "rx" or "n.flush" in cur):  # the edge's rx of the reply, not of an ack
            cur[tag] = t
    return rows


def main(argv: list[str] | None = None) -> int:
    if argv is None and sys.argv[1:2] == ["--as"]:
        _run_as(sys.argv[2], sys.argv[3:])
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--stream", action="store_true", help="streamed answers")
    a = ap.parse_args(argv)

    import bench.stack as stack_module
    from bench import load
    from bench.abtest import start_upstream
    from bench.procs import Owned, free_port, install_signal_handlers, iop_argv

    def traced_argv(archive: Path | None, *args: str) -> list[str]:
        if args[:1] in (("edge",), ("node",)):
            return [sys.executable, "-m", "bench.experiments.c1_timeline", "--as", args[0], *args]
        return iop_argv(archive, *args)

    stack_module.iop_argv = traced_argv  # type: ignore[attr-defined]  # start_stack's edge and node run through this module
    out = Path(tempfile.mkdtemp(prefix="iop-c1-timeline-"))
    os.environ["C1_TIMELINE"] = str(out / "marks")
    install_signal_handlers()
    owned = Owned(out)
    try:
        up = free_port()
        start_upstream(owned, "upstream", [up])
        stack = stack_module.start_one_pool(owned, out, "timeline", up)
        target = load.Target("127.0.0.1", int(stack.url.rsplit(":", 1)[1]), "/v1/chat/completions")
        body = json.dumps(
            {"model": "bench", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16, "stream": a.stream}
        ).encode()
        load.run(load.LoadSpec(target, body, concurrency=1, requests=300, max_seconds=30))  # warm
        pids = {"edge": stack.edge.pid, "node": stack.nodes[0].pid}
        for pid in pids.values():
            os.kill(pid, signal.SIGUSR1)
        time.sleep(0.2)
        result = load.run(load.LoadSpec(target, body, concurrency=1, requests=a.requests, max_seconds=60))
        for pid in pids.values():
            os.kill(pid, signal.SIGUSR2)
        deadline = time.monotonic() + 10
        files = {role: Path(f"{out / 'marks'}.{role}") for role in pids}
        while not all(f.exists() for f in files.values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        marks = {role: [(int(t), str(tag)) for t, tag in json.loads(f.read_text())] for role, f in files.items()}
    finally:
        owned.stop_all()
        shutil.rmtree(out, ignore_errors=True)

    rows = _requests(marks["edge"], marks["node"])
    p50 = (result.latency_ms or {}).get("p50", 0.0)
    print(f"{result.count} requests at c=1 ({'stream' if a.stream else 'whole'}), client p50 {p50:.3f} ms;")
    print(f"{len(rows)} with every step marked; µs, p50 over them")
    print(f"{'step':10s} {'since in':>9s} {'since the step before':>22s}")
    for i, step in enumerate(ORDER):
        at = statistics.median(r[step] for r in rows)
        gap = statistics.median(r[step] - r[ORDER[i - 1]] for r in rows) if i else 0.0
        print(f"{step:10s} {at:9.0f} {gap:22.0f}")
    for step in ("published", "end"):
        print(f"{step:10s} {statistics.median(r[step] for r in rows if step in r):9.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
