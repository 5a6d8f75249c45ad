"""The export of finished spans: a bounded buffer a background thread sends in batches over OTLP/HTTP.

A request only appends its span to a list (or counts it dropped when the buffer is full); the
thread wakes every `export_interval_ms`, or as soon as a batch is full, encodes the batch
(iop/tracing/otlp.py) and POSTs it on one kept-alive connection. A failed export is retried while
`export_timeout_s` allows (connection errors, 429, 502, 503, 504, as OTLP says), then its spans
are dropped and counted.
"""

from __future__ import annotations

import http.client
import logging
import re
import socket
import threading
import time
import urllib.parse
from collections.abc import Mapping
from typing import Protocol

from iop.tracing import otlp

log = logging.getLogger("iop.tracing")

BATCH_SPANS = 512
BODY_LIMIT = 65536
"""Most bytes of a collector's answer read (its status is what counts); past it the connection is closed."""
_RETRYABLE = frozenset({429, 502, 503, 504})


def _drained(response: http.client.HTTPResponse, sock: socket.socket | None, deadline: float) -> bool:
    """Read the answer's body up to BODY_LIMIT bytes before `deadline`; False when it is longer or
    slower (a body of any size, or one sent a byte at a time, would hold the export for ever)."""
    if response.length is not None and response.length > BODY_LIMIT:
        return False
    read = 0
    while read <= BODY_LIMIT:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        if sock is not None:
            sock.settimeout(left)
        try:
            chunk = response.read1(BODY_LIMIT + 1 - read)
        except TimeoutError:
            return False
        if not chunk:
            return True
        read += len(chunk)
    return False


class Counts(Protocol):
    """What the export tells its owner (iop.tracing.Tracing): spans sent or lost."""

    def exported_batch(self, count: int, ok: bool) -> None: ...


def headers_of(env: Mapping[str, str]) -> dict[str, str]:
    """The collector's headers from `OTEL_EXPORTER_OTLP_[TRACES_]HEADERS` (`k=v,k2=v2`, URL-encoded)."""
    raw = env.get("OTEL_EXPORTER_OTLP_TRACES_HEADERS") or env.get("OTEL_EXPORTER_OTLP_HEADERS") or ""
    out: dict[str, str] = {}
    for pair in raw.split(","):
        key, eq, value = pair.partition("=")
        if eq and key.strip():
            out[urllib.parse.unquote(key.strip()).lower()] = urllib.parse.unquote(value.strip())
    return out


_TOKEN = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")
"""An HTTP header name (RFC 9110 token)."""


def _sendable(headers: dict[str, str]) -> dict[str, str]:
    """The headers HTTP can carry; each other one is left out, named (never its value: a secret) in a warning."""
    out = {}
    for name, value in headers.items():
        if _TOKEN.match(name) and value.isprintable() and all(ord(c) < 256 for c in value):
            out[name] = value
        else:
            log.warning(
                "OTEL_EXPORTER_OTLP_HEADERS: %r left out: not a header name, or a value HTTP cannot carry", name
            )
    return out


class Exporter:
    """One process part's export thread and its connection to the collector."""

    def __init__(
        self,
        endpoint: str,
        env: Mapping[str, str],
        prefix: tuple[bytes, bytes],
        counts: Counts,
        timeout_s: float,
        interval_ms: int,
    ) -> None:
        url = urllib.parse.urlsplit(endpoint)
        self._https = url.scheme == "https"
        self._host = url.hostname or "localhost"
        self._port = url.port or (443 if self._https else 80)
        self._path = (url.path or "/") + (f"?{url.query}" if url.query else "")
        self._headers = {"content-type": "application/x-protobuf", **_sendable(headers_of(env))}
        compression = env.get("OTEL_EXPORTER_OTLP_TRACES_COMPRESSION") or env.get("OTEL_EXPORTER_OTLP_COMPRESSION")
        self._gzip = (compression or "").strip().lower() == "gzip"
        if self._gzip:
            self._headers["content-encoding"] = "gzip"
        self._cafile = env.get("OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE") or env.get("OTEL_EXPORTER_OTLP_CERTIFICATE")
        self._prefix = prefix
        self._counts = counts
        self._timeout_s = timeout_s
        self._interval_s = interval_ms / 1000
        self.buffer: list[otlp.Encodable] = []
        """Finished spans not yet taken by the thread (appended by the owner, on its own thread)."""
        self.sending = 0
        """Spans taken from the buffer and not yet sent or dropped."""
        self._wake = threading.Event()
        self._stopping = False
        self._aborted = threading.Event()
        self._failed = False
        """A batch failed to be made or sent for a reason of iop's own (logged once)."""
        self._conn: http.client.HTTPConnection | None = None
        self._thread = threading.Thread(target=self._run, name="iop-trace-export", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait(self._interval_s)
            self._wake.clear()
            while self.buffer:
                batch = self.buffer[:BATCH_SPANS]
                self.sending = len(batch)
                del self.buffer[: len(batch)]
                ok = not self._aborted.is_set() and self._export(batch)
                self.sending = 0
                self._counts.exported_batch(len(batch), ok)
            if self._stopping:
                break
        self._close()

    def _export(self, batch: list[otlp.Encodable]) -> bool:
        try:
            return self._send(otlp.request(self._prefix, batch))
        except Exception:  # a bug, not the collector: this batch is lost, the thread and later ones live on
            if not self._failed:
                self._failed = True
                log.exception("trace export: a batch of %d spans not exported", len(batch))
            self._close()
            return False

    def _send(self, body: bytes) -> bool:
        if self._gzip:
            import gzip

            body = gzip.compress(body, 6)
        deadline = time.monotonic() + self._timeout_s
        backoff = 0.05
        while True:
            left = deadline - time.monotonic()
            status = 0
            if left > 0:
                try:
                    status = self._post(body, deadline)
                except (OSError, http.client.HTTPException):
                    self._close()
            if 200 <= status < 300:
                return True
            if status and status not in _RETRYABLE:
                return False
            left = deadline - time.monotonic()
            if left <= 0 or self._aborted.wait(min(backoff, left)):
                return False
            backoff *= 2

    def _post(self, body: bytes, deadline: float) -> int:
        timeout_s = deadline - time.monotonic()
        conn = self._conn
        if conn is None:
            conn = self._connect(timeout_s)
        else:
            conn.timeout = timeout_s
            if conn.sock is not None:
                conn.sock.settimeout(timeout_s)
        conn.request("POST", self._path, body, self._headers)
        sock = conn.sock  # (the connection lets go of it for an answer that closes it)
        response = conn.getresponse()
        if not _drained(response, sock, deadline) or response.will_close:
            self._close()
        return response.status

    def _connect(self, timeout_s: float) -> http.client.HTTPConnection:
        if self._https:
            import ssl

            context = ssl.create_default_context(cafile=self._cafile or None)
            self._conn = http.client.HTTPSConnection(self._host, self._port, timeout=timeout_s, context=context)
        else:
            self._conn = http.client.HTTPConnection(self._host, self._port, timeout=timeout_s)
        return self._conn

    def _close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def shutdown(self, timeout_s: float) -> None:
        """Send what is buffered for up to `timeout_s`, then stop; what is left is dropped."""
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            self._aborted.set()  # a collector that is down: stop retrying now, drop the rest
            self._close()
            self._thread.join(timeout_s)
