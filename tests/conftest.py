"""Fixtures shared by tests: a real nats-server per test, throwaway certificates, dist/iop.pyz built once."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

from iop.nats.server import EmbeddedNats
from tests.harness import build_archive, have_openssl, make_pki, snapshot_sources

# The files that take longest, longest first. Under `-n N --dist loadfile` (with
# `--no-loadscope-reorder`, pyproject.toml) xdist hands files to workers in collection order, so
# one of these collected last would run alone at the end while the other workers idle. Files that
# wait for the shared archive (test_smoke, test_ui) come after test_build, which builds it.
LONGEST_FIRST = (
    "test_qualify.py",
    "test_build_platforms.py",
    "test_build.py",
    "test_cluster.py",
    "test_ui.py",
    "test_background_takeover.py",
    "test_clients_doc.py",
    "test_node_process.py",
    "test_smoke.py",
    "test_usage_report.py",
    "test_edges_utilisation.py",
    "test_faults.py",
    "test_runtime.py",
    "test_lint.py",
    "test_anthropic_messages.py",
    "test_ledger.py",
    "test_edge_process.py",
    "test_local_guide.py",
    "test_faults_flow.py",
)


def pytest_configure(config: pytest.Config) -> None:
    # Bytecode is written even where PYTHONDONTWRITEBYTECODE is set (as in some CI images): without
    # it every edge, node and CLI process a test starts compiles iop from source again, and every
    # xdist worker rewrites and compiles each test module (a worker's collection: 10 CPU-s cold, 4
    # warm). It goes into the git-ignored __pycache__ folders. Runs before the workers start.
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    sys.dont_write_bytecode = False
    if config.getoption("numprocesses", None) and not hasattr(config, "workerinput"):
        _rewrite_test_modules_once(config)


def _rewrite_test_modules_once(config: pytest.Config) -> None:
    """The assertion-rewritten bytecode of every test module, written once by xdist's controller:
    from a fresh checkout each worker would otherwise rewrite and compile them all, at the same time.

    pytest's own functions, so the workers read what they would have written; with another pytest
    (or --assert=plain) nothing is done here and the workers do it as usual."""
    try:
        from _pytest.assertion import rewrite

        state = config.stash[rewrite.assertstate_key]
        asked = [config.invocation_params.dir / arg.split("::")[0] for arg in config.args]
        for source in sorted(Path(__file__).parent.glob("test_*.py")):
            if not any(source == path or path in source.parents for path in map(Path.resolve, asked)):
                continue
            pyc = rewrite.get_cache_dir(source) / (source.stem + rewrite.PYC_TAIL)
            if rewrite._read_pyc(source, pyc, state.trace) is None:
                pyc.parent.mkdir(exist_ok=True)
                source_hash, code = rewrite._rewrite_test(source, config)
                rewrite._write_pyc(state, code, source_hash, pyc)
    except (ImportError, AttributeError, KeyError, TypeError, OSError, SyntaxError):
        return


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's own order stays


@pytest.fixture
async def nats_server(tmp_path: Path) -> AsyncIterator[EmbeddedNats]:
    """A real nats-server with JetStream (file store in tmp), port chosen by the server."""
    server = EmbeddedNats("127.0.0.1:0", tmp_path / "nats")
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A throwaway CA with a server and a client certificate, and a second CA that signed neither."""
    if not have_openssl():
        pytest.skip("the openssl command is not installed, so no test certificates can be made")
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="session")
def archive_sources(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return snapshot_sources(tmp_path_factory.mktemp("src") / "iop-src")


@pytest.fixture(scope="session")
def built_archive(archive_sources: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """dist/iop.pyz as `python build.py` writes it, built once per test run (test_build, test_smoke, test_ui).

    Under pytest-xdist the workers of one run share it: the first to get the lock builds it into
    the run's own temporary folder, the others wait and read it (one build instead of one per worker).
    """
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    out = shared / "dist" / "iop.pyz"
    with (shared / "dist.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not out.exists():
            out.parent.mkdir(exist_ok=True)
            building = out.with_name("building.pyz")  # renamed once whole: a failed build leaves no archive
            done = build_archive(archive_sources, building)
            assert str(building) in done.stdout and "sha256" in done.stdout
            building.rename(out)
    return out


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Callable[[str], Path]]:
    """Mounts a tmpfs of the size asked (`64m`) and returns its directory; unmounted after the test.

    A disk that really fills (ENOSPC) needs root (CI runs tests as root); elsewhere the test is
    skipped with the reason, never faked.
    """
    mounted: list[Path] = []

    def mount(size: str) -> Path:
        where = tmp_path / f"disk{len(mounted)}"
        where.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True, text=True
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a {size} tmpfs to fill (needs root): {done.stderr.strip()}")
        mounted.append(where)
        return where

    try:
        yield mount
    finally:
        for where in reversed(mounted):
            subprocess.run(["umount", "-l", str(where)], check=False)
