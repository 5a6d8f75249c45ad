"""A nats-server of an experiment's own (JetStream, file store in a fresh folder), for `with`."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bench.procs import free_port, wait_until
from iop.nats.bundle import nats_server_path


@contextmanager
def bare_nats(prefix: str, max_payload: int | None = None) -> Iterator[str]:
    """Start the bundled nats-server on a free loopback port; its URL; stopped (by its handle) after.

    `max_payload`: its limit on one message (nats-server's default is 1 MiB), set through a config file."""
    port = free_port()
    store = Path(tempfile.mkdtemp(prefix=prefix))
    args = ["-a", "127.0.0.1", "-p", str(port), "-js", "-sd", str(store)]
    if max_payload is not None:
        conf = store / "server.conf"
        conf.write_text(f"max_payload: {max_payload}\n")
        args += ["-c", str(conf)]
    server = subprocess.Popen(
        [nats_server_path(), *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_until("nats-server", lambda: _listening(port), 15)
        yield f"nats://127.0.0.1:{port}"
    finally:
        server.terminate()  # our own child, by its handle
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(5)
        shutil.rmtree(store, ignore_errors=True)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0
