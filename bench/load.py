"""A lean closed-loop HTTP/1.1 load generator: keep-alive connections, bounded in count and in time.

    python -m bench.load --url http://127.0.0.1:8080 --model bench [--api chat|responses] [--stream]
        [-c 32] [-n 5000] [--max-seconds 10] [--warmup 100] [--procs 1] [--max-tokens N]

Each of `-c` connections sends one request at a time and the next as soon as the answer's last byte
arrived. Per answer it measures the latency to the last byte, the time to the first body byte
(TTFB), the SSE events received and the socket reads they took; it checks that the answer is
complete (a chat stream ends with `[DONE]`, a Responses stream with `response.completed`). At most
`-n` measured requests are sent (after `--warmup` unmeasured ones) and none after `--max-seconds`;
whatever is still running `--grace-s` later is aborted and counted as `unfinished`. Only loopback
targets are accepted. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import resource
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, cast
from urllib.parse import urlsplit

from iop.percentile import nearest_rank

clock = time.monotonic
"""CLOCK_MONOTONIC: the same clock in every process, so our times line up with the upstream's."""

# --- requests ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """Where the requests go; loopback only."""

    host: str
    port: int
    path: str

    @classmethod
    def of(cls, url: str, api: str = "chat") -> Target:
        """A base URL (`http://h:p` or `http://h:p/v1`) or a full endpoint URL."""
        u = urlsplit(url)
        host = u.hostname or "127.0.0.1"
        if not (host.startswith("127.") or host in ("localhost", "::1")):
            raise SystemExit(f"load: only loopback targets, not {host!r}")
        path = u.path.rstrip("/")
        if not path.endswith(("/chat/completions", "/responses")):
            path = (path if path.endswith("/v1") else path + "/v1") + endpoint(api)
        return cls(host, u.port or 80, path)


def endpoint(api: str) -> str:
    return "/chat/completions" if api == "chat" else "/responses"


def body_of(api: str, model: str, stream: bool, max_tokens: int = 0, prompt: str = "Say hello.") -> bytes:
    """A minimal request of the API; `max_tokens` (when set) tells the bench upstream the answer's length."""
    req: dict[str, Any]
    if api == "chat":
        req = {"model": model, "messages": [{"role": "user", "content": prompt}], "stream": stream}
        if max_tokens:
            req["max_tokens"] = max_tokens
    else:
        req = {"model": model, "input": prompt, "stream": stream}
        if max_tokens:
            req["max_output_tokens"] = max_tokens
    return json.dumps(req, separators=(",", ":")).encode()


def request_of(target: Target, body: bytes) -> bytes:
    return (
        f"POST {target.path} HTTP/1.1\r\nhost: {target.host}:{target.port}\r\n"
        f"content-type: application/json\r\naccept: */*\r\ncontent-length: {len(body)}\r\n\r\n"
    ).encode() + body


# --- one connection ---------------------------------------------------------------------------------

_END_MARKERS = (b"data: [DONE]", b"event: response.completed")
"""How a complete chat stream and a complete Responses stream end."""
_HEAD, _LENGTH, _SIZE, _DATA, _DATA_END, _TRAILER, _UNTIL_CLOSE, _DONE = range(8)


@dataclass
class Answer:
    """What one request got back, with its timestamps on `clock`."""

    status: int = 0
    t_first: float = 0.0
    t_end: float = 0.0
    events: int = 0
    reads: int = 0
    header: str | None = None
    ok: bool = False
    keep_alive: bool = True


class Conn(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection carrying one request at a time; parses as bytes arrive."""

    def __init__(self, capture: bytes = b"") -> None:
        self.capture = capture  # a response header to keep (lower case), e.g. b"x-iop-queue-ms"
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.future: asyncio.Future[Answer] | None = None
        self.buf = bytearray()
        self.state = _DONE
        self.left = 0
        self.last_nl = False
        self.tail = b""
        self.complete = False
        self.answer = Answer()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.state == _UNTIL_CLOSE:
            self._finish(clock())
        elif self.future is not None and not self.future.done():
            self.future.set_exception(ConnectionError("connection closed mid-answer"))

    def send(self, request: bytes) -> asyncio.Future[Answer]:
        assert self.transport is not None
        self.future = asyncio.get_running_loop().create_future()
        self.answer = Answer()
        self.state = _HEAD
        self.buf.clear()
        self.last_nl = False
        self.tail = b""
        self.complete = False
        self.transport.write(request)
        return self.future

    def abort(self) -> None:
        if self.future is not None and not self.future.done():
            self.future.set_exception(TimeoutError("no complete answer in time"))
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def _finish(self, now: float) -> None:
        self.state = _DONE
        a = self.answer
        a.t_end = now
        a.ok = a.status == 200 and (self.complete or (a.events == 0 and self.tail.endswith(b"}")))
        if self.future is not None and not self.future.done():
            self.future.set_result(a)

    def _body(self, piece: bytes | bytearray) -> None:
        # Counts SSE events (blank-line separators), also across read and chunk boundaries.
        if not piece:
            return
        n = piece.count(b"\n\n")
        if self.last_nl and piece[:1] == b"\n":
            n += 1
        self.answer.events += n
        self.last_nl = piece[-1:] == b"\n"
        if not self.complete:
            # The end marker of a stream, also when a read boundary splits it.
            seam = self.tail[-24:] + bytes(piece[:24])
            self.complete = any(m in piece or m in seam for m in _END_MARKERS)
        self.tail = (self.tail + bytes(piece[-32:]))[-32:]

    def data_received(self, data: bytes) -> None:
        now = clock()
        a = self.answer
        a.reads += 1
        buf = self.buf
        buf += data
        if self.state == _HEAD:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                return
            self._head(bytes(buf[:end]).lower())
            del buf[: end + 4]
        if buf and not a.t_first:
            a.t_first = now
        pos = 0
        while True:
            st = self.state
            if st == _LENGTH:
                take = min(self.left, len(buf) - pos)
                self._body(buf[pos : pos + take])
                pos += take
                self.left -= take
                if self.left == 0:
                    self._finish(now)
                break
            if st == _SIZE:
                nl = buf.find(b"\r\n", pos)
                if nl < 0:
                    break
                size = int(bytes(buf[pos:nl]).split(b";", 1)[0], 16)
                pos = nl + 2
                self.left = size
                self.state = _DATA if size else _TRAILER
            elif st == _DATA:
                take = min(self.left, len(buf) - pos)
                if take <= 0:
                    break
                self._body(buf[pos : pos + take])
                pos += take
                self.left -= take
                if self.left == 0:
                    self.state = _DATA_END
            elif st == _DATA_END:
                if len(buf) - pos < 2:
                    break
                pos += 2
                self.state = _SIZE
            elif st == _TRAILER:
                nl = buf.find(b"\r\n", pos)
                if nl < 0:
                    break
                last = nl == pos  # the empty line after the last chunk (and any trailers)
                pos = nl + 2
                if last:
                    self._finish(now)
                    break
            elif st == _UNTIL_CLOSE:
                self._body(buf[pos:])
                pos = len(buf)
                break
            else:
                break
        if pos:
            del buf[:pos]

    def _head(self, head: bytes) -> None:
        a = self.answer
        try:
            a.status = int(head[9:12])
        except ValueError:
            a.status = 0
        a.keep_alive = b"\r\nconnection: close" not in head
        if self.capture:
            i = head.find(b"\r\n" + self.capture + b":")
            if i >= 0:
                j = head.find(b"\r\n", i + 2)
                a.header = head[i + len(self.capture) + 3 : j if j >= 0 else len(head)].strip().decode()
        if b"\r\ntransfer-encoding: chunked" in head:
            self.state = _SIZE
            return
        i = head.find(b"\r\ncontent-length:")
        if i >= 0:
            j = head.find(b"\r\n", i + 2)
            self.left = int(head[i + 17 : j if j >= 0 else len(head)])
            self.state = _LENGTH
            if self.left == 0:
                self._finish(clock())
            return
        self.state = _UNTIL_CLOSE
        a.keep_alive = False


# --- a closed loop ----------------------------------------------------------------------------------


@dataclass
class LoadSpec:
    """One load run: `concurrency` connections, at most `requests` measured requests and `max_seconds`."""

    target: Target
    body: bytes
    alt_body: bytes | None = None
    """When set, requests alternate between `body` and this one."""
    concurrency: int = 1
    requests: int = 1000
    max_seconds: float = 10.0
    warmup: int = 0
    timeout_s: float = 60.0
    grace_s: float = 10.0
    capture: str = ""
    keep_samples: bool = False


@dataclass
class Sample:
    t_send: float
    t_first: float
    t_end: float
    events: int
    reads: int
    header: str | None


@dataclass
class Raw:
    """The measured phase of one process: samples, failures and the clock around it."""

    samples: list[Sample] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    t0: float = 0.0
    t1: float = 0.0
    cpu_s: float = 0.0


async def _phase(spec: LoadSpec, conns: list[Conn | None], n: int, deadline: float, raw: Raw | None) -> None:
    loop = asyncio.get_running_loop()
    requests = [request_of(spec.target, b) for b in (spec.body, spec.alt_body) if b is not None]
    issued = 0
    capture = spec.capture.lower().encode()

    async def worker(i: int) -> None:
        nonlocal issued
        while issued < n and clock() < deadline:
            request = requests[issued % len(requests)]
            issued += 1
            conn = conns[i]
            if conn is None or conn.closed:
                try:
                    _, proto = await loop.create_connection(lambda: Conn(capture), spec.target.host, spec.target.port)
                except OSError as exc:
                    if raw is not None:
                        raw.errors[f"connect:{type(exc).__name__}"] += 1
                    await asyncio.sleep(0.05)
                    continue
                conn = conns[i] = proto
            t_send = clock()
            timer = loop.call_later(spec.timeout_s, conn.abort)
            try:
                a = await conn.send(request)
            except TimeoutError:
                conns[i] = None
                if raw is not None:
                    raw.errors["timeout"] += 1
                continue
            except ConnectionError:
                conns[i] = None
                if raw is not None:
                    raw.errors["connection_lost"] += 1
                continue
            finally:
                timer.cancel()
            if not a.keep_alive:
                conn.abort()
                conns[i] = None
            if raw is None:
                continue
            if not a.ok:
                raw.errors[f"http_{a.status}" if a.status != 200 else "incomplete_answer"] += 1
                continue
            raw.samples.append(Sample(t_send, a.t_first or a.t_end, a.t_end, a.events, a.reads, a.header))

    tasks = [asyncio.ensure_future(worker(i)) for i in range(len(conns))]
    _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - clock()) + spec.grace_s)
    for t in pending:
        t.cancel()
    for i, c in enumerate(conns):
        if c is not None and c.future is not None and not c.future.done():
            c.abort()
            conns[i] = None
    if pending:
        await asyncio.wait(pending, timeout=1.0)
        if raw is not None:
            raw.errors["unfinished"] += len(pending)


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def _run_one(spec: LoadSpec, concurrency: int, requests: int, warmup: int, go: Callable[[], None]) -> Raw:
    loop = asyncio.get_running_loop()
    capture = spec.capture.lower().encode()
    conns: list[Conn | None] = []
    for _ in range(concurrency):
        try:
            _, proto = await loop.create_connection(lambda: Conn(capture), spec.target.host, spec.target.port)
            conns.append(proto)
        except OSError:
            conns.append(None)  # the worker retries and counts it
    if warmup:
        await _phase(spec, conns, warmup, clock() + min(spec.max_seconds, 30.0), None)
    # The hook blocks (a barrier, or reading /proc): it runs outside the loop's measured time.
    await loop.run_in_executor(None, go)
    raw = Raw(t0=clock(), cpu_s=_cpu_s())
    await _phase(spec, conns, requests, raw.t0 + spec.max_seconds, raw)
    raw.t1 = clock()
    raw.cpu_s = _cpu_s() - raw.cpu_s
    for c in conns:
        if c is not None and c.transport is not None:
            c.transport.close()
    return raw


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop when installed: the client must cost far less than what it measures."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def _in_loop(spec: LoadSpec, concurrency: int, requests: int, warmup: int, go: Callable[[], None]) -> Raw:
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(_run_one(spec, concurrency, requests, warmup, go))


def _child(spec: LoadSpec, conc: int, n: int, warmup: int, ready: Any, start: Any, out: Any) -> None:
    """One forked load process: warm up, wait until every process and the parent are ready, measure."""

    def go() -> None:
        ready.wait()
        start.wait()

    out.put(_in_loop(spec, conc, n, warmup, go))


@dataclass
class LoadResult:
    """A run's figures (times in ms); `samples` only with `keep_samples`."""

    count: int
    errors: dict[str, int]
    wall_s: float
    rps: float
    latency_ms: dict[str, float] | None
    ttfb_ms: dict[str, float] | None
    events: int
    events_per_s: float
    events_per_answer: float
    reads_per_answer: float
    header_ms: dict[str, float] | None
    client_cpu_s: float
    samples: list[Sample] | None = None

    def brief(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("samples")
        return d


def run(spec: LoadSpec, procs: int = 1, on_start: Callable[[], None] | None = None) -> LoadResult:
    """Run `spec` in this process (or `procs` forked ones); `on_start` runs just before measuring."""
    procs = max(1, min(procs, spec.concurrency))

    def hook() -> None:
        if on_start is not None:
            on_start()

    if procs == 1:
        raws = [_in_loop(spec, spec.concurrency, spec.requests, spec.warmup, hook)]
    else:
        ctx = mp.get_context("fork")
        ready, start = ctx.Barrier(procs + 1), ctx.Barrier(procs + 1)
        out = ctx.Queue()
        share = [_split(spec.concurrency, procs, i) for i in range(procs)]
        children = [
            ctx.Process(
                target=_child,
                args=(
                    spec,
                    share[i],
                    _split(spec.requests, procs, i),
                    _split(spec.warmup, procs, i),
                    ready,
                    start,
                    out,
                ),
                daemon=True,
            )
            for i in range(procs)
        ]
        for c in children:
            c.start()
        try:
            ready.wait(timeout=spec.max_seconds + 120)
            hook()
            start.wait(timeout=30)
            raws = [out.get(timeout=spec.max_seconds + spec.grace_s + spec.timeout_s + 60) for _ in children]
        finally:
            for c in children:
                c.join(timeout=5)
                if c.is_alive():
                    c.kill()  # our own forked child, by its handle
    return summarize(raws, spec.keep_samples)


def _split(total: int, parts: int, i: int) -> int:
    return total // parts + (1 if i < total % parts else 0)


def percentiles(values_ms: list[float]) -> dict[str, float] | None:
    """p50/p90/p99 (nearest rank, as everywhere in iop), mean, min, max."""
    if not values_ms:
        return None
    v = sorted(values_ms)
    return {
        "p50": round(pct(v, 50), 4),
        "p90": round(pct(v, 90), 4),
        "p99": round(pct(v, 99), 4),
        "mean": round(sum(v) / len(v), 4),
        "min": round(v[0], 4),
        "max": round(v[-1], 4),
    }


def pct(values: list[float], q: float) -> float:
    """iop's own percentile (nearest rank, q in percent), so a bench's p90 reads like /usage's."""
    p = nearest_rank(values, q / 100.0)
    assert p is not None, "a percentile of no samples"
    return p


def summarize(raws: list[Raw], keep_samples: bool) -> LoadResult:
    samples = [s for r in raws for s in r.samples]
    errors: Counter[str] = Counter()
    for r in raws:
        errors.update(r.errors)
    wall = max(r.t1 for r in raws) - min(r.t0 for r in raws)
    events = sum(s.events for s in samples)
    headers = []
    for s in samples:
        if s.header is not None:
            try:
                headers.append(float(s.header))
            except ValueError:
                errors["bad_header"] += 1
    n = len(samples)
    return LoadResult(
        count=n,
        errors=dict(errors),
        wall_s=round(wall, 4),
        rps=round(n / wall, 2) if wall > 0 else 0.0,
        latency_ms=percentiles([(s.t_end - s.t_send) * 1000 for s in samples]),
        ttfb_ms=percentiles([(s.t_first - s.t_send) * 1000 for s in samples]),
        events=events,
        events_per_s=round(events / wall, 1) if wall > 0 else 0.0,
        events_per_answer=round(events / n, 2) if n else 0.0,
        reads_per_answer=round(sum(s.reads for s in samples) / n, 2) if n else 0.0,
        header_ms=percentiles(headers),
        client_cpu_s=round(sum(r.cpu_s for r in raws), 4),
        samples=samples if keep_samples else None,
    )


# --- holding many requests open ---------------------------------------------------------------------


class Held:
    """Many requests sent and left waiting, each on its own connection, until `close()`."""

    def __init__(self) -> None:
        self.conns: list[Conn] = []
        self.futures: list[asyncio.Future[Answer]] = []
        self.failed_connects = 0

    async def open(self, target: Target, body: bytes, n: int, batch: int = 256) -> None:
        """Connect and send, `batch` at a time (the server's accept backlog is finite)."""
        loop = asyncio.get_running_loop()
        request = request_of(target, body)
        while len(self.conns) + self.failed_connects < n:
            k = min(batch, n - len(self.conns) - self.failed_connects)
            got = await asyncio.gather(
                *(loop.create_connection(Conn, target.host, target.port) for _ in range(k)), return_exceptions=True
            )
            for g in got:
                if isinstance(g, BaseException):
                    self.failed_connects += 1
                    continue
                conn = g[1]
                self.conns.append(conn)
                fut = conn.send(request)
                fut.add_done_callback(_consume)
                self.futures.append(fut)

    def answered(self) -> int:
        return sum(1 for f in self.futures if f.done())

    def close(self) -> None:
        for c in self.conns:
            if c.transport is not None:
                c.transport.abort()


def _consume(fut: asyncio.Future[Answer]) -> None:
    if not fut.cancelled():
        fut.exception()  # retrieved: a closed connection is the expected end here


# --- command line -----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", required=True, help="base URL or full endpoint URL (loopback only)")
    ap.add_argument("--model", default="bench")
    ap.add_argument("--api", choices=["chat", "responses"], default="chat")
    ap.add_argument("--stream", action="store_true")
    ap.add_argument("--max-tokens", type=int, default=0, help="answer length asked of the upstream")
    ap.add_argument("-c", "--concurrency", type=int, default=1)
    ap.add_argument("-n", "--requests", type=int, default=1000)
    ap.add_argument("--max-seconds", type=float, default=10.0)
    ap.add_argument("--warmup", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=60.0, help="per request (s)")
    ap.add_argument("--grace-s", type=float, default=10.0)
    ap.add_argument("--procs", type=int, default=1, help="client processes")
    ap.add_argument("--capture", default="", help="a numeric response header to summarize, e.g. x-iop-queue-ms")
    a = ap.parse_args(argv)
    if a.concurrency < 1 or a.requests < 1 or a.max_seconds <= 0:
        sys.exit("load: -c and -n must be >= 1 and --max-seconds > 0")
    spec = LoadSpec(
        target=Target.of(a.url, a.api),
        body=body_of(a.api, a.model, a.stream, a.max_tokens),
        concurrency=a.concurrency,
        requests=a.requests,
        max_seconds=a.max_seconds,
        warmup=a.warmup,
        timeout_s=a.timeout,
        grace_s=a.grace_s,
        capture=a.capture,
    )
    result = run(spec, a.procs)
    print(json.dumps({"url": a.url, "api": a.api, "stream": a.stream, "concurrency": a.concurrency, **result.brief()}))


if __name__ == "__main__":
    main()
