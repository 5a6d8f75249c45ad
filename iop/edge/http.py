"""The edge's HTTP/1.1 connections: uvicorn's httptools protocol with the limits a public server needs.

uvicorn bounds neither the size of a request head nor the time a client may take to send it, and it
keeps a connection that never sends a byte open forever. One client streaming a single endless header
grew the edge by ~170 MiB in 40 s and stalled its event loop; 1,100 idle sockets used up a 1,024 file
limit. This protocol refuses both cheaply, before the application (and so before authentication) sees
anything:

- a request head over `max_head_bytes` or with more than `max_headers` headers → 431;
- a head not complete `head_timeout_s` after the connection (or the previous answer) → 408;
- a request body that stalls for `body_idle_timeout_s` → 408;
- more than `max_connections` open connections → 503 for the newcomer;
- protocol garbage → 400; every refusal is OpenAI-style error JSON with `connection: close`.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import socket
import weakref
from typing import Any, cast

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from iop.errors import (
    BadRequest,
    HeadersTooLarge,
    IopError,
    RequestError,
    RequestTimeout,
    Unavailable,
    error_response,
)

log = logging.getLogger("iop.edge")

_REASONS = {
    400: b"Bad Request",
    408: b"Request Timeout",
    431: b"Request Header Fields Too Large",
    503: b"Service Unavailable",
}


LINGER_S = 1.0
"""How long a refused connection is still read (and dropped) before it is closed."""
LINGER_BYTES = 1024 * 1024
"""How much a refused client may still send before its connection is closed at once."""
MAX_LINGERING = 64
"""Refused connections lingering at once; past it a refusal closes at once, so that a flood of
newcomers cannot use up the files kept free beside `max_connections` (connection_cap)."""


class HttpLimits:
    """The numbers the protocol enforces; one instance per edge, shared by every connection."""

    def __init__(
        self,
        *,
        max_head_bytes: int = 64 * 1024,
        max_headers: int = 100,
        head_timeout_s: float = 10.0,
        body_idle_timeout_s: float = 30.0,
        max_connections: int = 4096,
    ) -> None:
        self.max_head_bytes = max_head_bytes
        self.max_headers = max_headers
        self.head_timeout_s = head_timeout_s
        self.body_idle_timeout_s = body_idle_timeout_s
        self.max_connections = max_connections
        self.lingering = 0
        """Refused connections still being read before their close (each holds a file)."""
        self.max_lingering = MAX_LINGERING
        self.open = 0
        """Client connections open now."""
        self.closed = asyncio.Event()
        """Set whenever a connection closes (what waits for room under `max_connections` waits on)."""
        self.refused: dict[int, int] = {}
        """Connections refused so far, by status (shown to operators and asserted by tests)."""
        self.upgraded = 0
        """Connections upgraded to WebSockets so far."""

    def count(self, status: int) -> None:
        self.refused[status] = self.refused.get(status, 0) + 1


_HEAD_START = b"HTTP/1.1 "
_HEAD_END = b"\r\n\r\n"


class HeadWithBody:
    """A connection's transport that sends a response head together with the body that follows it.

    uvicorn writes the head when the application starts its response and the body when it sends
    it: two system calls, and two wake-ups of the client, for every answer. Here a head waits for
    the next write, which follows at once (the edge sends start and body back to back); if none
    comes, it leaves by itself at the end of this turn of the event loop. Every other write goes
    out at once, as before.
    """

    __slots__ = ("_held", "_loop", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held = b""

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._held:
            data, self._held = self._held + data, b""
        elif data[:9] == _HEAD_START and data[-4:] == _HEAD_END:
            self._held = bytes(data)
            self._loop.call_soon(self._release)
            return
        self._transport.write(data)

    def _release(self) -> None:
        if self._held:
            held, self._held = self._held, b""
            if not self._transport.is_closing():
                self._transport.write(held)

    def close(self) -> None:
        self._release()
        self._transport.close()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + len(self._held)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


WATCH = "iop.watch"
"""Scope key of a request's `ClientWatch`, on requests this protocol serves."""


class ClientWatch:
    """Cancels a request's task if its client leaves before the answer is complete.

    What a task per request blocked in `receive()` did (`asgi.watch_disconnect`): the connection
    calls `gone()` where uvicorn marks its request disconnected, so no task, future or loop turn
    is spent on a client that stays.
    """

    __slots__ = ("_cycle", "_task")

    def __init__(self, cycle: Any) -> None:
        # Weakly: the request's scope holds this watch, and its cycle the scope. A strong reference
        # would make every request a reference cycle, left for the cyclic collector to find.
        self._cycle = weakref.ref(cycle)
        self._task: asyncio.Task[Any] | None = None

    def start(self, task: asyncio.Task[Any]) -> None:
        """Watch for `task` until `stop()`; a client already gone cancels it at once."""
        cycle = self._cycle()
        if cycle is None:
            return
        self._task = task
        cycle.flow.resume_reading()  # as receive() does: a connection's close is read to be seen
        if cycle.disconnected:
            task.cancel()

    def stop(self) -> None:
        self._task = None

    def gone(self) -> None:
        cycle = self._cycle()
        if self._task is not None and cycle is not None and cycle.disconnected:
            self._task.cancel()
            self._task = None


def protocol_class(limits: HttpLimits) -> type[asyncio.Protocol]:
    """A protocol class bound to `limits`, for `uvicorn.Config(http=...)`."""

    class Bound(LimitedHttpProtocol):
        pass

    Bound.limits = limits
    return Bound


class LimitedHttpProtocol(HttpToolsProtocol):
    limits: HttpLimits = HttpLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_open = True
        self._head_bytes = 0
        self._header_count = 0
        self._body_open = False
        self._refusing = 0
        self._pending: RequestError | None = None
        """A refusal found by a parser callback, sent once the parser returns (it cannot be stopped mid-read)."""
        self._parsed_head = 0
        self._discarded = 0
        self._lingers = False
        self._timer: asyncio.TimerHandle | None = None
        self._watch: ClientWatch | None = None
        """The latest request's: uvicorn marks only that one disconnected when the client leaves."""

    # The connection

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(HeadWithBody(transport, self.loop))  # type: ignore[arg-type]
        self.limits.open += 1
        if len(self.connections) > self.limits.max_connections:
            self._refuse(
                Unavailable(
                    "the edge has too many open connections; retry shortly",
                    code="too_many_connections",
                    headers={"Retry-After": "1"},
                )
            )
            return
        self._arm(self.limits.head_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._lingers:
            self.limits.lingering -= 1
        self.limits.open -= 1
        self.limits.closed.set()
        super().connection_lost(exc)
        self._gone()

    def data_received(self, data: bytes) -> None:
        if self._refusing:
            # Lingering after a refusal: read and drop, so the close does not reset the connection
            # (a reset would destroy the error answer before the client read it).
            self._discarded += len(data)
            if self._discarded > LINGER_BYTES:
                self.transport.close()
            return
        if self._head_open:
            self._head_bytes += len(data)
        elif self._body_open:
            self._arm(self.limits.body_idle_timeout_s)
        super().data_received(data)
        if self._refusing:
            return
        if self._pending is not None:
            # A head over a limit inside this one read (the parser saw it whole): refuse it now,
            # not after the head timeout, and before the application ever sees it.
            self._refuse(self._pending)
            return
        if self._head_open and self._head_bytes > self.limits.max_head_bytes:
            # Everything fed while the head is still open was head: refuse before it grows further.
            self._refuse(HeadersTooLarge(f"request head larger than {self.limits.max_head_bytes} bytes"))

    # Parser callbacks (called inside feed_data)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if not self._head_open:
            # The next request on a kept-alive connection: its head starts now.
            self._head_open = True
            self._head_bytes = 0
            self._parsed_head = 0
            self._header_count = 0
            self._arm(self.limits.head_timeout_s)

    def on_url(self, url: bytes) -> None:
        self._parsed_head += len(url)
        self._check_head()
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        # Counted as parsed, not as read: a whole oversized head can arrive in one read.
        self._header_count += 1
        self._parsed_head += len(name) + len(value) + 4
        self._check_head()
        if self._pending is None:
            super().on_header(name, value)

    def _check_head(self) -> None:
        if self._pending is not None:
            return
        if self._header_count > self.limits.max_headers:
            self._pending = HeadersTooLarge(f"more than {self.limits.max_headers} request headers")
        elif self._parsed_head > self.limits.max_head_bytes:
            self._pending = HeadersTooLarge(f"request head larger than {self.limits.max_head_bytes} bytes")

    def on_headers_complete(self) -> None:
        self._head_open = False
        if self._refusing or self._pending is not None:
            return  # data_received sends the refusal when the parser returns
        self._body_open = True
        self._arm(self.limits.body_idle_timeout_s)
        before = self.cycle
        super().on_headers_complete()
        if self.cycle is not before:  # a request to answer (not a WebSocket's upgrade)
            self._watch = ClientWatch(self.cycle)
            cast(dict[str, Any], self.scope)[WATCH] = self._watch

    def on_body(self, body: bytes) -> None:
        if not self._refusing and self._pending is None:
            super().on_body(body)

    def on_message_complete(self) -> None:
        self._body_open = False
        self._disarm()
        if not self._refusing and self._pending is None:
            super().on_message_complete()

    def handle_websocket_upgrade(self) -> None:
        if self._refusing or self._pending is not None:
            return  # refused while the head came in (e.g. too many headers): the answer is on its way
        # The head is whole and the body timer must not fire on a connection that is now a socket;
        # from here the WebSocket protocol owns the transport (and counts its close).
        self._head_open = self._body_open = False
        self._disarm()
        self.limits.upgraded += 1
        super().handle_websocket_upgrade()

    # Refusals

    def send_400_response(self, msg: str) -> None:
        self._refuse(BadRequest(f"malformed HTTP request: {msg}", code="bad_http"))

    def _refuse(self, exc: RequestError) -> None:
        status = exc.status
        self._refusing = status
        self._head_open = self._body_open = False
        self._disarm()
        self.limits.count(status)
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            # The application may be waiting for more body: tell it the client is gone.
            self.cycle.disconnected = True
            self.cycle.message_event.set()
            self._gone()
        if self.cycle is not None and self.cycle.response_started:
            # An answer was already sent or is on its way (e.g. a 401 before the body was read): end it.
            self.transport.close()
            return
        response = error_response(exc)
        body = response.body
        head = b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n" % (
            status,
            _REASONS[status],
            len(body),
        )
        for name, value in response.headers.items():
            head += b"%s: %s\r\n" % (name.lower().encode(), value.encode())
        self.transport.write(head + b"\r\n" + body)
        if self.transport.can_write_eof() and self.limits.lingering < self.limits.max_lingering:
            self._lingers = True
            self.limits.lingering += 1
            # Half-close and linger briefly (nginx's lingering close): the client reads the answer
            # even while it is still sending.
            self.transport.write_eof()
            self._timer = self.loop.call_later(LINGER_S, self.transport.close)
        else:
            self.transport.close()

    def _gone(self) -> None:
        """The request uvicorn marked disconnected (its latest) is over: cancel its task."""
        if self._watch is not None:
            self._watch.gone()

    def _timed_out(self) -> None:
        self._timer = None
        if self._head_open:
            self._refuse(
                RequestTimeout(
                    f"request head not received within {self.limits.head_timeout_s:g}s", code="header_timeout"
                )
            )
        elif self._body_open:
            self._refuse(
                RequestTimeout(f"request body stalled for {self.limits.body_idle_timeout_s:g}s", code="body_timeout")
            )

    def _arm(self, delay_s: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self.loop.call_later(delay_s, self._timed_out)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


def bind(listen: str) -> socket.socket:
    """A listening TCP socket on `host:port`; a busy or forbidden address is one clear error."""
    host, _, port = listen.rpartition(":")
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP by name: asyncio's loop turns Nagle's algorithm off (TCP_NODELAY) only on sockets
    # whose proto says TCP, and an accepted connection inherits the listener's proto, which
    # socket.socket() leaves at 0. With Nagle on, a streamed answer's next small write waited for
    # the client's delayed ACK (~40 ms) and the events behind it arrived in one lump. uvloop sets
    # TCP_NODELAY on every TCP socket; this keeps IOP_LOOP=asyncio (and platforms without uvloop) alike.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, int(port)))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise ListenError(f"edge.listen: cannot listen on {listen}: {exc.strerror or exc}") from exc
    sock.set_inheritable(True)
    return sock


class ListenError(IopError):
    """The edge's HTTP address cannot be bound (in use, not local, not permitted)."""


FD_RESERVE_MIN = 64
"""Files kept free beside client connections (NATS, the store, logs, refused newcomers lingering)."""


def connection_cap(max_connections: int) -> int:
    """`max_connections`, lowered when the open-files limit could not hold that many.

    Past the limit accept() fails with EMFILE and the newcomer is reset (or waits in the backlog),
    never told anything; under the cap it is accepted and gets 503 `too_many_connections`. The
    reserve is an eighth of the limit, at least FD_RESERVE_MIN.
    """
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return max_connections
    cap = max(16, soft - max(FD_RESERVE_MIN, soft // 8))
    if cap < max_connections:
        log.warning(
            "edge.http.max_connections %d lowered to %d: the open-files limit is %d (raise it: ulimit -n)",
            max_connections,
            cap,
            soft,
        )
        return cap
    return max_connections


def raise_fd_limit() -> int:
    """Raise the soft open-files limit to the hard one (each connection is a file); returns the new limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open-files limit from %d to %d: %s", soft, hard, exc)
            return soft
        return hard
    return soft
