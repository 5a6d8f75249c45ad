"""Where the edge's and the node's time goes under a chosen load: py-spy on both, summarized.

    python -m bench.spy [--api chat|responses] [--stream] [-c 1] [--seconds 5] [--out DIR]

Starts the bench upstream, an edge and a node (as bench/run.py does), warms up, then records both
processes with `py-spy record -f raw` while a closed loop of `-c` connections runs, and prints for
each: its CPU use, the share of samples per area (iop's modules, nats-py, uvicorn, asyncio, ...)
counted once per stack, and the functions most often on top of the stack. Raw profiles stay in DIR.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from bench import fixtures, load
from bench.abtest import start_upstream
from bench.procs import Owned, context_switches, cpu_split, free_port, install_signal_handlers, log
from bench.stack import openai_pool_node, start_stack

PY_SPY = Path(sys.executable).parent / "py-spy"
_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^():]+)(?::\d+)?\)$")

AREAS = [
    ("iop/edge/", "iop edge"),
    ("iop/node/", "iop node"),
    ("iop/", "iop (shared)"),
    ("nats/", "nats-py"),
    ("uvicorn/", "uvicorn"),
    ("starlette/", "starlette"),
    ("httptools", "httptools"),
    ("h11/", "h11"),
    ("msgspec", "msgspec"),
    ("asyncio/", "asyncio"),
    ("uvloop", "uvloop"),
]


def area_of(file: str) -> str:
    for needle, name in AREAS:
        if needle in file:
            return name
    return "other"


def category(func: str, file: str) -> str:
    """What the function on top of the stack is doing, by area; socket syscalls and waiting apart."""
    if "selectors" in file and func.endswith("select"):
        return "idle (waiting in select)"
    if file.endswith("runners.py") or func.endswith(("run_until_complete", "run_forever")):
        return "idle (waiting in select)"  # uvloop: its loop is C; waiting shows as the runner on top
    if func.endswith(("StreamWriter.writelines", "StreamWriter.write")) or (
        ("selector_events" in file or "uvloop" in file) and ("write" in func or "send" in func)
    ):
        return "socket writes (syscall; loopback delivery is charged to the writer)"
    if "selector_events" in file and ("read" in func or "recv" in func):
        return "socket reads (syscall)"
    return area_of(file)


def summarize(raw: Path, top: int = 12) -> str:
    """Share of the event loop's busy samples per category on top of the stack, per area anywhere in
    the stack, and the functions most often on top. Other threads (a child watcher) are left out."""
    cats: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    leaves: Counter[str] = Counter()
    total = idle = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, n = line.rpartition(" ")
        # The main thread only (it runs the event loop); threads started by `threading` (asyncio's
        # child watcher, executors) begin in threading.py (py-spy names the frame `_bootstrap` or,
        # as its newer releases do, `Thread._bootstrap`).
        first = stack.split(";", 1)[0]
        if not n.isdigit() or "_bootstrap (threading.py" in first:
            continue
        count = int(n)
        parsed = [m for f in stack.split(";") if (m := _FRAME.match(f.strip()))]
        if not parsed:
            continue
        leaf = parsed[-1]
        cat = category(leaf["func"], leaf["file"])
        total += count
        if cat.startswith("idle"):
            idle += count
            continue
        cats[cat] += count
        leaves[f"{leaf['func']} ({Path(leaf['file']).name})"] += count
        for a in {area_of(m["file"]) for m in parsed} - {"other", "asyncio"}:
            inclusive[a] += count
    busy = total - idle
    if not busy:
        return "  (no busy samples)"
    lines = [f"  event loop: {total} samples, {100 * idle / total:.0f}% idle; of the busy ones:"]
    lines += [f"    {100 * c / busy:5.1f}%  {name}" for name, c in cats.most_common()]
    lines.append(
        "  with a frame anywhere in: " + ", ".join(f"{a} {100 * c / busy:.0f}%" for a, c in inclusive.most_common())
    )
    lines.append("  functions most often on top of the stack:")
    lines += [f"    {100 * c / busy:5.1f}%  {name}" for name, c in leaves.most_common(top)]
    return "\n".join(lines)


def count_syscalls(pids: dict[str, int], spec: load.LoadSpec, seconds: float) -> dict[str, str]:
    """System calls per request of each process while the same load runs again (strace slows them down;
    the counts per request, not the rates, are what this is for)."""
    strace = shutil.which("strace")
    if strace is None:
        log("profile: strace not installed; no system call counts")
        return {}
    result: dict[str, load.LoadResult] = {}
    runner = threading.Thread(
        target=lambda: result.update(r=load.run(dataclasses.replace(spec, max_seconds=seconds + 1.5)))
    )
    runner.start()
    time.sleep(0.5)
    files = {name: Path(tempfile.mkstemp(prefix=f"strace-{name}-")[1]) for name in pids}
    tracers = {
        name: subprocess.Popen([strace, "-c", "-f", "-p", str(pid), "-o", str(files[name])], stderr=subprocess.DEVNULL)
        for name, pid in pids.items()
    }
    t0 = time.monotonic()
    time.sleep(seconds)
    for t in tracers.values():
        t.send_signal(signal.SIGINT)  # our own strace child: detach and write the summary
    wall = time.monotonic() - t0
    for t in tracers.values():
        t.wait(timeout=30)
    runner.join(timeout=seconds + 60)
    r = result.get("r")
    if r is None or not r.count:
        return {}
    served = r.rps * wall
    out = {}
    for name, f in files.items():
        counts: Counter[str] = Counter()
        for line in f.read_text().splitlines():
            cols = line.split()
            if len(cols) >= 5 and cols[-1].isidentifier() and cols[3].isdigit():
                counts[cols[-1]] = int(cols[3])
        f.unlink()
        top = counts.most_common(6)
        out[name] = ", ".join(f"{call} {c / served:.1f}" for call, c in top)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--api", choices=["chat", "responses"], default="chat")
    ap.add_argument("--stream", action="store_true")
    ap.add_argument("--size", type=int, default=0, help="an agent-sized body of this many bytes (bench/fixtures.py)")
    ap.add_argument("--store", action="store_true", help="with --size, a Responses body that asks for store: true")
    ap.add_argument("-c", "--concurrency", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    ap.add_argument("--syscall-seconds", type=float, default=3.0, help="then count system calls with strace (0: skip)")
    ap.add_argument("--spy-args", default="", help="more py-spy record options, e.g. --nonblocking")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    if not PY_SPY.exists():
        sys.exit(f"profile: py-spy not found at {PY_SPY} (pip install py-spy)")
    out = a.out or Path(tempfile.mkdtemp(prefix="iop-profile-"))
    out.mkdir(parents=True, exist_ok=True)
    install_signal_handlers()
    owned = Owned(out)
    try:
        port = free_port()
        start_upstream(owned, "upstream", [port])
        stack = start_stack(
            owned, out, "profile", [{"alias": "bench", "pool": ["fake"]}], [openai_pool_node("n", [("fake", port, 64)])]
        )
        target = load.Target("127.0.0.1", int(stack.url.rsplit(":", 1)[1]), "/v1" + load.endpoint(a.api))
        body = (
            fixtures.body(a.api, "bench", a.size, a.stream, a.store)
            if a.size
            else load.body_of(a.api, "bench", a.stream)
        )
        load.run(load.LoadSpec(target, body, concurrency=8, requests=500, max_seconds=10))
        result: dict[str, load.LoadResult] = {}
        spec = load.LoadSpec(target, body, concurrency=a.concurrency, requests=10_000_000, max_seconds=a.seconds + 2)
        runner = threading.Thread(target=lambda: result.update(r=load.run(spec)))
        pids = {"edge": stack.edge.pid, "node": stack.nodes[0].pid}
        if stack.nats_pid:
            pids["nats-server"] = stack.nats_pid
        cpu0 = {name: cpu_split(pid) for name, pid in pids.items()}
        ctx0 = {name: context_switches(pid) for name, pid in pids.items()}
        runner.start()
        spies = {
            name: subprocess.Popen(
                [
                    str(PY_SPY),
                    "record",
                    "-p",
                    str(pid),
                    "-d",
                    str(int(a.seconds)),
                    "-r",
                    str(a.rate),
                    "-f",
                    "raw",
                    "-o",
                    str(out / f"{name}.txt"),
                    *a.spy_args.split(),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
            for name, pid in (("edge", stack.edge.pid), ("node", stack.nodes[0].pid))
        }
        for name, spy in spies.items():
            _, err = spy.communicate(timeout=a.seconds + 60)
            if spy.returncode != 0:
                log(f"py-spy on the {name} failed: {err.decode(errors='replace')[-500:]}")
        runner.join(timeout=a.seconds + 120)
        cpu = {name: [b - a for a, b in zip(cpu0[name], cpu_split(pid), strict=True)] for name, pid in pids.items()}
        ctx = {
            name: [b - a for a, b in zip(ctx0[name], context_switches(pid), strict=True)] for name, pid in pids.items()
        }
        r = result.get("r")
        calls = count_syscalls(pids, spec, a.syscall_seconds) if a.syscall_seconds > 0 else {}
    finally:
        owned.stop_all()
    if r is None:
        log("the load did not finish")
        return 1
    lat = r.latency_ms or {}
    print(
        f"{a.api} stream={a.stream} c={a.concurrency}: {r.rps:.0f} req/s, p50 {lat.get('p50')} ms,"
        f" p99 {lat.get('p99')} ms, errors {r.errors} (figures under py-spy, which pauses each process to sample)"
    )
    n = max(1, r.count)
    for name in cpu:
        user, system = cpu[name]
        kernel = 100 * system / max(1e-9, user + system)
        print(
            f"\n{name}: {1000 * (user + system) / n:.2f} CPU-ms per request ({kernel:.0f}% in the kernel);"
            f" {ctx[name][0] / n:.1f} voluntary and {ctx[name][1] / n:.2f} involuntary context switches per request"
        )
        if name in calls:
            print("  system calls per request (strace -c, a separate run): " + calls[name])
        raw = out / f"{name}.txt"
        if raw.exists():
            print(summarize(raw))
    print(f"\nraw profiles: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
