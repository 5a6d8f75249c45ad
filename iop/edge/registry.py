"""Which nodes are connected: hellos and heartbeats in, presence and live counts out."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from iop import config, wire
from iop.edge import intake
from iop.edge.junk import Junk
from iop.edge.scheduler import Scheduler
from iop.edge.share import SlotShare

log = logging.getLogger("iop.edge")

LOST_AFTER_S = wire.HEARTBEAT_INTERVAL_S * wire.HEARTBEATS_MISSED
MALFORMED_LOG_EVERY_S = 10.0
"""A node sending malformed messages is named in the log at most this often, not once per message."""


@dataclass
class NodeState:
    cfg: config.Node
    connected: bool = False
    instance: str | None = None
    last_seen: float | None = None
    """Wall-clock time of the last heartbeat (shown in status)."""
    last_seen_mono: float = 0.0
    started_at: float | None = None
    version: str = ""
    live: dict[str, wire.ProviderLive] = field(default_factory=dict)
    device: wire.Device | None = None
    """The machine the node said it runs on (hello, heartbeats); kept while it is away."""


class Registry:
    """Tracks node presence from heartbeats; tells the scheduler and the relay when a node comes or goes."""

    def __init__(
        self,
        deployment: config.Deployment,
        scheduler: Scheduler,
        edge_id: str,
        on_node_lost: Callable[[str, str], None],
        *,
        on_reconnected: Callable[[], None] | None = None,
        on_tick: Callable[[], None] | None = None,
    ) -> None:
        self.nodes = {n.id: NodeState(cfg=n) for n in deployment.nodes}
        self.scheduler = scheduler
        self.edge_id = edge_id
        self.share = SlotShare(scheduler, edge_id)
        """The slots other edges hold: their announcements, else these heartbeats' counts."""
        self.on_node_lost = on_node_lost
        self.on_reconnected = on_reconnected
        """Called when the edge's NATS connection is back (the relay restarts its silence clocks)."""
        self.on_tick = on_tick
        """Called every watch tick (the relay looks for requests whose answer was lost)."""
        self._refused_logged: dict[tuple[str, str], float] = {}
        self._malformed_logged = -MALFORMED_LOG_EVERY_S
        self.undecodable_hellos = Junk("hello")
        self.undecodable_heartbeats = Junk("heartbeat")
        self._nc: NATS | None = None
        self._task: asyncio.Task[None] | None = None
        self.changed = asyncio.Event()
        """Set on every heartbeat and loss (waiters clear it, then wait)."""

    async def start(self, nc: NATS) -> None:
        self._nc = nc
        await nc.subscribe(wire.heartbeat_subject(), cb=self._on_heartbeat, pending_msgs_limit=100_000)
        await nc.subscribe(wire.hello_subject(), cb=self._on_hello)
        await self.share.start(nc)
        self._task = asyncio.create_task(self._watch())

    async def stop(self) -> None:
        await self.share.stop()
        if self._task is not None:
            self._task.cancel()

    def apply(self, new: config.Deployment) -> None:
        """Follow a refreshed node list: new nodes appear disconnected, removed ones are forgotten."""
        wanted = {n.id: n for n in new.nodes}
        for node_id in list(self.nodes):
            if node_id not in wanted:
                del self.nodes[node_id]
        for node_id, node in wanted.items():
            st = self.nodes.get(node_id)
            if st is None:
                self.nodes[node_id] = NodeState(cfg=node)
            else:
                st.cfg = node

    async def tell_removed(self, node_ids: list[str]) -> None:
        """Tell each connected node of `node_ids` that it left the deployment; wait (1 s at most) until it heard.

        A refresh calls this before it takes the nodes' NATS users away: afterwards nothing reaches them.
        """
        if self._nc is None:
            return
        nc = self._nc
        asks = []
        for node_id in node_ids:
            st = self.nodes.get(node_id)
            if st is None or not st.connected or st.instance is None:
                continue
            welcome = wire.Welcome(
                accepted=False,
                edge=self.edge_id,
                reason=f"node '{node_id}' was removed from the deployment",
                refusal="unknown_node",
            )
            asks.append(nc.request(wire.verdict_subject(node_id, st.instance), wire.encode(welcome), timeout=1.0))
        for outcome in await asyncio.gather(*asks, return_exceptions=True):
            if isinstance(outcome, Exception):
                # An older node does not answer; it finds out from its refused heartbeats, if it can.
                log.debug("a removed node did not confirm: %s", outcome)

    def bus_reconnected(self) -> None:
        """While the edge itself was cut off it heard nothing: restart every node's clock."""
        now = time.monotonic()
        for st in self.nodes.values():
            st.last_seen_mono = max(st.last_seen_mono, now)
        if self.on_reconnected is not None:
            self.on_reconnected()

    def _admit(self, node_id: str, instance: str) -> tuple[NodeState | None, str, wire.Refusal]:
        st = self.nodes.get(node_id)
        if st is None:
            return None, f"node '{node_id}' is not in this deployment", "unknown_node"
        if st.connected and st.instance not in (None, instance):
            return None, f"node '{node_id}' is already connected (instance {st.instance})", "other_instance"
        return st, "", ""

    def _refuse(self, node_id: str, instance: str, reason: str) -> None:
        # Once per instance: a refused node is told (see _on_heartbeat) and goes quiet or away.
        key = (node_id, instance)
        if key not in self._refused_logged:
            log.warning(
                "refused node %s (instance %s): %s", intake.printable(node_id), instance, intake.printable(reason)
            )
            self._refused_logged[key] = time.monotonic()
            if len(self._refused_logged) > 10_000:
                self._refused_logged.clear()

    async def _on_hello(self, msg: Msg) -> None:
        try:
            hello = wire.decode_hello(msg.data)
        except msgspec.DecodeError:
            self.undecodable_hellos.dropped(msg.subject)
            return
        if msg.subject != wire.hello_subject(hello.node):
            return  # a node speaking for another: NATS lets each publish only under its own id
        if not self._well_formed(hello.node, hello.instance):
            return
        st, reason, refusal = self._admit(hello.node, hello.instance)
        if st is None:
            self._refuse(hello.node, hello.instance, reason)
        if st is not None and hello.device is not None:
            st.device = intake.device(hello.device)
        if msg.reply and self._nc is not None:
            welcome = wire.Welcome(accepted=st is not None, edge=self.edge_id, reason=reason, refusal=refusal)
            await self._nc.publish(msg.reply, wire.encode(welcome))

    async def _on_heartbeat(self, msg: Msg) -> None:
        try:
            hb = wire.decode_heartbeat(msg.data)
        except msgspec.DecodeError:
            self.undecodable_heartbeats.dropped(msg.subject)
            return
        if msg.subject != wire.heartbeat_subject(hb.node):
            return  # see _on_hello
        if not self._well_formed(hb.node, hb.instance):
            return
        st, reason, refusal = self._admit(hb.node, hb.instance)
        if st is None:
            self._refuse(hb.node, hb.instance, reason)
            if msg.reply and self._nc is not None and not hb.leaving:
                # Tell the instance: a replaced one stops its work, a removed one waits quietly.
                welcome = wire.Welcome(accepted=False, edge=self.edge_id, reason=reason, refusal=refusal)
                await self._nc.publish(msg.reply, wire.encode(welcome))
            return
        hb = intake.heartbeat(hb, {p.id for p in st.cfg.providers})
        if hb.leaving:
            if st.connected:
                self._lose(st, "node stopped")
            st.instance = None
            return
        if not st.connected:
            log.info("node %s connected (instance %s)", hb.node, hb.instance)
            self._refused_logged.pop((hb.node, hb.instance), None)  # refused again later: say so again
        st.connected = True
        st.instance = hb.instance
        st.last_seen = time.time()
        st.last_seen_mono = time.monotonic()
        st.started_at = hb.started_at
        st.version = hb.version
        if hb.device is not None:
            st.device = hb.device
        st.live = {p.id: p for p in hb.providers}
        for p in st.cfg.providers:
            if p.capacity is not None:
                live = st.live.get(p.id)
                # Slots other edges hold there: this edge dispatches only where one is free for it.
                self.share.heard_node(p.id, live.by_edge if live else {})
                # A provider the node's own policy refused is not served there: not connected.
                self.scheduler.set_connected(p.id, live is not None and not live.refused)
        self.changed.set()

    def _well_formed(self, node_id: str, instance: str) -> bool:
        """A real node's instance is a short token (it becomes a subject token): anything else is dropped."""
        if intake.valid_instance(instance):
            return True
        now = time.monotonic()
        if now - self._malformed_logged >= MALFORMED_LOG_EVERY_S:
            self._malformed_logged = now
            log.warning(
                "node %s: a message with a malformed instance (%s) dropped",
                intake.printable(node_id),
                intake.printable(instance, 40),
            )
        return False

    def _lose(self, st: NodeState, reason: str) -> None:
        st.connected = False
        log.warning("node %s lost: %s", st.cfg.id, reason)
        for p in st.cfg.providers:
            self.scheduler.set_connected(p.id, False)
            self.share.node_lost(p.id)  # its slots, everyone's, are gone with it
        self.on_node_lost(st.cfg.id, reason)
        self.changed.set()

    async def _watch(self) -> None:
        reconnects = 0
        while True:
            await asyncio.sleep(wire.HEARTBEAT_INTERVAL_S / 4)
            if self._nc is not None:
                if not self._nc.is_connected:
                    continue
                # Back from a NATS outage (server restart, network): the missing heartbeats were
                # ours to miss, not the nodes' fault. Give every node a full period again.
                if self._nc.stats["reconnects"] != reconnects:
                    reconnects = self._nc.stats["reconnects"]
                    self.bus_reconnected()
            if self.on_tick is not None:
                self.on_tick()
            now = time.monotonic()
            for st in self.nodes.values():
                if st.connected and now - st.last_seen_mono > LOST_AFTER_S:
                    self._lose(st, f"no heartbeat for {now - st.last_seen_mono:.1f}s")
                    st.instance = None

    async def wait_connected(self, node_ids: list[str], timeout_s: float) -> None:
        """Return once every named node is connected; TimeoutError after `timeout_s`."""
        async with asyncio.timeout(timeout_s):
            while not all(self.connected(n) for n in node_ids):
                self.changed.clear()
                await self.changed.wait()

    def connected(self, node_id: str) -> bool:
        st = self.nodes.get(node_id)
        return bool(st and st.connected)
