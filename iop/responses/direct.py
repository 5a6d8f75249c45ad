"""The last values of a KV bucket's keys, many in one direct get (`multi_last`, nats-server 2.11+).

Each value comes with its stream sequence and the time of its message. A server that does not
answer batched gets (older, or a user not allowed them) is asked one key at a time from then on.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime
from typing import Any

import msgspec
from nats.aio.client import Client as NATS

log = logging.getLogger("iop.responses")
_encode = msgspec.json.Encoder().encode
TIMEOUT_S = 5.0
Got = tuple[bytes, int, float]
"""A value read, with the stream sequence and the time of its oldest message (-1, 0.0: not known)."""


class DirectGets:
    """Direct gets of one bucket's keys through one connection."""

    def __init__(self, nc: NATS, bucket: str) -> None:
        self.nc = nc
        self.direct = f"$JS.API.DIRECT.GET.KV_{bucket}"
        self.subject = f"$KV.{bucket}."
        self.batched = True
        """Direct gets of many keys answered (a server before 2.11, or a user not allowed them: one a key)."""

    async def last_of(self, keys: list[str]) -> dict[str, Got] | None:
        """The last value of each key, deleted ones left out, in one direct get (None: not answered so)."""
        if not keys:
            return {}
        if not self.batched:
            return None
        if len(keys) == 1:
            return await self._last_one(keys[0])
        nc, found = self.nc, dict[str, Got]()
        done: asyncio.Future[str] = asyncio.get_running_loop().create_future()

        async def one(msg: Any) -> None:
            headers = msg.headers or {}
            status = headers.get("Status")
            if status is not None:
                if not done.done():
                    done.set_result(status)
            elif headers.get("KV-Operation") is None:  # a DEL or PURGE marker: the key is gone
                key = headers.get("Nats-Subject", "")[len(self.subject) :]
                found[key] = _got(msg.data, headers)

        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox, cb=one, pending_bytes_limit=1 << 31)
        try:
            ask = _encode({"multi_last": [self.subject + k for k in keys]})
            await nc.publish(self.direct, ask, reply=inbox)
            status = await asyncio.wait_for(done, TIMEOUT_S)
        except TimeoutError:
            status = "timeout"
        finally:
            await sub.unsubscribe()
        if status == "204":  # the end of the batch
            return found
        if status == "404":  # none of them there
            return {}
        if status in ("timeout", "503"):  # not answered, or no direct gets on the bucket: never again here
            log.warning("response store: batched direct gets unanswered (%s); reading one key at a time", status)
            self.batched = False
        return None

    async def _last_one(self, key: str) -> dict[str, Got] | None:
        """One key's last value: a direct get of its subject (one reply, through the shared inbox)."""
        msg = await self.nc.request(f"{self.direct}.{self.subject}{key}", b"", timeout=TIMEOUT_S)
        headers = msg.headers or {}
        status = headers.get("Status")
        if status is not None:
            return {} if status == "404" else None
        if headers.get("KV-Operation") is not None:  # a DEL or PURGE marker: the key is gone
            return {}
        return {key: _got(msg.data, headers)}


def _got(data: bytes, headers: dict[str, str]) -> Got:
    """A direct get's value with its message's sequence and time, from the reply's headers."""
    return (data, int(headers.get("Nats-Sequence", -1)), _time(headers.get("Nats-Time-Stamp")))


def _time(stamp: str | None) -> float:
    """A message's `Nats-Time-Stamp` as Unix time; 0.0 (long expired) when there is none."""
    try:
        return datetime.fromisoformat(stamp).timestamp() if stamp else 0.0
    except ValueError:
        return 0.0
