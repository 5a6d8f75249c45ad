"""Scenario: one agent session replayed over WebSocket mode and over HTTP (issue 30).

A session of `turns` turns as a coding agent runs it: every turn sends one tool output (~2 KB of
source text) and streams the model's answer. Three arms replay the same session, their order
rotating every round:

    direct  HTTP to the upstream, the whole conversation every turn (what the upstream needs)
    http    HTTP through iop, the whole conversation every turn, `store: false` (Codex over HTTP)
    ws      one WebSocket through iop (`/v1/responses`), every turn a `response.create` naming the
            socket's last response as `previous_response_id` with only the new item (Codex in
            WebSocket mode); the edge adds the earlier turns from the socket's own state

Per turn: the send to the stream's `response.completed`, one turn at a time. Added = the arm's
time - direct's for the same turn of the same round. HTTP arms use bench/load.py's raw client (one
keep-alive connection per session), the WebSocket arm a bare client of the same kind (`_Socket`).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import load
from bench.abtest import start_upstream
from bench.measure import spread
from bench.procs import Owned, busy_cores, cpu_s, free_port, log, machine_ticks
from bench.stack import openai_pool_node, start_stack
from bench.upstream import answer_words

ARMS = ("direct", "http", "ws")
TOKENS = 16
"""Tokens of every answer (the bench upstream's `--tokens`)."""


@dataclass
class WsTurnsOptions:
    turns: int = 20
    rounds: int = 5
    output_bytes: int = 2000
    """Size of the tool output each turn sends."""


def _tool_output(turn: int, size: int) -> str:
    line = f"    def step_{turn}(self, value: int) -> int:  # returns the value after turn {turn}\n"
    return (line * (size // len(line) + 1))[:size]


def _assistant(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}


def _item(turn: int, size: int) -> dict[str, Any]:
    text = "Output of the last command:\n" + _tool_output(turn, size)
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def _answer_text() -> str:
    """The bench upstream's answer of TOKENS tokens, which the HTTP arms send back as the
    assistant's turn, as a stateless client does."""
    return "".join(answer_words(TOKENS))


async def _http_session(port: int, model: str, opts: WsTurnsOptions) -> list[float]:
    target = load.Target("127.0.0.1", port, "/v1/responses")
    loop = asyncio.get_running_loop()
    _, conn = await loop.create_connection(load.Conn, "127.0.0.1", port)
    history: list[dict[str, Any]] = []
    said = _answer_text()
    out: list[float] = []
    try:
        for t in range(opts.turns):
            history.append(_item(t, opts.output_bytes))
            body = {"model": model, "input": history, "stream": True, "store": False}
            request = load.request_of(target, json.dumps(body, separators=(",", ":")).encode())
            t0 = load.clock()
            answer = await asyncio.wait_for(conn.send(request), 30)
            if not answer.ok:
                raise RuntimeError(f"turn {t} on port {port}: status {answer.status}")
            out.append(1000 * (answer.t_end - t0))
            history.append(_assistant(said))
    finally:
        conn.abort()
    return out


class _Socket(asyncio.Protocol):
    """A bare WebSocket client, as cheap per frame as bench/load.py's HTTP client is per read: the
    arms then differ by what iop does, not by the clients' own parsing. Text frames out (masked
    with a zero key, which RFC 6455 permits: the server unmasks as usual), frames in, unfragmented,
    each with the clock when its read arrived (as the HTTP client times an answer's last read)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.upgraded: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.frames: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.upgraded.done():
            self.upgraded.set_exception(ConnectionError("closed before the upgrade"))
        self.frames.put_nowait((load.clock(), b""))

    def data_received(self, data: bytes) -> None:
        now = load.clock()
        self.buf += data
        if not self.upgraded.done():
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head, self.buf = bytes(self.buf[:end]), self.buf[end + 4 :]
            if not head.startswith(b"HTTP/1.1 101"):
                self.upgraded.set_exception(ConnectionError(head.split(b"\r\n", 1)[0].decode()))
                return
            self.upgraded.set_result(None)
        while len(self.buf) >= 2:
            n, at = self.buf[1] & 0x7F, 2
            if n == 126:
                if len(self.buf) < 4:
                    return
                n, at = int.from_bytes(self.buf[2:4], "big"), 4
            elif n == 127:
                if len(self.buf) < 10:
                    return
                n, at = int.from_bytes(self.buf[2:10], "big"), 10
            if len(self.buf) < at + n:
                return
            self.frames.put_nowait((now, bytes(self.buf[at : at + n])))
            del self.buf[: at + n]


def _text_frame(text: bytes) -> bytes:
    """A client's text frame of `text`, masked with a zero key."""
    n = len(text)
    length = (
        bytes([0x80 | n])
        if n < 126
        else (bytes([0xFE]) + n.to_bytes(2, "big") if n < 65536 else bytes([0xFF]) + n.to_bytes(8, "big"))
    )
    return b"\x81" + length + b"\0\0\0\0" + text


async def _ws_session(port: int, model: str, opts: WsTurnsOptions) -> list[float]:
    loop = asyncio.get_running_loop()
    _, sock = await loop.create_connection(_Socket, "127.0.0.1", port)
    assert sock.transport is not None
    sock.transport.write(
        f"GET /v1/responses HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\nupgrade: websocket\r\nconnection: Upgrade\r\n"
        "sec-websocket-key: aW9wLWJlbmNoLWtleS0xMg==\r\nsec-websocket-version: 13\r\n\r\n".encode()
    )
    await asyncio.wait_for(sock.upgraded, 10)
    out: list[float] = []
    previous: str | None = None
    try:
        for t in range(opts.turns):
            event: dict[str, Any] = {"type": "response.create", "model": model, "store": False}
            event["input"] = [_item(t, opts.output_bytes)]
            if previous is not None:
                event["previous_response_id"] = previous
            frame = _text_frame(json.dumps(event, separators=(",", ":")).encode())
            t0 = load.clock()
            sock.transport.write(frame)
            while True:
                arrived, frame = await asyncio.wait_for(sock.frames.get(), 30)
                if b'"response.completed"' in frame[:64]:
                    break
                if not frame or b'"error"' in frame[:64] or b'"response.failed"' in frame[:64]:
                    raise RuntimeError(f"turn {t} over WebSocket: {frame[:300]!r}")
            out.append(1000 * (arrived - t0))
            previous = json.loads(frame)["response"]["id"]
    finally:
        assert sock.transport is not None
        sock.transport.abort()
    return out


def run_wsturns(owned: Owned, workdir: Path, opts: WsTurnsOptions) -> dict[str, Any]:
    up_port = free_port()
    upstream = start_upstream(owned, "upstream-wsturns", [up_port], "--tokens", str(TOKENS))
    stack = start_stack(
        owned,
        workdir,
        "wsturns",
        models=[{"alias": "bench", "pool": ["fake"]}],
        nodes=[openai_pool_node("bench-node", [("fake", up_port, 8)])],
    )
    edge_port = int(stack.url.rsplit(":", 1)[1])
    sessions = {
        "direct": lambda: _http_session(up_port, "fake-model", opts),
        "http": lambda: _http_session(edge_port, "bench", opts),
        "ws": lambda: _ws_session(edge_port, "bench", opts),
    }
    times: dict[str, list[list[float]]] = {arm: [] for arm in ARMS}
    edge_s = dict.fromkeys(ARMS, 0.0)
    """The edge's CPU seconds in each arm over all rounds (per turn below: the clock ticks are 10 ms)."""

    def own() -> float:
        """CPU seconds of every process of this scenario, this one included."""
        parts = [stack.edge.cpu_s(), sum(n.cpu_s() for n in stack.nodes), cpu_s(upstream.pid), time.process_time()]
        return sum(parts) + (cpu_s(stack.nats_pid) if stack.nats_pid else 0.0)

    others: list[float] = []
    try:
        with asyncio.Runner(loop_factory=load.loop_factory()) as runner:
            for arm in ARMS:  # warm-up: imports, connections, caches
                runner.run(sessions[arm]())
            for r in range(opts.rounds):
                order = ARMS[r % 3 :] + ARMS[: r % 3]
                ticks, t0, own0 = machine_ticks(), time.monotonic(), own()
                for arm in order:
                    edge0 = stack.edge.cpu_s()
                    times[arm].append(runner.run(sessions[arm]()))
                    edge_s[arm] += stack.edge.cpu_s() - edge0
                wall = time.monotonic() - t0
                others.append(max(0.0, busy_cores(ticks, machine_ticks()) - (own() - own0) / wall))
                log(
                    f"wsturns r{r} per-turn p50 ms: "
                    + " ".join(f"{a}={statistics.median(times[a][-1]):.2f}" for a in ARMS)
                )
    finally:
        stack.stop()
        owned.stop(upstream)
    per_turn = {a: round(1e6 * edge_s[a] / (opts.turns * opts.rounds)) for a in ("http", "ws")}
    return _summary(times, others, opts) | {"edge_cpu_us_per_turn": per_turn}


def _summary(times: dict[str, list[list[float]]], busy: list[float], opts: WsTurnsOptions) -> dict[str, Any]:
    def added(arm: str) -> list[float]:
        return [a - d for sa, sd in zip(times[arm], times["direct"], strict=True) for a, d in zip(sa, sd, strict=True)]

    def late(arm: str) -> list[float]:
        """The last quarter of each session's turns: the longest conversations."""
        k = max(1, opts.turns // 4)
        pairs = zip(times[arm], times["direct"], strict=True)
        return [a - d for sa, sd in pairs for a, d in zip(sa[-k:], sd[-k:], strict=True)]

    def p(values: list[float], q: float) -> float:
        return round(load.pct(sorted(values), q), 3) if values else 0.0

    per_round = {arm: [statistics.median(s) for s in times[arm]] for arm in ARMS}
    return {
        "turns": opts.turns,
        "rounds": opts.rounds,
        "output_bytes": opts.output_bytes,
        "turn_p50_ms": {arm: spread(per_round[arm]) for arm in ARMS},  # type: ignore[arg-type]
        "added_p50_ms": {arm: p(added(arm), 50) for arm in ("http", "ws")},
        "added_p90_ms": {arm: p(added(arm), 90) for arm in ("http", "ws")},
        "added_late_p50_ms": {arm: p(late(arm), 50) for arm in ("http", "ws")},
        # The two arms' same turn of the same round (neighbours in time): steadier than two medians.
        "ws_minus_http_p50_ms": p(
            [w - h for sw, sh in zip(times["ws"], times["http"], strict=True) for w, h in zip(sw, sh, strict=True)], 50
        ),
        "foreign_cores": spread(busy, 2),  # type: ignore[arg-type]
    }
