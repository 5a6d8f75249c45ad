"""The collector's share of each process's CPU, from what bench/experiments/gcprobe wrote.

python -m bench.experiments.gc_share DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: python -m bench.experiments.gc_share DIR")
    for f in sorted(Path(args[0]).glob("*.json")):
        j = json.loads(f.read_text())
        cpu, gc_s = j["process_cpu_s"], j["cpu_s"]
        print(
            f"{f.stem:16} CPU {cpu:6.2f} s, collector {gc_s:6.3f} s ({100 * gc_s / max(cpu, 1e-9):4.1f} %),"
            f" collections {j['collections']} taking {[round(x, 3) for x in j['cpu_s_by_generation']]} s,"
            f" {j['collected']} objects freed by it"
        )


if __name__ == "__main__":
    main()
