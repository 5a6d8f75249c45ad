"""Random ids for the hot path: `secrets.token_hex`'s ids, drawn from the OS a block at a time.

Each request takes two ids (its request id, its channel's); `secrets.token_hex` asks the kernel for
every one (a getrandom system call each). Here the same CSPRNG bytes come 4 KiB at a time.
"""

from __future__ import annotations

import os

_BLOCK = 4096


class _Pool:
    __slots__ = ("_at", "_bytes", "_pid")

    def __init__(self) -> None:
        self._bytes = b""
        self._at = 0
        self._pid = 0

    def hex(self, nbytes: int) -> str:
        at = self._at
        end = at + nbytes
        if end > len(self._bytes) or self._pid != _pid:
            self._bytes = os.urandom(max(_BLOCK, nbytes))
            self._pid = _pid
            at, end = 0, nbytes
        self._at = end
        return self._bytes[at:end].hex()


_pid = os.getpid()


def _forked() -> None:
    global _pid
    _pid = os.getpid()  # a forked child draws its own bytes, never its parent's next ones


os.register_at_fork(after_in_child=_forked)

token_hex = _Pool().hex
"""`token_hex(n)`: 2n hex digits of n random bytes, as `secrets.token_hex(n)`."""
