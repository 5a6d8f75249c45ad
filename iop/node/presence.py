"""The node's presence at the edge: a hello at start, a heartbeat every second, a last one on leaving."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

import nats.errors
from nats.aio.client import Client as NATS

from iop import __version__, config, wire
from iop.errors import IopError
from iop.node.resource import Resource

log = logging.getLogger("iop.node")

State = Callable[[], tuple[config.Node, Iterable[Resource]]]
"""The node's catalog and resources as they are now (both change when the catalog does)."""


class NodeRefused(IopError):
    """The edge refused this node (unknown id, or another process holds the id)."""


class Presence:
    """Tells the edges that this instance of the node is alive, and what its resources are doing."""

    def __init__(self, nc: NATS, node_id: str, instance: str, started_at: float, state: State) -> None:
        self.nc = nc
        self.node_id = node_id
        self.instance = instance
        self.started_at = started_at
        self._state = state
        self._seq = 0

    async def hello(self) -> None:
        """Announce ourselves; a refusal is final only once a previous instance had time to be declared lost.

        A node restarted right after a crash finds the edge still counting its old instance as
        connected for up to HEARTBEATS_MISSED heartbeats: it retries for that long before giving up.
        """
        node, _ = self._state()
        hello = wire.Hello(node=self.node_id, instance=self.instance, providers=[p.id for p in node.providers])
        loop = asyncio.get_running_loop()
        give_up = loop.time() + wire.HEARTBEAT_INTERVAL_S * (wire.HEARTBEATS_MISSED + 2)
        told = False
        while True:
            try:
                reply = await self.nc.request(wire.hello_subject(self.node_id), wire.encode(hello), timeout=2.0)
            except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
                log.warning("node %s: no edge answered yet; serving, the edge will see our heartbeats", self.node_id)
                return
            welcome = wire.decode_welcome(reply.data)
            if welcome.accepted:
                return
            if loop.time() >= give_up:
                raise NodeRefused(f"edge {welcome.edge} refused node {self.node_id}: {welcome.reason}")
            if not told:
                log.info(
                    "node %s: edge %s refused our hello (%s); trying again", self.node_id, welcome.edge, welcome.reason
                )
                told = True
            await asyncio.sleep(wire.HEARTBEAT_INTERVAL_S / 2)

    async def heartbeat(self, *, leaving: bool = False) -> None:
        node, resources = self._state()
        self._seq += 1
        hb = wire.NodeHeartbeat(
            node=self.node_id,
            instance=self.instance,
            started_at=self.started_at,
            seq=self._seq,
            providers=[r.live() for r in resources],
            legacy_concurrency=node.legacy_concurrency(),
            version=__version__,
            leaving=leaving,
        )
        await self.nc.publish(wire.heartbeat_subject(self.node_id), wire.encode(hb))
        if leaving:
            await self.nc.flush(timeout=2)

    async def heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(wire.HEARTBEAT_INTERVAL_S)
            try:
                await self.heartbeat()
            except (nats.errors.Error, OSError) as exc:
                log.debug("heartbeat not sent: %s", exc)
