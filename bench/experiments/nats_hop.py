"""What one hop of an agent-sized body through nats-server costs, against the same bytes over loopback.

    python -m bench.experiments.nats_hop [--sizes 800000,3000000] [--messages 60]

Whatever carries a request body from the edge to a node through NATS moves it once through
nats-server: into the server from one socket and out of it on another. This measures that hop
alone, a message of each size sent, received whole and answered with one byte, one at a time:

- `loopback`: two processes, one socket, no server (the receiver reads 64 KiB at a time);
- `raw NATS`: the same two processes speaking NATS's text protocol on plain sockets (PUB, MSG)
  through a nats-server of our own (max_payload 8 MiB, as iop's embedded server);
- `nats-py`: a nats-py client at each end (a publish with a reply inbox, and the reply), with
  iop's malloc settings (iop/heap.py), as the edge and the node use it; the sender publishes with
  nats-py's `publish` or as the edge sends a large body (iop/nats/bulk.py: the payload not copied
  into the command), each twice, alternating.

Each line: the round trip's p50 and p90, and CPU-ms per message of the sender, nats-server and the
receiver, with the machine's other busy cores beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import socket
import statistics
import subprocess
import sys
import time

from bench.experiments.bare_nats import bare_nats
from bench.procs import busy_cores, children_of, comm, cpu_s, machine_ticks

SUBJECT = "hop"


def _recv_exact(sock: socket.socket, n: int) -> None:
    while n > 0:
        got = len(sock.recv(min(n, 65536)))
        if not got:
            raise SystemExit(0)
        n -= got


def _nats_socket(url: str) -> tuple[socket.socket, io.BufferedReader[socket.SocketIO]]:
    host, port = url.rsplit("/", 1)[1].split(":")
    sock = socket.create_connection((host, int(port)))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    reader = io.BufferedReader(socket.SocketIO(sock, "rb"), 1 << 20)
    reader.readline()  # INFO
    sock.sendall(b'CONNECT {"verbose":false,"pedantic":false}\r\nPING\r\n')
    reader.readline()  # PONG
    return sock, reader


def _read_msg(reader: io.BufferedReader[socket.SocketIO]) -> list[bytes]:
    line = reader.readline()
    while not line.startswith(b"MSG "):
        line = reader.readline()
    parts = line.split()
    reader.read(int(parts[-1]) + 2)
    return parts


def receiver(kind: str, where: str) -> None:
    """The receiving end, in a process of its own: answers every whole message with one byte."""
    if kind == "loopback":
        sock = socket.create_connection(("127.0.0.1", int(where)))
        size = int(sock.recv(16).decode())
        sock.sendall(b"r")
        while True:
            _recv_exact(sock, size)
            sock.sendall(b"k")
    elif kind == "raw":
        sock, reader = _nats_socket(where)
        sock.sendall(f"SUB {SUBJECT} 1\r\nPING\r\n".encode())
        reader.readline()
        print("ready", flush=True)
        while True:
            parts = _read_msg(reader)
            sock.sendall(b"PUB %s 1\r\nk\r\n" % parts[3])
    else:
        asyncio.run(_nats_py_receiver(where))


async def _nats_py_receiver(url: str) -> None:
    import nats
    from nats.aio.msg import Msg

    from iop.heap import keep_large_buffers

    keep_large_buffers()
    nc = await nats.connect(url)

    async def answer(msg: Msg) -> None:
        await nc.publish(msg.reply, b"k")

    await nc.subscribe(SUBJECT, cb=answer)
    await nc.flush()
    print("ready", flush=True)
    await asyncio.Event().wait()


def _measure(send: object, messages: int, pids: dict[str, int]) -> dict[str, float]:
    for _ in range(5):
        send()  # type: ignore[operator]
    ticks, cpu0, own0 = machine_ticks(), {k: cpu_s(p) for k, p in pids.items()}, time.process_time()
    times = []
    deadline = time.monotonic() + 60
    for _ in range(messages):
        t = time.perf_counter()
        send()  # type: ignore[operator]
        times.append((time.perf_counter() - t) * 1000)
        if time.monotonic() > deadline:
            break
    n = len(times)
    cpu = {k: (cpu_s(p) - cpu0[k]) * 1000 / n for k, p in pids.items()}
    cpu["sender"] = (time.process_time() - own0) * 1000 / n
    ours = sum(cpu.values()) * n / 1000
    foreign = busy_cores(ticks, machine_ticks()) - ours / max(sum(times) / 1000, 1e-9)
    times.sort()
    return {"p50": statistics.median(times), "p90": times[int(n * 0.9)], **cpu, "foreign": max(foreign, 0.0)}


def _spawn(kind: str, where: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "bench.experiments.nats_hop", "--receiver", kind, where], stdout=subprocess.PIPE
    )


def run(size: int, messages: int) -> dict[str, dict[str, float]]:
    body = os.urandom(size)
    out: dict[str, dict[str, float]] = {}
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    proc = _spawn("loopback", str(listener.getsockname()[1]))
    try:
        sock, _ = listener.accept()
        sock.sendall(str(size).encode().ljust(16))
        sock.recv(1)

        def loop_send() -> None:
            sock.sendall(body)
            sock.recv(1)

        out["loopback"] = _measure(loop_send, messages, {"receiver": proc.pid})
    finally:
        proc.terminate()
        proc.wait(10)
        listener.close()
    with bare_nats("iop-hop-", max_payload=8 * 1024 * 1024) as url:
        server = next(p for p in children_of(os.getpid()) if "nats" in comm(p))
        proc = _spawn("raw", url)
        try:
            assert proc.stdout is not None and proc.stdout.readline()
            sock, reader = _nats_socket(url)
            sock.sendall(b"SUB reply 2\r\nPING\r\n")
            reader.readline()
            message = b"PUB %s reply %d\r\n" % (SUBJECT.encode(), size) + body + b"\r\n"

            def raw_send() -> None:
                sock.sendall(message)
                _read_msg(reader)

            out["raw NATS"] = _measure(raw_send, messages, {"nats-server": server, "receiver": proc.pid})
            sock.close()
        finally:
            proc.terminate()
            proc.wait(10)
        proc = _spawn("nats-py", url)
        try:
            assert proc.stdout is not None and proc.stdout.readline()
            pids = {"nats-server": server, "receiver": proc.pid}
            for rnd in range(2):  # the two ways of sending alternate
                for queued in (False, True) if rnd == 0 else (True, False):
                    path = "nats-py, the edge's bulk publish" if queued else "nats-py"
                    r = asyncio.run(_nats_py_send(url, body, messages // 2, pids, queued))
                    out[f"{path} ({rnd + 1})"] = r
        finally:
            proc.terminate()
            proc.wait(10)
    return out


async def _nats_py_send(url: str, body: bytes, messages: int, pids: dict[str, int], queued: bool) -> dict[str, float]:
    """nats-py at the sending end, its reply on an inbox of its own; `queued`: the body published
    as iop's edge publishes large payloads (iop/nats/bulk.py), else with nats-py's `publish`."""
    import nats

    from iop.heap import keep_large_buffers
    from iop.nats import bulk

    keep_large_buffers()
    nc = await nats.connect(url)
    loop = asyncio.get_running_loop()
    inbox = nc.new_inbox()
    waiting: list[asyncio.Future[None]] = []

    async def answered(_msg: object) -> None:
        if waiting and not waiting[0].done():
            waiting[0].set_result(None)

    await nc.subscribe(inbox, cb=answered)

    async def send() -> None:
        waiting[:] = [loop.create_future()]
        if queued:
            await bulk.publish(nc, SUBJECT, [body], reply=inbox)
        else:
            await nc.publish(SUBJECT, body, reply=inbox)
        await asyncio.wait_for(waiting[0], 10)

    try:
        for _ in range(5):
            await send()
        ticks, cpu0, own0 = machine_ticks(), {k: cpu_s(p) for k, p in pids.items()}, time.process_time()
        times = []
        deadline = loop.time() + 60
        for _ in range(messages):
            t = time.perf_counter()
            await send()
            times.append((time.perf_counter() - t) * 1000)
            if loop.time() > deadline:
                break
    finally:
        await nc.close()
    n = len(times)
    cpu = {k: (cpu_s(p) - cpu0[k]) * 1000 / n for k, p in pids.items()}
    cpu["sender"] = (time.process_time() - own0) * 1000 / n
    foreign = busy_cores(ticks, machine_ticks()) - sum(cpu.values()) / max(statistics.mean(times), 1e-9)
    times.sort()
    return {"p50": statistics.median(times), "p90": times[int(n * 0.9)], **cpu, "foreign": max(foreign, 0.0)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="800000,3000000")
    ap.add_argument("--messages", type=int, default=60)
    ap.add_argument("--receiver", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.receiver:
        receiver(*a.receiver)
        return
    print("| body | path | p50 ms | p90 ms | CPU-ms sender / nats-server / receiver | foreign cores |")
    print("|---|---|---|---|---|---|")
    for size in (int(s) for s in a.sizes.split(",")):
        for path, r in run(size, a.messages).items():
            server = f"{r['nats-server']:.2f}" if "nats-server" in r else "-"
            print(
                f"| {size / 1e6:g} MB | {path} | {r['p50']:.2f} | {r['p90']:.2f} | "
                f"{r['sender']:.2f} / {server} / {r['receiver']:.2f} | {r['foreign']:.2f} |"
            )


if __name__ == "__main__":
    main()
