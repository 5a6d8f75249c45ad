"""build.py and iop.pyz: a real build, run by a bare Python from an empty folder with a clean environment."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import zipfile
from pathlib import Path

import pytest

from iop import _bootstrap
from iop.errors import BusError
from iop.nats.bundle import nats_server_path
from tests.harness import BARE_PYTHON, clean_env, run_pyz

# A cold build installs wheels for every carried Python; later builds reuse build/deps/.
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


@pytest.fixture
def pyz(built_archive: Path) -> Path:
    return built_archive


def test_build_pyz_prints_version(pyz: Path, tmp_path: Path) -> None:
    version = json.loads(zipfile.ZipFile(pyz).read("iop-bundle.json"))["version"]
    done = run_pyz(pyz, ["--version"], tmp_path / "cache", tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"iop, version {version}"


def test_build_pyz_runs_config_check(pyz: Path, tmp_path: Path) -> None:
    # The deployment schema is still moving, so a rejection (exit 2) passes too; a traceback never does.
    config = tmp_path / "deployment.yaml"
    config.write_text(CONFIG, encoding="utf-8")
    done = run_pyz(pyz, ["config", "check", config.name], tmp_path / "cache", tmp_path)
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode in (0, 2), done.stderr
    assert done.stdout.strip() or done.stderr.strip()


def test_build_pyz_bundled_nats_server_starts(pyz: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    assert run_pyz(pyz, ["--version"], cache, tmp_path).returncode == 0
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
    env = clean_env(cache, tmp_path)
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
