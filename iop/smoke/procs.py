"""The processes `iop smoke` starts: spawned as a user would, logged to files, stopped in order, never orphaned."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import iop

TAIL_LINES = 12
STOP_GRACE_S = 10.0
"""How long each group (nodes, then the edge) has to stop after SIGTERM before SIGKILL."""
_POLL_S = 0.02


def iop_command() -> list[str]:
    """How to start iop again: the archive this process runs from, else `python -m iop`.

    The archive's bootstrap sets IOP_ARCHIVE (see iop/_bootstrap.py); a child started from it
    unpacks nothing, the cache is already warm.
    """
    archive = os.environ.get("IOP_ARCHIVE")
    if archive and os.path.isfile(archive):
        # Keep a bare `python -S iop.pyz` bare in the children too: the archive must be enough.
        return [sys.executable, *(["-S"] if sys.flags.no_site else []), archive]
    return [sys.executable, "-m", "iop"]


def child_env(tmp: Path) -> dict[str, str]:
    """The environment children run with: the user's, plus where iop and temporary files live."""
    env = dict(os.environ)
    if "IOP_ARCHIVE" not in env:
        # `-m iop` must find this very iop even when it is not installed (a source checkout).
        source_root = str(Path(iop.__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (source_root, env.get("PYTHONPATH", "")) if p)
    # Anything a child writes to a temporary file (the embedded nats-server's config, a CLI tool's
    # scratch files) lands in smoke's own folder, which goes away at the end even if a child is killed.
    env["TMPDIR"] = str(tmp)
    env["PYTHONUNBUFFERED"] = "1"
    return env


@dataclass(frozen=True)
class ProcRef:
    """A process smoke did not start itself but must not leave behind (the edge's nats-server)."""

    pid: int
    started: str | None
    """Its start time (Linux: clock ticks since boot), so a reused pid is never signalled."""

    def alive(self) -> bool:
        if self.started is not None:
            return _start_time(self.pid) == self.started
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


@dataclass(eq=False)
class Child:
    """One process smoke started, with its log file."""

    name: str
    role: str  # "edge" or "node"
    proc: asyncio.subprocess.Process
    log: Path
    helpers: list[ProcRef] = field(default_factory=list)
    """Processes it started that must go with it (found once it is ready)."""

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def exit_code(self) -> int | None:
        return self.proc.returncode

    def lines(self) -> list[str]:
        """Its log so far, without blank lines."""
        try:
            text = self.log.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return []
        return [line for line in text.splitlines() if line.strip()]

    def tail(self, lines: int = TAIL_LINES) -> list[str]:
        return self.lines()[-lines:]

    def describe_exit(self) -> str:
        """`node gpu-a-node exited with status 1; last lines of its log: ...` (one string, indented lines)."""
        code = self.exit_code
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with status {code}"
        lines = self.tail()
        log = "".join(f"\n      | {line}" for line in lines) if lines else " (its log is empty)"
        who = self.role if self.name == self.role else f"{self.role} {self.name}"
        return f"{who} {how}; last lines of its log:{log}"


class Children:
    """Starts and stops smoke's processes. Every one is in its own session, so a Ctrl-C in the
    terminal reaches only smoke, which then stops them in order: nodes first, then the edge."""

    def __init__(self, workdir: Path, env: dict[str, str], cwd: str) -> None:
        self.workdir = workdir
        self.env = env
        self.cwd = cwd
        self.children: list[Child] = []
        self.stopping = False
        (workdir / "logs").mkdir(parents=True, exist_ok=True)

    async def start(self, name: str, role: str, args: list[str]) -> Child:
        log = self.workdir / "logs" / f"{role}-{name}.log"
        with log.open("wb") as fh:
            proc = await asyncio.create_subprocess_exec(
                *args,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=fh,
                stderr=subprocess.STDOUT,
                cwd=self.cwd,
                env=self.env,
                start_new_session=True,
            )
        child = Child(name, role, proc, log)
        self.children.append(child)
        return child

    def exited(self) -> list[Child]:
        return [c for c in self.children if c.exit_code is not None]

    async def wait_for_line(self, child: Child, pattern: re.Pattern[str], timeout_s: float) -> re.Match[str] | None:
        """The first log line matching `pattern`; None if the child exits or `timeout_s` passes first."""
        loop = asyncio.get_running_loop()
        until = loop.time() + timeout_s
        while True:
            # The log is a plain file (children must never block on a pipe nobody reads); polling it
            # for the one line that says where the edge listens is cheap.
            with contextlib.suppress(OSError):
                if m := pattern.search(child.log.read_text(encoding="utf-8", errors="replace")):
                    return m
            if child.exit_code is not None or loop.time() >= until:
                return None
            await asyncio.sleep(_POLL_S)

    def adopt_helpers(self, child: Child) -> None:
        """Remember what `child` has started (the edge's nats-server), to end it if the child can't."""
        child.helpers = [ref for pid in descendants(child.pid) if (ref := _ref(pid)) is not None]

    async def stop(self, say: Callable[[str], None] | None = None) -> None:
        """SIGTERM the nodes, wait, then the edge; SIGKILL whatever outlives its grace period."""
        self.stopping = True
        running = [c for c in self.children if c.exit_code is None]
        if running and say is not None:
            say(f"stopping {len(running)} processes")
        for role in ("node", "edge"):
            group = [c for c in self.children if c.role == role]
            for c in group:
                _signal_group(c, signal.SIGTERM)
            await self._wait(group, STOP_GRACE_S)
            for c in group:
                if c.exit_code is None:
                    self._kill(c)
            await self._wait(group, STOP_GRACE_S)
        for c in self.children:
            # The edge stops its own nats-server; only one it could not stop is ended here.
            for ref in c.helpers:
                if ref.alive():
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(ref.pid, signal.SIGKILL)

    def kill_now(self) -> None:
        """A second Ctrl-C: no more waiting."""
        for c in self.children:
            if c.exit_code is None:
                self._kill(c)
            for ref in c.helpers:
                if ref.alive():
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(ref.pid, signal.SIGKILL)

    def _kill(self, c: Child) -> None:
        # Its helpers first, while they are still its descendants and can be found.
        for pid in descendants(c.pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        _signal_group(c, signal.SIGKILL)

    @staticmethod
    async def _wait(group: list[Child], timeout_s: float) -> None:
        waits = [asyncio.create_task(c.proc.wait()) for c in group if c.exit_code is None]
        if waits:
            _, pending = await asyncio.wait(waits, timeout=timeout_s)
            for t in pending:
                t.cancel()


def _signal_group(c: Child, sig: signal.Signals) -> None:
    if c.exit_code is not None:
        return
    # The child leads its own process group (start_new_session): that group holds only what it
    # started without a session of its own. Never a group smoke did not create.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(c.pid, sig)


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children, grandchildren ...), from /proc or `ps`."""
    parents = _parent_table()
    found: list[int] = []
    frontier = [pid]
    while frontier:
        current = frontier.pop()
        kids = [p for p, pp in parents.items() if pp == current and p not in found]
        found.extend(kids)
        frontier.extend(kids)
    return found


def _parent_table() -> dict[int, int]:
    table: dict[int, int] = {}
    proc = Path("/proc")
    if (proc / "self" / "stat").exists():
        for entry in proc.iterdir():
            if entry.name.isdigit() and (fields := _stat_fields(int(entry.name))) is not None:
                table[int(entry.name)] = int(fields[1])
        return table
    try:
        out = subprocess.run(
            ["ps", "-A", "-o", "pid=", "-o", "ppid="], capture_output=True, text=True, timeout=5, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return table
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
            table[int(parts[0])] = int(parts[1])
    return table


def _stat_fields(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (which may hold spaces and parentheses)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw.rpartition(")")[2].split()


def _start_time(pid: int) -> str | None:
    fields = _stat_fields(pid)
    # Field 22 of stat is the start time; after the command name it is the 20th.
    return fields[19] if fields is not None and len(fields) > 19 and fields[0] != "Z" else None


def _ref(pid: int) -> ProcRef | None:
    if Path("/proc/self/stat").exists():
        started = _start_time(pid)
        return ProcRef(pid, started) if started is not None else None
    return ProcRef(pid, None)
