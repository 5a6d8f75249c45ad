"""The node's presence at the edge: a hello at start, a heartbeat every second, a last one on leaving;
and the lease that lets this process take work only while the edge counts it as the node's live instance."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from typing import Literal, Protocol

import msgspec
import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from iop import __version__, config, wire
from iop.errors import IopError
from iop.nats import connection

log = logging.getLogger("iop.node")


class Reported(Protocol):
    """A catalog entry as heartbeats report it (a served resource, or one the policy refused)."""

    def live(self) -> wire.ProviderLive: ...


State = Callable[[], tuple[config.Node, Iterable[Reported]]]
"""The node's catalog and resources as they are now (both change when the catalog does)."""

LEASE_S = wire.HEARTBEAT_INTERVAL_S * (wire.HEARTBEATS_MISSED - 0.5)
"""How long a heartbeat sent on time vouches for this instance. An edge declares a node lost after
HEARTBEATS_MISSED silent intervals; past this, it may have, and another instance may hold the id."""
LAPSE_CLAIM_S = 5.0
"""After a lapsed lease is renewed, work taken within this long is run only if its edge says its
client still waits (a Claim): what edges sent while this instance was silent comes first out of
the queue, and an edge that declared the node lost meanwhile has failed it (502 node_lost)."""


REMOVED_RETRY_S = 5.0
"""How often a node removed from the deployment tries NATS again (its user may be gone until it is back)."""


class NodeRefused(IopError):
    """The edge refused this node (unknown id, or another process holds the id)."""


class NodeReplaced(IopError):
    """Another instance of this node id is live at the edge: this one must not serve any more."""


class Lease:
    """Whether this process may take work for its node id.

    Fresh while heartbeats go out on time. A process that was frozen (SIGSTOP, a stalled VM, a
    swapped-out machine) or cut off from NATS finds it stale: it takes nothing until an edge
    confirms it (a hello accepted), and stops for good when an edge says another instance holds
    the id. Work is pulled only under a fresh lease (iop/node/fetch.py, iop/node/direct.py).
    """

    def __init__(self) -> None:
        self.renewed = time.monotonic()
        self.lapse_ended = -LAPSE_CLAIM_S
        """When the lease was last renewed after it had gone stale (monotonic)."""
        self.state: Literal["live", "removed", "replaced"] = "live"
        self.reason = ""
        self.changed = asyncio.Event()
        self.replaced = asyncio.Event()

    def fresh(self) -> bool:
        return self.state == "live" and time.monotonic() - self.renewed < LEASE_S

    def renew(self) -> None:
        if not self.fresh():
            self.lapse_ended = time.monotonic()
        self.renewed = time.monotonic()
        self.state = "live"
        self.changed.set()

    def end(self, state: Literal["removed", "replaced"], reason: str) -> None:
        if self.state == "replaced":
            return  # final
        self.state, self.reason = state, reason
        self.changed.set()
        if state == "replaced":
            self.replaced.set()

    def after_lapse(self) -> bool:
        """Fresh again, but so shortly after a lapse that work taken now may be work an edge gave up on."""
        return time.monotonic() - self.lapse_ended < LAPSE_CLAIM_S

    async def wait(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for the lease to be fresh; whether it is (False at once once replaced)."""
        if self.fresh():
            return True  # the case of every work item: no timer armed and cancelled for nothing
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                while not self.fresh() and self.state != "replaced":
                    self.changed.clear()
                    await self.changed.wait()
        return self.fresh()


class Presence:
    """Tells the edges that this instance of the node is alive, and what its resources are doing."""

    def __init__(
        self, nc: NATS, node_id: str, instance: str, started_at: float, state: State, lease: Lease | None = None
    ) -> None:
        self.nc = nc
        self.node_id = node_id
        self.instance = instance
        self.started_at = started_at
        self._state = state
        self.lease = lease if lease is not None else Lease()
        self._seq = 0
        self._reconnects = 0
        self._reconnect_wait = nc.options.get("reconnect_time_wait", 0.5)
        self.device: wire.Device | None = None
        """The machine, told in the hello and every heartbeat (set by the runtime before the hello)."""

    async def hello(self) -> None:
        """Announce ourselves; a refusal is final only once a previous instance had time to be declared lost.

        A node restarted right after a crash finds the edge still counting its old instance as
        connected for up to HEARTBEATS_MISSED heartbeats: it retries for that long before giving up.
        """
        await self.nc.subscribe(wire.verdict_subject(self.node_id, self.instance), cb=self._on_verdict)
        self._reconnects = self.nc.stats["reconnects"]
        loop = asyncio.get_running_loop()
        give_up = loop.time() + wire.HEARTBEAT_INTERVAL_S * (wire.HEARTBEATS_MISSED + 2)
        told = False
        while True:
            welcome = await self._ask()
            if welcome is None:
                log.warning("node %s: no edge answered yet; serving, the edge will see our heartbeats", self.node_id)
                self.lease.renew()
                return
            if welcome.accepted:
                self.lease.renew()
                return
            if loop.time() >= give_up:
                raise NodeRefused(f"edge {welcome.edge} refused node {self.node_id}: {welcome.reason}")
            if not told:
                log.debug(
                    "node %s: edge %s refused our hello (%s); trying again", self.node_id, welcome.edge, welcome.reason
                )
                told = True
            await asyncio.sleep(wire.HEARTBEAT_INTERVAL_S / 2)

    async def _ask(self) -> wire.Welcome | None:
        """One hello: the edge's answer, or None when no edge answered."""
        node, _ = self._state()
        hello = wire.Hello(
            node=self.node_id, instance=self.instance, providers=[p.id for p in node.providers], device=self.device
        )
        try:
            reply = await self.nc.request(wire.hello_subject(self.node_id), wire.encode(hello), timeout=2.0)
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
            return None
        return wire.decode_welcome(reply.data)

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
            device=self.device,
        )
        reply = "" if leaving else wire.verdict_subject(self.node_id, self.instance)
        await self.nc.publish(wire.heartbeat_subject(self.node_id), wire.encode(hb), reply=reply)
        if leaving:
            await connection.flush(self.nc, 2)

    async def heartbeat_loop(self) -> None:
        while not self.lease.replaced.is_set():
            await asyncio.sleep(wire.HEARTBEAT_INTERVAL_S)
            try:
                await self.beat()
            except (nats.errors.Error, OSError) as exc:
                log.debug("heartbeat not sent: %s", exc)

    async def beat(self) -> None:
        """One heartbeat; or, when the lease may have lapsed, first ask an edge whether we are still the node."""
        reconnects = self.nc.stats["reconnects"]
        if self.lease.fresh() and reconnects == self._reconnects and self.nc.is_connected:
            await self.heartbeat()
            self.lease.renew()
            return
        if not self.nc.is_connected:
            return  # nothing to ask anyone; the lease stays stale until we are back
        self._reconnects = reconnects
        welcome = await self._ask()
        if welcome is None or welcome.accepted:
            if self.lease.state == "removed":
                log.warning("node %s: back in the deployment; serving", self.node_id)
                self.nc.options["reconnect_time_wait"] = self._reconnect_wait
            self.lease.renew()
            await self.heartbeat()
            return
        self._refused(welcome)

    async def _on_verdict(self, msg: Msg) -> None:
        try:
            welcome = wire.decode_welcome(msg.data)
        except msgspec.DecodeError:
            log.warning("node %s: undecodable answer to a heartbeat dropped", self.node_id)
            return
        if not welcome.accepted:
            self._refused(welcome)
        if msg.reply:
            # The edge waits for this before it takes our NATS user away (a refresh removing us).
            with contextlib.suppress(nats.errors.Error):
                await msg.respond(b"")

    def _refused(self, welcome: wire.Welcome) -> None:
        if welcome.refusal == "unknown_node":
            if self.lease.state != "removed":
                log.warning(
                    "node %s: removed from the deployment at edge %s; taking no work, waiting for the id to come back",
                    self.node_id,
                    welcome.edge,
                )
            self.lease.end("removed", welcome.reason)
            # Our NATS user may be gone with the id: knock on the door every REMOVED_RETRY_S, not twice a second.
            self.nc.options["reconnect_time_wait"] = REMOVED_RETRY_S
        elif welcome.refusal == "other_instance" or not welcome.refusal:
            # An edge of an older version gives no refusal kind: a refusal while serving means the id is taken.
            if self.lease.state != "replaced":
                log.warning("node %s: edge %s: %s; this instance stops", self.node_id, welcome.edge, welcome.reason)
            self.lease.end("replaced", f"edge {welcome.edge}: {welcome.reason}")
