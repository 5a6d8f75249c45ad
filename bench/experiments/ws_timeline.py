"""Where a WebSocket-mode turn's time goes inside the edge, against the same turn over HTTP.

    python -m bench.experiments.ws_timeline [--sessions 15]

The wsturns session (bench/wsturns.py) through one edge whose process is this module: it marks,
on the monotonic clock, the client's bytes arriving (the HTTP or the WebSocket protocol's
`data_received`), the endpoint's start and end (`ApiEndpoint.__call__`), the work's publish
(`Attempt.send`) and each write to the client, then runs `iop` as usual. Per turn it prints the
p50 of each step: arrival → endpoint → publish → the write holding `response.completed`, and for
WebSocket turns apart those whose event arrived while the socket's previous request was still
finishing (the node's Done, the slot's release, the record): a socket runs one request at a time.
The marks cost a few µs each; compare the arms, not the absolute times.
"""

from __future__ import annotations

import argparse
import asyncio
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
        _MARKS.append((time.perf_counter_ns(), tag))


def _as_edge(args: list[str]) -> None:
    """Run `iop` with the marks in place; SIGUSR1 starts them, SIGUSR2 writes them to $WS_TIMELINE."""
    from uvicorn.protocols.websockets.wsproto_impl import WSProtocol

    from iop.edge import api, dispatch, http

    def start(*_: Any) -> None:
        _MARKS.clear()
        _ON[0] = True

    def dump(*_: Any) -> None:
        _ON[0] = False
        Path(os.environ["WS_TIMELINE"]).write_text(json.dumps(_MARKS))

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, dump)
    http_in, ws_in = http.LimitedHttpProtocol.data_received, WSProtocol.data_received
    call, send, write = api.ApiEndpoint.__call__, dispatch.Attempt.send, http.HeadWithBody.write

    def on_http(self: Any, data: bytes) -> None:
        _mark("in")
        http_in(self, data)

    def on_ws(self: Any, data: bytes) -> None:
        _mark("in")
        ws_in(self, data)

    async def on_call(self: Any, scope: Any, receive: Any, send_: Any) -> None:
        _mark("api")
        try:
            await call(self, scope, receive, send_)
        finally:
            _mark("end")

    async def on_send(self: Any, item: Any) -> None:
        _mark("publish")
        await send(self, item)

    def on_write(self: Any, data: bytes) -> None:
        _mark("completed" if b"response.completed" in data else "out")
        write(self, data)

    # Patched on the classes (what the edge's objects look up), so: setattr, not assignment.
    for owner, name, patch in (
        (http.LimitedHttpProtocol, "data_received", on_http),
        (WSProtocol, "data_received", on_ws),
        (api.ApiEndpoint, "__call__", on_call),
        (dispatch.Attempt, "send", on_send),
        (http.HeadWithBody, "write", on_write),
    ):
        setattr(owner, name, patch)
    sys.argv = ["iop", *args]
    runpy.run_module("iop", run_name="__main__", alter_sys=True)


def _turns(marks: list[tuple[int, str]]) -> list[dict[str, float]]:
    """Each turn's steps in µs from its first arrival; `early` 1 when it came before the previous end."""
    turns: list[dict[str, float]] = []
    cur: dict[str, int] | None = None
    busy = False
    for t, tag in marks:
        if tag == "in" and cur is None:
            cur = {"in": t, "early": int(busy)}
        elif tag == "out" and cur is not None and "api" not in cur:
            cur = None  # a handshake's answer, not a turn
        elif tag in ("api", "publish") and cur is not None and tag not in cur:
            cur[tag] = t
        elif tag == "completed":
            busy = True
            if cur is not None and "api" in cur:
                row = {k: (v - cur["in"]) / 1000 for k, v in cur.items() if k in ("api", "publish")}
                turns.append({**row, "completed": (t - cur["in"]) / 1000, "early": cur["early"]})
                cur = None
        elif tag == "end":
            busy = False
    return turns


def main(argv: list[str] | None = None) -> int:
    if argv is None and sys.argv[1:2] == ["--as-edge"]:
        _as_edge(sys.argv[2:])
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=15, help="sessions of 20 turns per arm, twice each")
    a = ap.parse_args(argv)

    import bench.stack as stack_module
    from bench import load, wsturns
    from bench.abtest import start_upstream
    from bench.procs import Owned, free_port, install_signal_handlers, iop_argv

    def edge_argv(archive: Path | None, *args: str) -> list[str]:
        if args[:1] == ("edge",):
            return [sys.executable, "-m", "bench.experiments.ws_timeline", "--as-edge", *args]
        return iop_argv(archive, *args)

    stack_module.iop_argv = edge_argv  # type: ignore[attr-defined]  # start_stack's edge runs through this module
    out = Path(tempfile.mkdtemp(prefix="iop-ws-timeline-"))
    os.environ["WS_TIMELINE"] = str(out / "marks.json")
    install_signal_handlers()
    owned = Owned(out)
    opts = wsturns.WsTurnsOptions()
    try:
        up = free_port()
        start_upstream(owned, "upstream", [up], "--tokens", str(wsturns.TOKENS))
        stack = stack_module.start_one_pool(owned, out, "timeline", up)
        port = int(stack.url.rsplit(":", 1)[1])
        sessions = {
            "http": lambda: wsturns._http_session(port, "bench", opts),
            "ws": lambda: wsturns._ws_session(port, "bench", opts),
        }
        turns: dict[str, list[dict[str, float]]] = {"http": [], "ws": []}
        with asyncio.Runner(loop_factory=load.loop_factory()) as runner:
            for arm in ("http", "ws", "http", "ws"):
                runner.run(sessions[arm]())  # warm
                os.kill(stack.edge.pid, signal.SIGUSR1)
                time.sleep(0.2)
                for _ in range(a.sessions):
                    runner.run(sessions[arm]())
                os.kill(stack.edge.pid, signal.SIGUSR2)
                time.sleep(0.5)
                turns[arm] += _turns(json.loads((out / "marks.json").read_text()))
    finally:
        owned.stop_all()
        shutil.rmtree(out, ignore_errors=True)

    def p50(rows: list[dict[str, float]], a: str, b: str | None = None) -> str:
        values = [r[a] - (r[b] if b else 0.0) for r in rows if a in r and (b is None or b in r)]
        return f"{statistics.median(values):6.0f}" if values else "     -"

    print("µs, p50 per turn: arrival -> endpoint -> publish -> the write holding response.completed")
    groups = {
        **{arm: turns[arm] for arm in ("http", "ws")},
        **{f"{arm}, came before the previous end": [r for r in turns[arm] if r["early"]] for arm in ("http", "ws")},
        **{f"{arm}, came after it": [r for r in turns[arm] if not r["early"]] for arm in ("http", "ws")},
    }
    for name, rows in groups.items():
        print(
            f"{name:34s} n={len(rows):4d}  endpoint {p50(rows, 'api')}  publish {p50(rows, 'publish', 'api')}"
            f"  completed {p50(rows, 'completed', 'publish')}  total {p50(rows, 'completed')}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
