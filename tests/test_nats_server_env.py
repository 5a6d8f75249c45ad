"""The embedded nats-server runs with Go's collector spaced out (iop/nats/goruntime.py, `GO_GC`) and
half the machine's cores for its threads (`go_maxprocs`), unless the operator set Go's own."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from iop.nats.goruntime import GO_GC, cgroup_quota, go_maxprocs, server_env, usable_cpus
from iop.nats.server import EmbeddedNats

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


def _cgroups(tmp_path: Path, lines: str, files: dict[str, str]) -> tuple[Path, Path]:
    """A /proc/self/cgroup and a cgroup hierarchy of these files, under tmp_path."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    proc = tmp_path / "proc-self-cgroup"
    proc.write_text(lines)
    root = tmp_path / "sys-fs-cgroup"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return proc, root


def test_a_cgroup_v2_quota_above_the_process_bounds_the_cores(tmp_path: Path) -> None:
    proc, root = _cgroups(
        tmp_path,
        "0::/system.slice/iop-edge.service\n",
        {
            "cpu.max": "max 100000\n",
            "system.slice/cpu.max": "250000 100000\n",  # 2.5 cores for the whole slice
            "system.slice/iop-edge.service/cpu.max": "max 100000\n",
        },
    )
    assert cgroup_quota(proc, root) == 3
    assert usable_cpus(proc, root) == min(3, usable_cpus(tmp_path / "none", root))


def test_the_smallest_quota_on_the_way_up_wins_and_none_means_none(tmp_path: Path) -> None:
    proc, root = _cgroups(
        tmp_path,
        "0::/a/b\n",
        {"a/cpu.max": "800000 100000\n", "a/b/cpu.max": "100000 100000\n"},
    )
    assert cgroup_quota(proc, root) == 1
    assert usable_cpus(proc, root) == 1
    assert server_env({}, cpus=usable_cpus(proc, root))["GOMAXPROCS"] == "1"
    proc, root = _cgroups(tmp_path / "unlimited", "0::/a\n", {"a/cpu.max": "max 100000\n"})
    assert cgroup_quota(proc, root) is None
    assert cgroup_quota(tmp_path / "no-such-file", root) is None


def test_a_cgroup_v1_quota_is_read_where_the_cpu_controller_is_mounted(tmp_path: Path) -> None:
    # A container sees its host's path in /proc/self/cgroup but its own cgroup at the mount's root.
    proc, root = _cgroups(
        tmp_path,
        "9:name=systemd:/docker/abc\n4:cpu,cpuacct:/docker/abc\n",
        {"cpu,cpuacct/cpu.cfs_quota_us": "150000\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"},
    )
    assert cgroup_quota(proc, root) == 2
    proc, root = _cgroups(
        tmp_path / "unset",
        "4:cpu,cpuacct:/\n",
        {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"},
    )
    assert cgroup_quota(proc, root) is None
