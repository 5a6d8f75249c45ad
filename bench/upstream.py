"""A fast fake OpenAI upstream for iop's benchmarks, counting concurrency per listening port.

    python -m bench.upstream --port 18000 [--port 18001 ...] [--cap 2,4,4] [--latency uniform:20:100]
        [--seed 1] [--tokens 16] [--token-interval-ms 0] [--write whole|each] [--timeline]

Serves `POST /v1/chat/completions` and `POST /v1/responses`, streamed (SSE) or not. The answer has
`--tokens` tokens unless the request asks for fewer or more (`max_tokens` / `max_output_tokens`).
Every port counts its own requests, so a pool of providers served from one process is measured per
provider where the concurrency actually happens:

    GET  /stats          every port: total, in_flight, peak_in_flight, over_cap, streams, disconnects
    POST /stats/reset    zero the counters (peaks restart from what is in flight now)
    GET  /timeline       with --timeline: every port's (monotonic time, +1/-1) events since the reset

A request is in flight from the moment its body has been read until its last byte was handed to
the socket (or its client left). An over-cap event is a request that made a port's in-flight count
exceed its `--cap`. Raw asyncio, uvloop when importable, standard library otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import random
import signal
import sys
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

# --- latency ----------------------------------------------------------------------------------------


class Latency:
    """The delay before an answer's first byte: fixed, or drawn from a seeded distribution.

    Specs (milliseconds): `0`, `fixed:5`, `uniform:20:100`, `exp:50` (mean), `lognormal:40:0.5`
    (median, sigma). One generator per process, so a run with the same seed and the same request
    order draws the same delays.
    """

    def __init__(self, spec: str, seed: int) -> None:
        self.spec = spec
        parts = spec.split(":")
        kind = parts[0]
        try:
            args = [float(x) for x in parts[1:]]
            if kind.replace(".", "", 1).isdigit():
                kind, args = "fixed", [float(kind)]
        except ValueError:
            raise SystemExit(f"upstream: bad latency spec {spec!r}") from None
        arity = {"fixed": 1, "uniform": 2, "exp": 1, "lognormal": 2}
        if arity.get(kind) != len(args) or any(a < 0 for a in args):
            raise SystemExit(
                f"upstream: bad latency spec {spec!r} (0, fixed:MS, uniform:LO:HI, exp:MEAN, lognormal:MED:SIGMA)"
            )
        self.kind = kind
        self.args = args
        self.rng = random.Random(seed)

    @property
    def zero(self) -> bool:
        return self.kind == "fixed" and self.args[0] == 0

    def draw_s(self) -> float:
        a = self.args
        if self.kind == "fixed":
            ms = a[0]
        elif self.kind == "uniform":
            ms = self.rng.uniform(a[0], a[1])
        elif self.kind == "exp":
            ms = self.rng.expovariate(1.0 / a[0]) if a[0] > 0 else 0.0
        else:
            ms = math.exp(self.rng.gauss(math.log(max(a[0], 1e-3)), a[1]))
        return ms / 1000.0


# --- counters ---------------------------------------------------------------------------------------


@dataclass
class PortStats:
    """What one listening port saw; `cap` is the concurrency this port's provider must never exceed."""

    port: int
    cap: int | None
    timeline: bool
    total: int = 0
    in_flight: int = 0
    peak_in_flight: int = 0
    over_cap: int = 0
    streams: int = 0
    disconnects: int = 0
    bad_requests: int = 0
    events: array[float] = field(default_factory=lambda: array("d"))

    def enter(self, stream: bool) -> None:
        self.total += 1
        self.streams += stream
        self.in_flight += 1
        if self.in_flight > self.peak_in_flight:
            self.peak_in_flight = self.in_flight
        if self.cap is not None and self.in_flight > self.cap:
            self.over_cap += 1
        if self.timeline:
            self.events.extend((time.monotonic(), 1.0))

    def leave(self) -> None:
        self.in_flight -= 1
        if self.timeline:
            self.events.extend((time.monotonic(), -1.0))

    def reset(self) -> None:
        self.total = self.over_cap = self.streams = self.disconnects = self.bad_requests = 0
        self.peak_in_flight = self.in_flight
        self.events = array("d")

    def as_dict(self) -> dict[str, Any]:
        return {
            "port": self.port,
            "cap": self.cap,
            "total": self.total,
            "in_flight": self.in_flight,
            "peak_in_flight": self.peak_in_flight,
            "over_cap": self.over_cap,
            "streams": self.streams,
            "disconnects": self.disconnects,
            "bad_requests": self.bad_requests,
        }


@dataclass
class Settings:
    latency: Latency
    tokens: int
    token_interval_s: float
    write_each: bool
    ports: list[PortStats]


# --- answers ----------------------------------------------------------------------------------------

_dumps = json.JSONEncoder(separators=(",", ":")).encode
_CREATED = 1_700_000_000


def answer_words(n: int) -> list[str]:
    return [("" if i == 0 else " ") + f"w{i}" for i in range(n)]


def chat_whole(model: str, n: int) -> bytes:
    return _dumps(
        {
            "id": "chatcmpl-bench",
            "object": "chat.completion",
            "created": _CREATED,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "".join(answer_words(n))},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 8, "completion_tokens": n, "total_tokens": 8 + n},
        }
    ).encode()


def chat_events(model: str, n: int, usage: bool) -> list[bytes]:
    head = (
        f'data: {{"id":"chatcmpl-bench","object":"chat.completion.chunk","created":{_CREATED},"model":{_dumps(model)}'
    )
    head += ","

    def event(choice: str) -> bytes:
        return (head + '"choices":[' + choice + "]}\n\n").encode()

    out = [event('{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}')]
    out += [event('{"index":0,"delta":{"content":' + _dumps(t) + '},"finish_reason":null}') for t in answer_words(n)]
    out.append(event('{"index":0,"delta":{},"finish_reason":"stop"}'))
    if usage:
        u = _dumps({"prompt_tokens": 8, "completion_tokens": n, "total_tokens": 8 + n})
        out.append((head + '"choices":[],"usage":' + u + "}\n\n").encode())
    out.append(b"data: [DONE]\n\n")
    return out


_RESP_ID = "resp_" + "0" * 24
_ITEM_ID = "msg_" + "0" * 24
"""A Responses answer's ids as built once; each answer gets its own (`unique_ids`), as from a real server."""
_ANSWERS = itertools.count(1)


def unique_ids(pieces: list[bytes]) -> list[bytes]:
    """A Responses answer's pieces with a response id and an output item id no other answer has:
    a server mints new ones every time, and an edge that keeps turns indexes each item by its id."""
    n = b"%024x" % next(_ANSWERS)
    rid, iid = _RESP_ID.encode(), _ITEM_ID.encode()
    return [p.replace(rid, b"resp_" + n).replace(iid, b"msg_" + n) for p in pieces]


def _response(model: str, status: str, text: str | None, n: int) -> dict[str, Any]:
    output = []
    if text is not None:
        part = {"type": "output_text", "text": text, "annotations": []}
        output = [{"type": "message", "id": _ITEM_ID, "status": "completed", "role": "assistant", "content": [part]}]
    done = status == "completed"
    return {
        "id": _RESP_ID,
        "object": "response",
        "created_at": _CREATED,
        "status": status,
        "model": model,
        "output": output,
        "usage": {"input_tokens": 8, "output_tokens": n, "total_tokens": 8 + n} if done else None,
    }


def responses_whole(model: str, n: int) -> bytes:
    return _dumps(_response(model, "completed", "".join(answer_words(n)), n)).encode()


def responses_events(model: str, n: int) -> list[bytes]:
    seq = 0

    def event(kind: str, **fields: Any) -> bytes:
        nonlocal seq
        seq += 1
        return f"event: {kind}\ndata: {_dumps({'type': kind, 'sequence_number': seq - 1, **fields})}\n\n".encode()

    at = {"item_id": _ITEM_ID, "output_index": 0, "content_index": 0}
    text = "".join(answer_words(n))
    part = {"type": "output_text", "text": text, "annotations": []}
    item = {"type": "message", "id": _ITEM_ID, "role": "assistant"}
    out = [
        event("response.created", response=_response(model, "in_progress", None, 0)),
        event("response.in_progress", response=_response(model, "in_progress", None, 0)),
        event("response.output_item.added", output_index=0, item={**item, "status": "in_progress", "content": []}),
        event("response.content_part.added", **at, part={**part, "text": ""}),
    ]
    out += [event("response.output_text.delta", **at, delta=t) for t in answer_words(n)]
    out += [
        event("response.output_text.done", **at, text=text),
        event("response.content_part.done", **at, part=part),
        event("response.output_item.done", output_index=0, item={**item, "status": "completed", "content": [part]}),
        event("response.completed", response=_response(model, "completed", text, n)),
    ]
    return out


_JSON_HEAD = b"HTTP/1.1 200 OK\r\nserver: iop-bench\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
_SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nserver: iop-bench\r\ncontent-type: text/event-stream\r\n"
    b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n"
)
_CACHE: dict[tuple[str, bool, str, int, bool], list[bytes]] = {}
"""Answers are built once per shape: the upstream must cost next to nothing per request."""


def answer(api: str, stream: bool, model: str, n: int, usage: bool) -> list[bytes]:
    """The answer's pieces: [whole response] or [SSE head, chunk-framed event, ..., terminator]."""
    key = (api, stream, model, n, usage)
    got = _CACHE.get(key)
    if got is None:
        if not stream:
            body = chat_whole(model, n) if api == "chat" else responses_whole(model, n)
            got = [_JSON_HEAD % len(body) + body]
        else:
            events = chat_events(model, n, usage) if api == "chat" else responses_events(model, n)
            got = [_SSE_HEAD] + [b"%x\r\n%s\r\n" % (len(e), e) for e in events] + [b"0\r\n\r\n"]
        if len(_CACHE) < 4096:  # bound: token counts come from requests
            _CACHE[key] = got
    return got


def _json_response(status: str, obj: Any) -> bytes:
    body = _dumps(obj).encode()
    return b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        status.encode(),
        len(body),
        body,
    )


# --- server -----------------------------------------------------------------------------------------

_PATHS = {
    b"/v1/chat/completions": "chat",
    b"/chat/completions": "chat",
    b"/v1/responses": "responses",
    b"/responses": "responses",
}


def _json_decoder() -> Callable[[bytes], dict[str, Any]]:
    """The few fields an answer depends on; msgspec skips the rest of a multi-megabyte body unread
    (json.loads spent ~12 ms on 3 MB, in both arms, as noise on what the bodies scenario measures)."""
    try:
        import msgspec
    except ImportError:
        return cast(Callable[[bytes], dict[str, Any]], json.loads)

    class _Req(msgspec.Struct):
        model: Any = None
        stream: Any = None
        max_tokens: Any = None
        max_output_tokens: Any = None
        stream_options: Any = None

    decode = msgspec.json.Decoder(_Req).decode

    def head(body: bytes) -> dict[str, Any]:
        try:
            r = decode(body)
        except msgspec.DecodeError as exc:
            raise ValueError(str(exc)) from None
        return {
            "model": r.model,
            "stream": r.stream,
            "max_tokens": r.max_tokens,
            "max_output_tokens": r.max_output_tokens,
            "stream_options": r.stream_options,
        }

    return head


_decode = _json_decoder()


class Handler(asyncio.Protocol):
    """One keep-alive connection; requests are answered in order, one at a time."""

    def __init__(self, settings: Settings, stats: PortStats) -> None:
        self.settings = settings
        self.stats = stats
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.busy = False
        self.closed = False
        self.task: asyncio.Task[None] | None = None
        self.writable: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.task is not None:
            self.task.cancel()
        if self.writable is not None and not self.writable.done():
            self.writable.set_result(None)

    def pause_writing(self) -> None:
        # A slow reader (the relay under test) must slow us down, not grow our buffers.
        if self.writable is None or self.writable.done():
            self.writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self.writable is not None and not self.writable.done():
            self.writable.set_result(None)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if not self.busy:
            self._next()

    def _next(self) -> None:
        """Answer every complete request in the buffer, until one needs to wait."""
        while not self.busy and not self.closed:
            got = self._parse()
            if got is None:
                return
            method, path, body = got
            self._dispatch(method, path, body)

    def _parse(self) -> tuple[bytes, bytes, bytes] | None:
        buf = self.buf
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            if len(buf) > 1 << 20:
                self._close()
            return None
        head = bytes(buf[:end]).lower()
        line_end = head.find(b"\r\n")
        parts = head[: line_end if line_end >= 0 else len(head)].split(b" ")
        if len(parts) != 3:
            self._close()
            return None
        start = end + 4
        if b"transfer-encoding: chunked" in head:
            chunks = bytearray()
            pos = start
            while True:
                nl = buf.find(b"\r\n", pos)
                if nl < 0:
                    return None
                size = int(bytes(buf[pos:nl]).split(b";")[0], 16)
                if size == 0:
                    if len(buf) < nl + 4:
                        return None
                    stop = nl + 4
                    break
                if len(buf) < nl + 2 + size + 2:
                    return None
                chunks += buf[nl + 2 : nl + 2 + size]
                pos = nl + 2 + size + 2
            del buf[:stop]
            return parts[0], parts[1].split(b"?", 1)[0], bytes(chunks)
        length = 0
        i = head.find(b"\r\ncontent-length:")
        if i >= 0:
            j = head.find(b"\r\n", i + 2)
            length = int(head[i + 17 : j if j >= 0 else len(head)])
        if len(buf) < start + length:
            return None
        body = bytes(buf[start : start + length])
        del buf[: start + length]
        return parts[0], parts[1].split(b"?", 1)[0], body

    def _close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def _write(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.write(data)

    def _dispatch(self, method: bytes, path: bytes, body: bytes) -> None:
        api = _PATHS.get(path)
        if method == b"post" and api is not None:
            self._serve(api, body)
        elif method == b"get" and path == b"/stats":
            self._write(_json_response("200 OK", stats_of(self.settings)))
        elif method == b"post" and path == b"/stats/reset":
            for p in self.settings.ports:
                p.reset()
            self._write(_json_response("200 OK", stats_of(self.settings)))
        elif method == b"get" and path == b"/timeline":
            events = {str(p.port): p.events.tolist() for p in self.settings.ports}
            self._write(_json_response("200 OK", {"clock": "monotonic", "events": events}))
        elif method == b"get" and path in (b"/health", b"/v1/models"):
            self._write(_json_response("200 OK", {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}))
        else:
            self._write(_json_response("404 Not Found", {"error": {"message": "no such route", "type": "not_found"}}))

    def _serve(self, api: str, body: bytes) -> None:
        try:
            req = _decode(body)
            model = str(req.get("model") or "fake-model")
            stream = req.get("stream") is True
            n = req.get("max_tokens" if api == "chat" else "max_output_tokens") or self.settings.tokens
            n = max(0, min(int(n), 100_000))
            usage = bool((req.get("stream_options") or {}).get("include_usage"))
        except (ValueError, TypeError, AttributeError):
            self.stats.bad_requests += 1
            error = {"error": {"message": "bad request body", "type": "invalid_request_error"}}
            self._write(_json_response("400 Bad Request", error))
            return
        pieces = answer(api, stream, model, n, usage)
        if api == "responses":
            pieces = unique_ids(pieces)
        s = self.settings
        self.stats.enter(stream)
        if s.latency.zero and not (stream and (s.write_each or s.token_interval_s > 0)):
            # The common benchmark case, answered without a task: one write, in flight for no time.
            self._write(pieces[0] if len(pieces) == 1 else b"".join(pieces))
            self.stats.leave()
            return
        self.busy = True
        self.task = asyncio.get_running_loop().create_task(self._slow(pieces, stream))

    async def _slow(self, pieces: list[bytes], stream: bool) -> None:
        s = self.settings
        try:
            delay = s.latency.draw_s()
            if delay > 0:
                await asyncio.sleep(delay)
            if not stream or not (s.write_each or s.token_interval_s > 0):
                self._write(b"".join(pieces))
            else:
                self._write(pieces[0])
                for i, piece in enumerate(pieces[1:]):
                    if i and s.token_interval_s > 0:
                        await asyncio.sleep(s.token_interval_s)
                    elif i:
                        await asyncio.sleep(0)  # one event per write: the relay sees every chunk
                    if self.writable is not None:
                        await self.writable
                    if self.closed:
                        raise asyncio.CancelledError
                    self._write(piece)
        except asyncio.CancelledError:
            self.stats.disconnects += 1
        finally:
            self.stats.leave()
            self.task = None
            self.busy = False
        if self.buf and not self.closed:
            self._next()


def stats_of(settings: Settings) -> dict[str, Any]:
    ports = [p.as_dict() for p in settings.ports]
    return {
        "pid": os.getpid(),
        "latency": settings.latency.spec,
        "total": sum(p["total"] for p in ports),
        "over_cap": sum(p["over_cap"] for p in ports),
        "ports": ports,
    }


# --- main -------------------------------------------------------------------------------------------


def _factory(settings: Settings, stats: PortStats) -> Callable[[], Handler]:
    return lambda: Handler(settings, stats)


async def serve(host: str, settings: Settings) -> None:
    loop = asyncio.get_running_loop()
    servers = []
    for stats in settings.ports:
        srv = await loop.create_server(_factory(settings, stats), host, stats.port, backlog=4096, reuse_address=True)
        servers.append(srv)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(json.dumps({"upstream": "ready", "pid": os.getpid(), "ports": [p.port for p in settings.ports]}), flush=True)
    await stop.wait()
    for srv in servers:
        srv.close()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, action="append", help="a port to listen on (repeat for several)")
    ap.add_argument("--cap", default="", help="comma-separated concurrency caps, one per --port, for over-cap counts")
    ap.add_argument("--latency", default="0", help="delay before the first byte (ms): 0, fixed:MS, uniform:LO:HI, ...")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=16, help="tokens per answer unless the request says max_tokens")
    ap.add_argument("--token-interval-ms", type=float, default=0.0, help="pause between streamed events")
    ap.add_argument(
        "--write",
        choices=["whole", "each"],
        default="whole",
        help="a zero-latency stream in one write, or one write per event (yielding between)",
    )
    ap.add_argument("--timeline", action="store_true", help="record in-flight changes for GET /timeline")
    ap.add_argument("--no-uvloop", action="store_true")
    a = ap.parse_args(argv)
    if not (a.host.startswith("127.") or a.host in ("localhost", "::1")):
        sys.exit("upstream: refusing to listen beyond loopback")
    ports = a.port or [18000]
    caps: list[int | None] = [int(c) for c in a.cap.split(",") if c.strip()] if a.cap else []
    if caps and len(caps) != len(ports):
        sys.exit("upstream: --cap needs one value per --port")
    caps = caps or [None] * len(ports)
    settings = Settings(
        latency=Latency(a.latency, a.seed),
        tokens=a.tokens,
        token_interval_s=a.token_interval_ms / 1000.0,
        write_each=a.write == "each",
        ports=[PortStats(p, c, a.timeline) for p, c in zip(ports, caps, strict=True)],
    )
    with asyncio.Runner(loop_factory=None if a.no_uvloop else fast_loop_factory()) as runner:
        runner.run(serve(a.host, settings))


def fast_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop when it is installed: the fake must cost far less than what it measures."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


if __name__ == "__main__":
    main()
