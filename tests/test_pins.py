"""The tests run what ships: the runtime versions the archive bundles, the test tools' pinned versions,
installed by the one command the README shows and CI runs."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# setuptools comes with the venv (pip too, but the test extra pins a newer one), iop is the checkout itself.
NOT_PINNED = {"setuptools", "wheel", "iop"}


def _name(raw: str) -> str:
    return re.sub(r"[-_.]+", "-", raw).lower()


def _pins(path: Path) -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith("-"):
            name, _, version = line.partition("==")
            pins[_name(name)] = version
    return pins


def _installed() -> dict[str, str]:
    return {_name(d.metadata["Name"]): d.version for d in metadata.distributions()}


def test_pins_runtime_versions_are_the_archives() -> None:
    installed = _installed()
    wrong = {
        n: (v, installed.get(n)) for n, v in _pins(ROOT / "build-requirements.txt").items() if installed.get(n) != v
    }
    assert not wrong, f"pinned for the archive vs installed here (install with the README's command): {wrong}"


def test_pins_cover_every_installed_distribution() -> None:
    pins = _pins(ROOT / "build-requirements.txt") | _pins(ROOT / "test-constraints.txt")
    installed = _installed()
    unpinned = sorted(f"{n}=={v}" for n, v in installed.items() if n not in pins and n not in NOT_PINNED)
    assert not unpinned, f"add to test-constraints.txt: {unpinned}"
    wrong = {n: (pins[n], v) for n, v in installed.items() if n in pins and pins[n] != v}
    assert not wrong, f"pinned vs installed: {wrong}"


def test_pins_test_constraints_apply_the_archives_pins() -> None:
    lines = (ROOT / "test-constraints.txt").read_text(encoding="utf-8").splitlines()
    assert "-c build-requirements.txt" in lines
    assert not set(_pins(ROOT / "test-constraints.txt")) & set(_pins(ROOT / "build-requirements.txt"))


def test_pins_ci_runs_the_readmes_test_command() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    (command,) = [line for line in readme.splitlines() if "python -m pytest" in line and "pip install" in line]
    assert "-c test-constraints.txt" in command and " -n " in command  # parallel: the suite mostly waits
    last = (ROOT / ".ci" / "run").read_text(encoding="utf-8").rstrip("\n").splitlines()[-1]
    assert last == command
