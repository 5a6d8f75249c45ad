"""One model server process: started in its own process group, its output logged, its readiness probed, ended.

A server must not outlive its node, however the node ends: a stop ends its process group; the
node's normal exit ends every group still running (`end_all`, also at interpreter exit); on Linux
the kernel kills the server itself when the node dies by SIGKILL (PR_SET_PDEATHSIG). What a server
started in turn dies with it only if it passes the signal on (most stay in its group: a stop or
the node's exit reaches them).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import ctypes
import logging
import os
import re
import signal
import sys
from collections.abc import Callable
from urllib.parse import urlsplit

from iop.serverconf import ServerSettings

log = logging.getLogger("iop.node.server")

BASE_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "USER")
"""What every server gets from the node's environment, as a CLI adapter's command does."""
LOG_LINE_CHARS = 2000
"""A longer line of a server's output is cut there in the node's log (and in what ready_log sees)."""
READY_POLL_S = 0.1
"""How often ready_url is asked while the server loads."""
PROBE_TIMEOUT_S = 2.0
PR_SET_PDEATHSIG = 1

_running: set[int] = set()
"""Process groups of servers started and not yet seen stopped (what `end_all` ends)."""


def _die_with(parent: int) -> Callable[[], None]:
    """In the child before exec: SIGKILL when the node's thread that started it ends (the node died)."""
    # Looked up here, not in the child: a fork of a process with threads (the trace export, the
    # loop's executor) must not take the dynamic loader's lock, which another thread may hold.
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    kill = int(signal.SIGKILL)

    def prepare() -> None:
        if prctl(PR_SET_PDEATHSIG, kill) != 0 or os.getppid() != parent:
            os._exit(1)  # the node died between the fork and the prctl: do not run orphaned

    return prepare


def end_all() -> None:
    """SIGKILL every server process group still running (the node is exiting)."""
    for pgid in list(_running):
        _signal_group(pgid, signal.SIGKILL)
    _running.clear()


atexit.register(end_all)


class ServerProcess:
    """A started server: its process, the task that logs its output, and whether its ready line was seen."""

    def __init__(self, name: str, cfg: ServerSettings, proc: asyncio.subprocess.Process) -> None:
        self.name = name
        self.cfg = cfg
        self.proc = proc
        self.saw_ready_line = asyncio.Event()
        self._ready_re = re.compile(cfg.ready_log) if cfg.ready_log else None
        self._logger = asyncio.create_task(self._log_output())

    @classmethod
    async def spawn(cls, name: str, cfg: ServerSettings) -> ServerProcess:
        """Start `cfg.command`; raises OSError when it cannot be run at all."""
        env = {k: os.environ[k] for k in (*BASE_ENV, *cfg.env) if k in os.environ}
        proc = await asyncio.create_subprocess_exec(
            *cfg.command,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=env,
            start_new_session=True,  # its own process group: a stop reaches every child it starts
            preexec_fn=_die_with(os.getpid()) if sys.platform == "linux" else None,
        )
        _running.add(proc.pid)
        return cls(name, cfg, proc)

    @property
    def pid(self) -> int:
        return self.proc.pid

    async def _log_output(self) -> None:
        # The server's own words, one log line each, under the provider's name; bounded, so a
        # server writing without newlines cannot make the node hold its output.
        assert self.proc.stdout is not None
        buf = b""
        while True:
            piece = await self.proc.stdout.read(65536)
            if not piece:
                break
            buf += piece
            *lines, buf = buf.split(b"\n")
            if len(buf) > LOG_LINE_CHARS:
                lines.append(buf)
                buf = b""
            for raw in lines:
                self._line(raw)
        if buf:
            self._line(buf)

    def _line(self, raw: bytes) -> None:
        line = raw[:LOG_LINE_CHARS].decode("utf-8", "replace").rstrip("\r")
        log.info("[%s] %s", self.name, line)
        if self._ready_re is not None and self._ready_re.search(line):
            self.saw_ready_line.set()

    async def ready(self) -> None:
        """Return once the server is ready (its URL answers 200, or its ready line came)."""
        if self.cfg.ready_url is None:
            await self.saw_ready_line.wait()
            return
        while True:
            if await answers_200(self.cfg.ready_url):
                return
            await asyncio.sleep(READY_POLL_S)  # the server's readiness lives in another process

    async def stop(self, grace_s: float) -> None:
        """SIGTERM to its process group, SIGKILL after `grace_s`; returns once it has exited."""
        if self.proc.returncode is None:
            _signal_group(self.proc.pid, signal.SIGTERM)
            try:
                async with asyncio.timeout(grace_s):
                    await self.proc.wait()
            except TimeoutError:
                log.warning("[%s] did not exit %gs after SIGTERM: killed", self.name, grace_s)
        # Children it left behind go with it (the group outlives its leader).
        _signal_group(self.proc.pid, signal.SIGKILL)
        await self.proc.wait()
        _running.discard(self.proc.pid)
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(self._logger, 2.0)


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


async def answers_200(url: str) -> bool:
    """Whether a GET of `url` answers 200 now (refused, 503 while loading, or slow: False)."""
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    port = parts.port or (443 if parts.scheme == "https" else 80)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    writer: asyncio.StreamWriter | None = None
    try:
        async with asyncio.timeout(PROBE_TIMEOUT_S):
            reader, writer = await asyncio.open_connection(host, port, ssl=parts.scheme == "https" or None)
            writer.write(f"GET {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nConnection: close\r\n\r\n".encode())
            status = await reader.readline()
    except (OSError, TimeoutError):
        return False
    finally:
        if writer is not None:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
    fields = status.split()
    return len(fields) >= 2 and fields[1] == b"200"
