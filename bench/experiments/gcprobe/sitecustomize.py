"""How much of a process's CPU its cyclic collector takes: put this directory on PYTHONPATH.

    IOP_GC_PROBE_DIR=/tmp/gc PYTHONPATH=bench/experiments/gcprobe python -m bench --only throughput
    python -m bench.experiments.gc_share /tmp/gc

Every `iop edge` and `iop node` the bench starts then times its collections (`gc.callbacks`, CPU
time) and, when it exits, writes them with its own CPU time to IOP_GC_PROBE_DIR as
<role>-<pid>.json. Nothing is written without IOP_GC_PROBE_DIR; other processes write nothing.
"""

import atexit
import gc
import json
import os
import sys
import time
from typing import Any

_DIR = os.environ.get("IOP_GC_PROBE_DIR")
_spent = [0.0, 0.0, 0.0]
"""CPU seconds of the collections of each generation."""
_counts = [0, 0, 0]
_freed = [0]
_began = [0.0]


def _timed(phase: str, info: dict[str, Any]) -> None:
    if phase == "start":
        _began[0] = time.process_time()
        return
    gen = info["generation"]
    _spent[gen] += time.process_time() - _began[0]
    _counts[gen] += 1
    _freed[0] += info["collected"]


def _role() -> str | None:
    args = sys.argv[1:]
    return args[0] if args and args[0] in ("edge", "node") else None


def _write() -> None:
    role = _role()
    if role is None or _DIR is None:
        return
    with open(os.path.join(_DIR, f"{role}-{os.getpid()}.json"), "w") as f:
        seen = {"cpu_s": sum(_spent), "collections": _counts, "cpu_s_by_generation": _spent, "collected": _freed[0]}
        json.dump({"role": role, "process_cpu_s": time.process_time(), **seen}, f)


if _DIR is not None:
    gc.callbacks.append(_timed)
    atexit.register(_write)
