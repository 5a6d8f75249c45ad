"""The Go runtime settings of the embedded nats-server: its collector and its threads.

The server is a Go program beside the edge's event loop (and often a node's): iop starts it with
`GOGC` and `GOMAXPROCS` of its own unless the operator set them (docs/config.md, `store_dir`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

GO_GC = "400"
"""The embedded server's GOGC (Go's default is 100). Storing a large message allocates its size
again in nats-server, and at Go's default the collector runs every few such messages, each run
marking the store's state: a 3 MB stored turn cost the server 5-7 CPU-ms once its stream held a
GB, 2.3-2.7 at 400, for about 50 MB more resident (docs/performance.md, "The embedded server's
collector"). An operator's own GOGC or GOMEMLIMIT is left as it is."""
_GO_SETTINGS = ("GOGC", "GOMEMLIMIT")


def go_maxprocs(cpus: int) -> str:
    """The embedded server's GOMAXPROCS on a machine of `cpus` usable cores: half of them, at least one.

    The server shares its machine with the edge's event loop (and often a node's): with a thread per
    core, Go's scheduler keeps threads spinning for work between messages and hands each message
    from thread to thread, on the cores the Python processes beside it wait for. On 2 cores one
    thread took a fifth off the CPU per request at c=32 of the edge, node and server together (the
    server's own a third) and raised the rate; latency, agent-sized bodies and slot utilisation
    moved by nothing beyond noise (docs/performance.md, "The embedded server on half the cores").
    Above 2 cores half is a judgement, not a measurement. An operator's own GOMAXPROCS is left as
    it is."""
    return str(max(1, cpus // 2))


def usable_cpus(proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")) -> int:
    """The cores this process may run on: its affinity mask where the platform has one, and no more
    than the CPU quota of its cgroup or any cgroup above it (a container's limit, systemd's
    `CPUQuota=`), rounded up. Go counts the quota itself when GOMAXPROCS is unset; set, it must."""
    affinity = getattr(os, "sched_getaffinity", None)
    cpus = len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)
    quota = cgroup_quota(proc_cgroup, root)
    return max(1, min(cpus, quota) if quota is not None else cpus)


def cgroup_quota(proc_cgroup: Path, root: Path) -> int | None:
    """The smallest CPU quota, in whole cores rounded up, on the way from this process's cgroup to
    the hierarchy's root (cgroup v2 `cpu.max`, v1 `cpu.cfs_quota_us`); None when none is set or
    there is no cgroup to read."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    found: list[int] = []
    for line in lines:
        if line.count(":") < 2:
            continue
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: `0::/path`
            base, v1 = root, False
        elif "cpu" in controllers.split(","):
            base, v1 = root / controllers, True
            if not base.is_dir():
                base = root / "cpu"
        else:
            continue
        at = base / path.lstrip("/")
        while True:
            cores = _quota_at(at, v1)
            if cores is not None:
                found.append(cores)
            if at == base or base not in at.parents:
                break
            at = at.parent
    return min(found) if found else None


def _quota_at(directory: Path, v1: bool) -> int | None:
    try:
        if v1:
            quota = int((directory / "cpu.cfs_quota_us").read_text())
            period = int((directory / "cpu.cfs_period_us").read_text())
        else:
            limit, period_text = (directory / "cpu.max").read_text().split()
            if limit == "max":
                return None
            quota, period = int(limit), int(period_text)
    except (OSError, ValueError):
        return None
    if quota <= 0 or period <= 0:
        return None
    return -(-quota // period)


def server_env(environ: Mapping[str, str], cpus: int | None = None) -> dict[str, str]:
    """The embedded server's environment: the edge's, with `GO_GC` unless the operator set Go's own
    collector settings, and `go_maxprocs` unless the operator set GOMAXPROCS."""
    env = dict(environ)
    if not any(name in env for name in _GO_SETTINGS):
        env["GOGC"] = GO_GC
    if "GOMAXPROCS" not in env:
        env["GOMAXPROCS"] = go_maxprocs(usable_cpus() if cpus is None else cpus)
    return env
