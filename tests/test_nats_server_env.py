"""The embedded nats-server runs with Go's collector spaced out (iop/nats/server.py, `GO_GC`),
unless the operator set Go's own settings."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from iop.nats.server import GO_GC, EmbeddedNats

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/<pid>/environ")


async def go_settings(tmp_path: Path) -> dict[str, str]:
    server = EmbeddedNats("127.0.0.1:0", tmp_path / "nats")
    await server.start()
    try:
        assert server.pid is not None
        with open(f"/proc/{server.pid}/environ", "rb") as f:  # noqa: ASYNC230 (a few hundred bytes of procfs)
            raw = f.read()
    finally:
        await server.stop()
    pairs = (entry.decode().partition("=") for entry in raw.split(b"\0") if entry)
    return {k: v for k, _, v in pairs if k in ("GOGC", "GOMEMLIMIT")}


async def test_embedded_server_spaces_go_collections_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GOGC", raising=False)
    monkeypatch.delenv("GOMEMLIMIT", raising=False)
    assert await go_settings(tmp_path) == {"GOGC": GO_GC}


@pytest.mark.parametrize("setting", [{"GOGC": "150"}, {"GOMEMLIMIT": "512MiB"}])
async def test_embedded_server_keeps_the_operators_go_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, setting: dict[str, str]
) -> None:
    monkeypatch.delenv("GOGC", raising=False)
    monkeypatch.delenv("GOMEMLIMIT", raising=False)
    for k, v in setting.items():
        monkeypatch.setenv(k, v)
    assert await go_settings(tmp_path) == setting
