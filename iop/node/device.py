"""The machine a node runs on, gathered once at start and told to the edge in the hello (and heartbeats)."""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import shutil
import subprocess
import sys

from iop import __version__, wire

log = logging.getLogger("iop.node")

PROBE_TIMEOUT_S = 3.0
"""Longest any one outside command (nvidia-smi, sysctl) may take; past it, its facts are left out."""


def gather() -> wire.Device:
    """This machine's facts. Cheap: files under /proc, at most a few short commands, each time-bounded."""
    mac = sys.platform == "darwin"
    cpu = _sysctl("machdep.cpu.brand_string") if mac else _cpuinfo_model()
    memory = _mac_memory() if mac else _meminfo_bytes()
    accelerators = _nvidia()
    if mac and platform.machine() == "arm64" and cpu:
        # Apple silicon: the GPU is on the chip and shares its memory with the CPU.
        accelerators.append(wire.Accelerator(name=cpu, memory_mb=memory // 2**20, unified=True))
    return wire.Device(
        os=_os_name(),
        arch=platform.machine(),
        cpu_model=cpu or platform.processor() or "unknown",
        cpu_cores=os.cpu_count() or 0,
        memory_mb=memory // 2**20,
        accelerators=accelerators,
        python=platform.python_version(),
        iop=__version__,
    )


def _os_name() -> str:
    if sys.platform == "darwin":
        return f"macOS {platform.mac_ver()[0]}".strip()
    return f"{platform.system()} {platform.release()}".strip()


def _run(*argv: str) -> str | None:
    """The command's stdout, or None when it is missing, fails or takes longer than PROBE_TIMEOUT_S."""
    if shutil.which(argv[0]) is None:
        return None
    try:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )
    except OSError:
        return None
    try:
        out, _ = proc.communicate(timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        # Not subprocess.run: after the kill it waits for the command without bound, and a command
        # stuck in the kernel (a wedged GPU driver) may never die. Give it a second, then leave it.
        try:
            proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            log.warning("%s did not exit when killed; device facts without it", argv[0])
        if proc.stdout is not None:
            proc.stdout.close()
        return None
    return out if proc.returncode == 0 else None


def _sysctl(name: str) -> str:
    return (_run("sysctl", "-n", name) or "").strip()


def _mac_memory() -> int:
    with contextlib.suppress(ValueError):
        return int(_sysctl("hw.memsize"))
    return _sysconf_memory()


def _cpuinfo_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                # x86 says "model name"; some ARM kernels say "Model" or "Hardware".
                if key.strip() in ("model name", "Model", "Hardware") and value.strip():
                    return value.strip()
    except OSError:
        pass
    return ""


def _meminfo_bytes() -> int:
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return _sysconf_memory()


def _sysconf_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def _nvidia() -> list[wire.Accelerator]:
    out = _run("nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader")
    gpus = []
    for line in (out or "").splitlines():
        name, _, memory = line.rpartition(",")
        if not name.strip():
            continue
        digits = memory.strip().split(" ")[0]  # "24564 MiB"
        gpus.append(wire.Accelerator(name=name.strip(), memory_mb=int(digits) if digits.isdigit() else 0))
    return gpus
