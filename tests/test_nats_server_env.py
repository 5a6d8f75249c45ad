"""The embedded nats-server runs with Go's collector spaced out (iop/nats/server.py, `GO_GC`) and
half the machine's cores for its threads (`go_maxprocs`), unless the operator set Go's own."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from iop.nats.server import GO_GC, EmbeddedNats, go_maxprocs, server_env, usable_cpus

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/<pid>/environ")

GO_NAMES = ("GOGC", "GOMEMLIMIT", "GOMAXPROCS")


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
    return {k: v for k, _, v in pairs if k in GO_NAMES}


@pytest.fixture
def no_go_settings(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in GO_NAMES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


async def test_embedded_server_spaces_go_collections_out_on_half_the_cores(
    tmp_path: Path, no_go_settings: pytest.MonkeyPatch
) -> None:
    assert await go_settings(tmp_path) == {"GOGC": GO_GC, "GOMAXPROCS": go_maxprocs(usable_cpus())}


@pytest.mark.parametrize("setting", [{"GOGC": "150"}, {"GOMEMLIMIT": "512MiB"}, {"GOMAXPROCS": "3"}])
async def test_embedded_server_keeps_the_operators_go_settings(
    tmp_path: Path, no_go_settings: pytest.MonkeyPatch, setting: dict[str, str]
) -> None:
    for k, v in setting.items():
        no_go_settings.setenv(k, v)
    got = await go_settings(tmp_path)
    assert {k: got[k] for k in setting} == setting
    # The other kind of setting still gets iop's default.
    if "GOMAXPROCS" in setting:
        assert got["GOGC"] == GO_GC
    else:
        assert got["GOMAXPROCS"] == go_maxprocs(usable_cpus())


@pytest.mark.parametrize(("cpus", "threads"), [(1, "1"), (2, "1"), (3, "1"), (4, "2"), (16, "8")])
def test_the_server_gets_half_the_cores_and_at_least_one(cpus: int, threads: str) -> None:
    assert server_env({}, cpus=cpus)["GOMAXPROCS"] == threads
    assert server_env({"GOMAXPROCS": "7"}, cpus=cpus)["GOMAXPROCS"] == "7"
