"""`python build.py` writes dist/iop.pyz: iop, its pinned dependencies and nats-server, in one file."""

# Runs on a machine with nothing but CPython >= 3.11 (it needs pip, which CPython ships): standard
# library only, and iop itself is read as files, never imported. See docs/packaging.md.

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

ROOT = Path(__file__).resolve().parent
PACKAGE = ROOT / "iop"
BOOTSTRAP = PACKAGE / "_bootstrap.py"
PINS = ROOT / "build-requirements.txt"
DEFAULT_PYTHONS = ("3.11", "3.12", "3.13", "3.14")

MANIFEST = "iop-bundle.json"  # keep in step with iop/_bootstrap.py
COMMON = "common"
SHEBANG = b"#!/usr/bin/env python3\n"
ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)  # the earliest time a zip can hold: no build clock in the output
DEFLATE_LEVEL = 6  # zlib's default; level 9 takes 3x as long on nats-server for 0.5% less

# pip's install bookkeeping: RECORD lists absolute-ish paths and hashes of files we drop or move,
# INSTALLER/REQUESTED/direct_url.json describe this build machine, not the package.
_DROPPED_DIST_INFO = frozenset({"RECORD", "INSTALLER", "REQUESTED", "direct_url.json"})
_NATS_SERVER = ("bin/nats-server", "bin/nats-server.exe")


@dataclass(frozen=True)
class Entry:
    """One file of the archive."""

    name: str
    data: bytes
    executable: bool = False


def fail(message: str) -> NoReturn:
    print(f"build.py: {message}", file=sys.stderr)
    raise SystemExit(1)


def normalize(name: str) -> str:
    """PEP 503 project name, so `PyYAML`, `pyyaml` and `py_yaml` compare equal."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(path: Path) -> dict[str, str]:
    pins: dict[str, str] = {}
    for number, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        if not sep or not version.strip() or any(c in version for c in "<>=!~*,;"):
            fail(f"{path.name}:{number}: {raw.strip()!r} is not an exact pin `name==version`")
        pins[normalize(name.strip())] = version.strip()
    return pins


def installed_distributions(target: Path) -> dict[str, str]:
    found: dict[str, str] = {}
    for info in target.glob("*.dist-info"):
        fields = dict(
            line.split(": ", 1)
            for line in (info / "METADATA").read_text(encoding="utf-8").splitlines()
            if ": " in line and not line.startswith(" ")
        )
        found[normalize(fields["Name"])] = fields["Version"]
    return found


def install_dependencies(pins_file: Path, python: str, cache: Path) -> Path:
    """The pinned dependencies installed for CPython `python` on this platform, cached under `cache`.

    The cache key is the pin file's hash (plus this platform), so a second build with the same pins
    does not touch the network. Installation goes into a temporary folder renamed into place, so an
    interrupted build never leaves a half-filled cache behind.
    """
    key = hashlib.sha256(pins_file.read_bytes() + platform_key().encode()).hexdigest()[:16]
    tag = "cp" + python.replace(".", "")
    target = cache / "deps" / key / tag
    if target.is_dir():
        return target
    if importlib.util.find_spec("pip") is None:
        fail(f"{sys.executable} has no pip; run `{sys.executable} -m ensurepip` (or install python3-pip)")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".tmp-{tag}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"build.py: installing dependencies for CPython {python} into {target}", file=sys.stderr)
    command = [
        sys.executable, "-m", "pip", "install",
        "--target", str(tmp),
        "--no-compile",
        "--only-binary=:all:",
        # Wheels for another interpreter version; the platform stays this machine's.
        "--python-version", python,
        "--implementation", "cp",
        "--disable-pip-version-check",
        "--no-input",
        "--quiet",
        "-r", str(pins_file),
    ]  # fmt: skip
    # --target cannot be combined with a user install, and a venv is beside the point here;
    # the root warning is noise on CI runners.
    env = {**os.environ, "PIP_USER": "0", "PIP_REQUIRE_VIRTUALENV": "0", "PIP_ROOT_USER_ACTION": "ignore"}
    try:
        if subprocess.run(command, env=env, check=False).returncode != 0:
            fail(f"pip could not install {pins_file.name} for CPython {python} (see above)")
        check_pinned(read_pins(pins_file), installed_distributions(tmp), python)
        try:
            tmp.rename(target)
        except OSError:
            # A build running at the same time got there first with the same pins.
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def check_pinned(pins: dict[str, str], installed: dict[str, str], python: str) -> None:
    # pip resolves dependencies itself; anything it adds beyond the pins would make the archive
    # depend on the day it was built.
    unpinned = sorted(f"{n}=={v}" for n, v in installed.items() if n not in pins)
    if unpinned:
        fail(f"CPython {python} needs distributions that are not pinned; add to {PINS.name}: {unpinned}")
    wrong = sorted(f"{n}: pinned {pins[n]}, got {v}" for n, v in installed.items() if pins[n] != v)
    if wrong:
        fail(f"pip installed other versions than pinned for CPython {python}: {wrong}")


def platform_key() -> str:
    # Must match iop/_bootstrap.py's this_platform().
    machine = os.uname().machine if hasattr(os, "uname") else os.environ.get("PROCESSOR_ARCHITECTURE", "")
    return f"{sys.platform}-{machine.lower()}"


def dependency_files(target: Path) -> dict[str, bytes]:
    """Files of one dependency install that go into the archive, by posix path relative to `target`."""
    files: dict[str, bytes] = {}
    for path in sorted(target.rglob("*")):
        rel = path.relative_to(target).as_posix()
        if path.is_dir() or "__pycache__" in path.parts or path.suffix == ".pyc":
            continue
        parent = path.parent.name
        if parent.endswith(".dist-info") and path.name in _DROPPED_DIST_INFO:
            continue
        # bin/ holds console scripts whose shebang names this build's Python; only nats-server is wanted.
        if rel.startswith("bin/") and rel not in _NATS_SERVER:
            continue
        files[rel] = path.read_bytes()
    return files


def split_common(per_python: dict[str, dict[str, bytes]]) -> list[Entry]:
    """Archive entries: top-level items identical for every Python go to common/, the rest per tag.

    Whole top-level items (a package, a module, a .dist-info folder) are kept together, so each
    import path sees complete packages and complete metadata.
    """

    def top(rel: str) -> str:
        return rel.split("/", 1)[0]

    tops = sorted({top(rel) for files in per_python.values() for rel in files})
    entries: list[Entry] = []
    for item in tops:
        subtrees = {
            tag: {rel: data for rel, data in files.items() if top(rel) == item} for tag, files in per_python.items()
        }
        first = next(iter(subtrees.values()))
        placed = {COMMON: first} if all(tree == first for tree in subtrees.values()) else subtrees
        for folder, tree in placed.items():
            entries.extend(Entry(f"{folder}/{rel}", data, executable=rel in _NATS_SERVER) for rel, data in tree.items())
    return entries


def package_files() -> list[Entry]:
    """The iop package as setuptools would install it: modules, py.typed, configs/*.yaml and the status
    page's files (edge/static/*)."""
    entries: list[Entry] = []
    for path in sorted(PACKAGE.rglob("*")):
        rel = path.relative_to(ROOT).as_posix()
        if not path.is_file() or "__pycache__" in path.parts or path == BOOTSTRAP:
            continue
        in_configs = path.parent == PACKAGE / "configs" and path.suffix == ".yaml"
        in_static = path.parent == PACKAGE / "edge" / "static"
        if path.suffix == ".py" or path.name == "py.typed" or in_configs or in_static:
            entries.append(Entry(f"{COMMON}/{rel}", path.read_bytes()))
    return entries


def iop_version() -> str:
    text = (PACKAGE / "__init__.py").read_text(encoding="utf-8")
    match = re.search(r'^__version__ = "([^"]+)"', text, re.MULTILINE)
    if match is None:
        fail("iop/__init__.py has no __version__")
    return match.group(1)


def content_hash(entries: list[Entry]) -> str:
    digest = hashlib.sha256()
    for entry in entries:
        digest.update(f"{entry.name}\0{int(entry.executable)}\0{len(entry.data)}\0".encode())
        digest.update(entry.data)
    return digest.hexdigest()


def write_archive(out: Path, entries: list[Entry]) -> None:
    """Write the zip: sorted entries, fixed timestamps and modes, so equal inputs give equal bytes."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    with tmp.open("wb") as fp:
        fp.write(SHEBANG)
        with zipfile.ZipFile(fp, "w") as zf:
            for entry in sorted(entries, key=lambda e: e.name):
                info = zipfile.ZipInfo(entry.name, date_time=ZIP_EPOCH)
                info.create_system = 3  # unix, so the mode below is honoured and equal on every OS
                info.external_attr = (0o100755 if entry.executable else 0o100644) << 16
                info.compress_type = zipfile.ZIP_DEFLATED
                zf.writestr(info, entry.data, compresslevel=DEFLATE_LEVEL)
    tmp.chmod(0o755)
    tmp.replace(out)


def build(out: Path, pythons: list[str], pins_file: Path, cache: Path) -> None:
    started = time.monotonic()
    per_python = {
        "cp" + v.replace(".", ""): dependency_files(install_dependencies(pins_file, v, cache)) for v in pythons
    }
    entries = split_common(per_python) + package_files()
    nats = [e.name for e in entries if e.executable]
    if nats != [f"{COMMON}/{_NATS_SERVER[0]}"] and nats != [f"{COMMON}/{_NATS_SERVER[1]}"]:
        fail(f"expected one nats-server binary common to every Python, found {nats or 'none'}")

    entries.append(Entry("__main__.py", BOOTSTRAP.read_bytes()))
    manifest = {
        "format": 1,
        "version": iop_version(),
        "hash": content_hash(sorted(entries, key=lambda e: e.name)),
        "pythons": sorted(per_python),
        "platform": platform_key(),
        "nats_server": nats[0],
    }
    entries.append(Entry(MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode() + b"\n"))
    write_archive(out, entries)

    data = out.read_bytes()
    shown = os.path.relpath(out) if out.is_relative_to(Path.cwd()) else str(out)
    print(
        f"{shown}: {len(data) / 1e6:.1f} MB, sha256 {hashlib.sha256(data).hexdigest()}"
        f" (CPython {', '.join(pythons)} on {platform_key()}; {time.monotonic() - started:.1f} s)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT / "dist" / "iop.pyz", help="archive to write")
    parser.add_argument(
        "--pythons",
        default=",".join(DEFAULT_PYTHONS),
        help="CPython versions to carry compiled dependencies for (default: %(default)s)",
    )
    parser.add_argument("--requirements", type=Path, default=PINS, help="exact pins (default: %(default)s)")
    parser.add_argument(
        "--build-dir", type=Path, default=ROOT / "build", help="dependency cache (default: %(default)s)"
    )
    args = parser.parse_args()
    pythons = sorted({v.strip() for v in args.pythons.split(",") if v.strip()})
    if not pythons or not all(re.fullmatch(r"3\.\d+", v) for v in pythons):
        fail(f"--pythons wants versions like 3.12, got {args.pythons!r}")
    pythons.sort(key=lambda v: int(v.split(".")[1]))
    build(args.out.resolve(), pythons, args.requirements.resolve(), args.build_dir.resolve())


if __name__ == "__main__":
    main()
