"""The processes a benchmark starts: launching, readiness, CPU and memory from /proc, stopping by PID.

Every process is started in its own session and recorded; `Owned.stop_all()` ends exactly those
(by their PIDs, SIGTERM then SIGKILL), plus any child a recorded process left behind (the edge's
nats-server). Nothing here signals a process it did not start.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
TICKS = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


def log(*parts: object) -> None:
    print(*parts, file=sys.stderr, flush=True)


# --- /proc ------------------------------------------------------------------------------------------


def _stat_fields(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name may hold spaces and parentheses: the fields start after the last ')'.
    return raw[raw.rindex(")") + 2 :].split()


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of one process (0 once it is gone)."""
    f = _stat_fields(pid)
    return (int(f[11]) + int(f[12])) / TICKS if f else 0.0


def cpu_split(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of one process."""
    f = _stat_fields(pid)
    return (int(f[11]) / TICKS, int(f[12]) / TICKS) if f else (0.0, 0.0)


def context_switches(pid: int) -> tuple[int, int]:
    """(voluntary, involuntary) context switches of a process's main thread so far."""
    out = {"voluntary_ctxt_switches": 0, "nonvoluntary_ctxt_switches": 0}
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in out:
                out[key] = int(value)
    return out["voluntary_ctxt_switches"], out["nonvoluntary_ctxt_switches"]


def rss_bytes(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE
    except (OSError, IndexError, ValueError):
        return 0


def children_of(pid: int) -> list[int]:
    """Direct children of `pid` (the edge's nats-server runs in its own session, so not its group)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            f = _stat_fields(int(d))
            if f is not None and int(f[1]) == pid:
                out.append(int(d))
    return out


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def machine_ticks() -> tuple[int, int]:
    """(all, idle) jiffies of the whole machine, for how busy it was during a run."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return sum(v), v[3] + v[4]


def busy_cores(a: tuple[int, int], b: tuple[int, int]) -> float:
    """Cores busy on average between two machine_ticks() readings (2.0 = both cores of this machine)."""
    total, idle = b[0] - a[0], b[1] - a[1]
    ncpu = os.cpu_count() or 1
    return round(ncpu * (1 - idle / total), 3) if total > 0 else 0.0


def loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def machine() -> dict[str, Any]:
    model = "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    mem_kb = 0
    with contextlib.suppress(OSError, ValueError, IndexError):
        mem_kb = int(Path("/proc/meminfo").read_text().split()[1])
    return {
        "nproc": os.cpu_count(),
        "cpu_model": model,
        "mem_gb": round(mem_kb / 1024 / 1024, 1),
        "kernel": os.uname().release,
        "python": sys.version.split()[0],
    }


def git_state() -> dict[str, Any]:
    def git(*args: str) -> str:
        try:
            return subprocess.run(
                ["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10, check=False
            ).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return ""

    dirty = [ln[3:] for ln in git("status", "--porcelain", "--", "iop").splitlines() if ln.strip()]
    return {
        "commit": git("rev-parse", "--short", "HEAD"),
        "subject": git("log", "-1", "--format=%s"),
        "iop_dirty": dirty,
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --- HTTP helpers (bench code may poll) ---------------------------------------------------------------


def http(
    method: str, url: str, body: Any = None, timeout: float = 10.0, headers: dict[str, str] | None = None
) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    head = {"content-type": "application/json"} | (headers or {})
    req = urllib.request.Request(url, data=data, method=method, headers=head)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def http_json(
    method: str, url: str, body: Any = None, timeout: float = 10.0, headers: dict[str, str] | None = None
) -> Any:
    status, raw = http(method, url, body, timeout, headers)
    if status != 200:
        raise RuntimeError(f"{method} {url}: HTTP {status}: {raw[:300]!r}")
    return json.loads(raw)


def wait_until(what: str, check: Callable[[], bool], timeout_s: float, procs: list[Proc] | None = None) -> float:
    """Poll `check` until true; the seconds it took. Fails early when one of `procs` died."""
    t0 = time.monotonic()
    while True:
        with contextlib.suppress(OSError, RuntimeError, ValueError):
            if check():
                return time.monotonic() - t0
        for p in procs or []:
            if not p.alive():
                raise RuntimeError(f"{p.name} exited (code {p.popen.returncode}) while waiting for {what}:\n{p.tail()}")
        if time.monotonic() - t0 > timeout_s:
            raise RuntimeError(f"timed out after {timeout_s:g}s waiting for {what}")
        time.sleep(0.02)


def status_ready(edge_url: str, nodes: int | None = None, headers: dict[str, str] | None = None) -> Callable[[], bool]:
    """A check: every configured node connected and every pool at its full connected capacity."""

    def check() -> bool:
        st = http_json("GET", edge_url + "/status", timeout=5, headers=headers)
        connected = [n for n in st["nodes"] if n["connected"]]
        if nodes is not None and len(connected) < nodes:
            return False
        if nodes is None and len(connected) < len(st["nodes"]):
            return False
        return all(p["connected_capacity"] == p["total_capacity"] for p in st["pools"])

    return check


# --- processes --------------------------------------------------------------------------------------


class Proc:
    """A process we started (own session, output to a log file)."""

    def __init__(self, name: str, argv: list[str], log_dir: Path, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.argv = argv
        self.log_path = log_dir / f"{name}.log"
        self._log = self.log_path.open("ab")
        self.popen = subprocess.Popen(
            argv,
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            # Own session: Ctrl-C in the terminal reaches only run.py, which then stops us in order.
            start_new_session=True,
        )
        self.pid = self.popen.pid
        self.children: dict[int, str] = {}

    def alive(self) -> bool:
        return self.popen.poll() is None

    def cpu_s(self) -> float:
        return cpu_s(self.pid)

    def note_children(self) -> list[int]:
        """Remember this process's children now, so they can be ended by PID if it leaves them behind."""
        kids = children_of(self.pid)
        for kid in kids:
            f = _stat_fields(kid)
            if f is not None:
                self.children[kid] = f[19]  # start time: tells our child from a later process with its PID
        return kids

    def tail(self, n: int = 2000) -> str:
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return ""
        return data[-n:].decode("utf-8", "replace")

    def stop(self, timeout_s: float = 15.0) -> None:
        if self.alive():
            self.note_children()
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGKILL)
                self.popen.wait(5)
        for kid, started in self.children.items():
            f = _stat_fields(kid)
            if f is not None and f[19] == started:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(kid, signal.SIGKILL)
        self._log.close()


class Owned:
    """Every process a run started; stopped in reverse order, always (also on Ctrl-C / SIGTERM)."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[Proc] = []

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Proc:
        p = Proc(name, argv, self.log_dir, env)
        self.procs.append(p)
        return p

    def stop(self, p: Proc) -> None:
        try:
            p.stop()
        finally:
            if p in self.procs:
                self.procs.remove(p)

    def stop_all(self) -> None:
        while self.procs:
            p = self.procs.pop()
            try:
                p.stop()
            except Exception as exc:  # keep stopping the others; say what went wrong
                log(f"stopping {p.name} (pid {p.pid}) failed: {exc!r}")


def install_signal_handlers() -> None:
    """SIGINT and SIGTERM end a run through the finally blocks that stop our processes.

    SIGINT is set explicitly: a shell starts background jobs with it ignored, and Python keeps that.
    """

    def on_term(signum: int, frame: object) -> None:
        # Through SIGINT's path: inside an event loop, asyncio's Runner turns it into a clean
        # cancellation and a KeyboardInterrupt; an exception raised here could be lost in a callback.
        signal.raise_signal(signal.SIGINT)

    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, on_term)


def iop_argv(archive: Path | None, *args: str) -> list[str]:
    """`python -m iop ARGS` from this source tree, or `python ARCHIVE ARGS`."""
    if archive is not None:
        return [sys.executable, str(archive), *args]
    return [sys.executable, "-m", "iop", *args]


def upstream_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "bench.upstream", *args]


def settled_rss(url: str, pid: int, settle_s: float = 4.0) -> int:
    """The edge's resident memory once the burst has left: no request waits any more, and the edge
    had `settle_s` to give memory back (it trims 1 s after a burst drains); the lowest reading."""

    def drained() -> bool:
        return sum(int(p["waiting"]) for p in http_json("GET", url + "/status", timeout=30)["pools"]) == 0

    wait_until("every held request gone from the edge", drained, 120)
    lowest = rss_bytes(pid)
    until = time.monotonic() + settle_s
    while time.monotonic() < until:
        time.sleep(0.25)
        lowest = min(lowest, rss_bytes(pid))
    return lowest
