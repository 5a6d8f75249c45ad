"""Fixtures shared by every test: a real nats-server per test, and dist/iop.pyz built once per run."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from iop.bus import EmbeddedNats

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
async def nats_server(tmp_path: Path) -> AsyncIterator[EmbeddedNats]:
    """A real nats-server with JetStream (file store in tmp), port chosen by the server."""
    server = EmbeddedNats("127.0.0.1:0", tmp_path / "nats")
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


def snapshot_sources(dest: Path) -> Path:
    """A copy of what build.py reads: colleagues edit iop/ while tests run, and two builds from one
    copy must be comparable."""
    dest.mkdir()
    shutil.copy2(ROOT / "build.py", dest / "build.py")
    shutil.copy2(ROOT / "build-requirements.txt", dest / "build-requirements.txt")
    shutil.copytree(ROOT / "iop", dest / "iop", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dest


def build_archive(sources: Path, out: Path) -> subprocess.CompletedProcess[str]:
    """Run `build.py --out OUT` from `sources`; fails the test if the build fails."""
    # The shared dependency cache under the repo's build/ is what keeps this quick after the first run.
    command = [sys.executable, str(sources / "build.py"), "--out", str(out), "--build-dir", str(ROOT / "build")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=540, check=False)
    assert done.returncode == 0, done.stderr
    return done


@pytest.fixture(scope="session")
def archive_sources(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return snapshot_sources(tmp_path_factory.mktemp("src") / "iop-src")


@pytest.fixture(scope="session")
def built_archive(archive_sources: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """dist/iop.pyz as `python build.py` writes it, built once per test run (test_build, test_smoke)."""
    out = tmp_path_factory.mktemp("dist") / "iop.pyz"
    done = build_archive(archive_sources, out)
    assert str(out) in done.stdout and "sha256" in done.stdout
    return out
