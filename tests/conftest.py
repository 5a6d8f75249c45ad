"""Fixtures shared by every test: a real nats-server per test, on a free loopback port."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from iop.bus import EmbeddedNats


@pytest.fixture
async def nats_server(tmp_path: Path) -> AsyncIterator[EmbeddedNats]:
    """A real nats-server with JetStream (file store in tmp), port chosen by the server."""
    server = EmbeddedNats("127.0.0.1:0", tmp_path / "nats")
    await server.start()
    try:
        yield server
    finally:
        await server.stop()
