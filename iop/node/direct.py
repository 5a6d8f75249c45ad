"""CLI resources: one core NATS subscription each, reached by a direct route; every request runs at once."""

from __future__ import annotations

import logging

import msgspec
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from iop import wire
from iop.node.resource import Resource
from iop.node.running import RunningRequests

log = logging.getLogger("iop.node")


async def subscribe(running: RunningRequests, r: Resource) -> Subscription:
    """Serve CLI resource `r` on its subject until the subscription ends."""

    async def handle(msg: Msg) -> None:
        # Subscription callbacks run one at a time: hand each request to its own task at once.
        try:
            item = wire.decode_work(msg.data)
        except msgspec.DecodeError:
            log.error("CLI resource %s: undecodable request dropped", r.cfg.id)
            return
        if running.stopping or not running.lease.fresh():
            # No Accepted: the live instance of this node (if another) answers, else the edge
            # reports the resource unavailable.
            return
        if msg.reply:
            await running.nc.publish(msg.reply, wire.encode(wire.Accepted(item.id)))
        if running.was_cancelled(item.id):
            # Its client left and the Cancel overtook the request (they travel on different
            # subjects): accepted, so the edge is not left waiting, but never run.
            return
        running.start(r, item, None, trace=msg.headers)

    return await running.nc.subscribe(
        wire.cli_subject(running.node_id, r.cfg.id), cb=handle, pending_msgs_limit=100_000
    )
