"""Logging for edge and node: `--log-level`, and `--log-format text|json` (one JSON object a line).

An edge at load logs a line per request (the access line), so the handler is built for that: the
timestamp's seconds are formatted once a second, and the lines of one event-loop turn go out in one
write (`TurnHandler`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

import msgspec

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("text", "json")
_TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_ENCODER = json.JSONEncoder(separators=(",", ":"), default=str)
_MSGSPEC = msgspec.json.Encoder(enc_hook=str)

TURN_LINES = 256
"""At most this many lines wait for their turn's end; one more writes them at once."""


class _Seconds:
    """A second's text, formatted once: `time.strftime(fmt, convert(t))` for the second of t."""

    def __init__(self, fmt: str, convert: Callable[[float | None], time.struct_time]) -> None:
        self.fmt, self.convert = fmt, convert
        self.last: tuple[int, str] = (-1, "")  # one tuple: a thread between the two sees one or the other

    def __call__(self, t: float) -> str:
        whole, text = self.last
        if whole != int(t):
            text = time.strftime(self.fmt, self.convert(t))
            self.last = (int(t), text)
        return text


class TextFormatter(logging.Formatter):
    """`asctime levelname name: message`, as `logging.Formatter(_TEXT)` writes it, a second's text kept."""

    def __init__(self) -> None:
        super().__init__(_TEXT)
        self._seconds = _Seconds(self.default_time_format, self.converter)

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        if datefmt is not None:
            return super().formatTime(record, datefmt)
        return f"{self._seconds(record.created)},{int(record.msecs):03d}"

    def formatMessage(self, record: logging.LogRecord) -> str:
        return f"{record.asctime} {record.levelname} {record.name}: {record.message}"

    def line(self, t: float, levelno: int, name: str, message: str, fields: dict[str, object]) -> str:
        """`format` of the record logging would make of these at time `t` (no exception, no stack)."""
        ms = int((t - int(t)) * 1000)
        return f"{self._seconds(t)},{ms:03d} {logging.getLevelName(levelno)} {name}: {message}"


class JsonFormatter(logging.Formatter):
    """`{"time", "level", "logger", "message", ...fields}`; an access line adds its fields."""

    def __init__(self) -> None:
        super().__init__()
        self._seconds = _Seconds("%Y-%m-%dT%H:%M:%S", time.gmtime)

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": f"{self._seconds(record.created)}.{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            out.update(fields)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return _ENCODER.encode(out)

    def line(self, t: float, levelno: int, name: str, message: str, fields: dict[str, object]) -> str:
        """`format` of the record logging would make of these at time `t` (no exception, no stack).

        `fields` holds only str, int, bool, None and floats json writes without an exponent (an
        access line's: milliseconds to three decimals): msgspec then writes what json does, 7 times
        faster, unless there is a non-ASCII character or a DEL (json escapes them, msgspec not).
        """
        out: dict[str, Any] = {
            "time": f"{self._seconds(t)}.{int((t - int(t)) * 1000):03d}Z",
            "level": logging.getLevelName(levelno).lower(),
            "logger": name,
            "message": message,
        }
        out.update(fields)
        fast = _MSGSPEC.encode(out)
        if fast.isascii() and b"\x7f" not in fast:
            return fast.decode("ascii")
        return _ENCODER.encode(out)


class TurnHandler(logging.StreamHandler[TextIO]):
    """A stream handler that writes the lines of one event-loop turn in one write.

    A record below WARNING logged inside a running loop is formatted and kept, and the first of a
    turn asks the loop (`call_soon`) to write them all once the turn's callbacks have run. A WARNING
    or worse, a record from outside that loop (another thread, no loop), the `TURN_LINES`+1st line,
    `flush()` and `close()` (logging's shutdown at exit does both) write what is kept first: the
    stream's lines stay in the order they were logged, and a crash loses at most one turn's.
    """

    def __init__(self, stream: TextIO | None = None) -> None:
        super().__init__(stream if stream is not None else sys.stderr)
        self._kept: list[str] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        """The loop asked to write `_kept` at its turn's end (None: none asked)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._put(self.format(record) + self.terminator, record.levelno)
        except RecursionError:
            raise
        except Exception:
            self.handleError(record)

    def line(self, levelno: int, name: str, message: str, fields: dict[str, object]) -> None:
        """What `emit` does with the record logger `name` would make of these, without making it.

        Only for the handler `sole_handler` found: its formatter is iop's, it has no filter.
        """
        formatter = self.formatter
        assert isinstance(formatter, TextFormatter | JsonFormatter)
        self.acquire()
        try:
            self._put(formatter.line(time.time(), levelno, name, message, fields) + self.terminator, levelno)
        except RecursionError:
            raise
        except Exception:
            self.handleError(logging.makeLogRecord({"name": name, "msg": message, "levelno": levelno}))
        finally:
            self.release()

    @property
    def shows_fields(self) -> bool:
        """Whether a record's `fields` (an access line's) are in its line (JSON) or not (text)."""
        return isinstance(self.formatter, JsonFormatter)

    def _put(self, line: str, levelno: int) -> None:
        if levelno < logging.WARNING:
            try:
                loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
            except RuntimeError:
                loop = None
            kept = self._kept
            if loop is not None and (loop is self._loop or not kept) and len(kept) < TURN_LINES:
                kept.append(line)
                if loop is not self._loop:
                    self._loop = loop
                    loop.call_soon(self._turn_end, loop)
                return
        self._write(line)

    def _write(self, line: str = "") -> None:
        kept = self._kept
        if kept:
            kept.append(line)
            line = "".join(kept)
            kept.clear()
        if line:
            self.stream.write(line)
        if hasattr(self.stream, "flush"):
            self.stream.flush()

    def _turn_end(self, loop: asyncio.AbstractEventLoop) -> None:
        self.acquire()
        try:
            if self._loop is loop:
                self._loop = None
            if self._kept:
                self._write()
        except RecursionError:
            raise
        except Exception:
            self.handleError(logging.makeLogRecord({"msg": "the lines of a loop turn", "levelno": logging.INFO}))
        finally:
            self.release()

    def flush(self) -> None:
        self.acquire()
        try:
            if self.stream is not None:
                self._write()
        finally:
            self.release()

    def close(self) -> None:
        try:
            self.flush()
        finally:
            super().close()


def sole_handler(logger: logging.Logger, levelno: int) -> TurnHandler | None:
    """The one handler a record of `logger` at `levelno` would reach, when nothing else could see it.

    That is: one `TurnHandler` with iop's formatter, no filter on it or on the loggers on the way,
    the default record factory. A line for it then needs no `LogRecord` (`TurnHandler.line`), the
    cost of most of an access line. Anything else (another handler, pytest's capture, a filter):
    None, and the caller logs the record.
    """
    if logger.disabled or logging.getLogRecordFactory() is not logging.LogRecord:
        return None
    found: TurnHandler | None = None
    lg: logging.Logger | None = logger
    while lg is not None:
        if lg.filters:
            return None
        for h in lg.handlers:
            if levelno >= h.level:
                if found is not None or type(h) is not TurnHandler or h.filters:
                    return None
                if type(h.formatter) not in (TextFormatter, JsonFormatter):
                    return None
                found = h
        lg = lg.parent if lg.propagate else None
    return found


def handler(fmt: str = "text", stream: TextIO | None = None) -> TurnHandler:
    """The handler `setup` installs: `fmt` lines on `stream` (stderr)."""
    out = TurnHandler(stream)
    out.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    return out


def setup(level: str = "info", fmt: str = "text") -> None:
    """Configure the root logger once for an edge or node process."""
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
        with contextlib.suppress(OSError, ValueError):  # a stream closed under it
            h.flush()
    root.addHandler(handler(fmt))
    # uvicorn's own logging config (if anything applied it) gives its loggers handlers of their
    # own that do not propagate: its lines would bypass this format, tracebacks included.
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        lg = logging.getLogger(name)
        for h in list(lg.handlers):
            lg.removeHandler(h)
        lg.propagate = True
    numeric = getattr(logging, level.upper())
    root.setLevel(numeric)
    # Our own lines are what an operator reads; the libraries' chatter only at debug.
    for name in ("nats", "uvicorn", "httpx"):
        logging.getLogger(name).setLevel(logging.DEBUG if numeric <= logging.DEBUG else logging.WARNING)
