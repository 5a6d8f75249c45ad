"""A node's catalog as the edge publishes it: one key per node in the iop_catalog KV bucket."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import msgspec
import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from iop import config, wire
from iop.contracts.refresh import diff
from iop.errors import IopError
from iop.nats import auth, streams

log = logging.getLogger("iop.node")

POLL_S = 15.0
"""A node re-reads its key this often even without a notice (a notice can be missed while offline)."""


def differences(local: config.Node, edge: config.Node) -> str:
    """What the edge's section of a node changes against the local file's, in `iop refresh`'s words."""
    changes = diff(config.Deployment(nodes=[local]), config.Deployment(nodes=[edge]))
    lines = [c.line() for c in changes]
    if not lines:  # what a refresh does not act on (legacy concurrency, runtime settings): name the field
        enc = msgspec.json.encode
        lines = [
            f"{name}: {enc(getattr(local, name)).decode()} → {enc(getattr(edge, name)).decode()}"
            for name in local.__struct_fields__
            if getattr(local, name) != getattr(edge, name)
        ]
    return "; ".join(lines)


class CatalogSource:
    """Reads this node's section from the bucket, and follows it: a notice on `iop.node.<id>.catalog`
    (sent by the edge after it writes) or the periodic re-read brings a new revision."""

    def __init__(self, nc: NATS, node_id: str) -> None:
        self.nc = nc
        self.node_id = node_id
        self._subject = f"$JS.API.DIRECT.GET.{auth.CATALOG_STREAM}.$KV.{streams.CATALOG_BUCKET}.{node_id}"
        self.revision = 0
        self._notice = asyncio.Event()

    async def get(self) -> tuple[int, config.Node] | None:
        """The newest section and its revision, or None when the edge has not published one.

        One direct get of the node's own key, the one JetStream request its account may make of
        the bucket (iop/nats/auth.py): no bucket lookup first (a stream info is not lent to it)."""
        try:
            msg = await self.nc.request(self._subject, b"", timeout=5.0)
        except nats.errors.NoRespondersError:
            return None  # no bucket yet: the edge makes it at its start
        headers = msg.headers or {}
        if status := headers.get("Status"):
            if status == "404":
                return None
            raise IopError(f"reading node {self.node_id}'s catalog: {status} {headers.get('Description', '')}".strip())
        if headers.get("KV-Operation") in ("DEL", "PURGE"):
            return None
        revision = int(headers.get("Nats-Sequence", "0"))
        try:
            node = msgspec.json.decode(msg.data, type=config.Node)
        except msgspec.DecodeError as exc:  # not JSON at all too: whatever a writer of the bucket put there
            raise IopError(f"the edge's catalog for node {self.node_id} is unreadable: {exc}") from exc
        return revision, node

    async def wait_first(self, timeout_s: float) -> config.Node:
        """The section to start from; waits for the edge to publish it (it may start after us)."""
        await self._subscribe()
        loop = asyncio.get_running_loop()
        until = loop.time() + timeout_s
        announced = False
        while True:
            got = await self.get()
            if got is not None:
                self.revision, node = got
                return node
            if loop.time() >= until:
                raise IopError(
                    f"no catalog for node '{self.node_id}' on NATS after {timeout_s:g}s: is the edge running, "
                    "and is this id in its deployment file?"
                )
            if not announced:
                log.info("node %s: waiting for the edge to publish its catalog", self.node_id)
                announced = True
            self._notice.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0):
                    await self._notice.wait()

    async def follow(self, apply: Callable[[config.Node], Awaitable[None]]) -> None:
        """Apply every newer section as it appears (runs until cancelled)."""
        await self._subscribe()
        while True:
            self._notice.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(POLL_S):
                    await self._notice.wait()
            try:
                got = await self.get()
            except (nats.errors.Error, TimeoutError) as exc:
                log.debug("catalog read failed: %s", exc)
                continue
            except IopError as exc:
                log.error("%s", exc)
                continue
            if got is not None and got[0] > self.revision:
                self.revision = got[0]
                log.info("node %s: catalog revision %d from the edge", self.node_id, self.revision)
                await apply(got[1])

    async def _subscribe(self) -> None:
        if getattr(self, "_sub", None) is None:

            async def on_notice(msg: Msg) -> None:
                self._notice.set()

            self._sub = await self.nc.subscribe(wire.catalog_subject(self.node_id), cb=on_notice)
