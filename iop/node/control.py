"""An administrator's action on one of the node's providers, passed on by an edge (`wire.Control`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any

import msgspec
import nats.errors
from nats.aio.msg import Msg

from iop import wire
from iop.node.resource import Resource

log = logging.getLogger("iop.node")


class Controls:
    """Answers the node's control subject: only edges publish there (iop/nats/auth.py)."""

    def __init__(self, node_id: str, resources: Callable[[], Mapping[str, Resource]]) -> None:
        self.node_id = node_id
        self.resources = resources
        self._tasks: set[asyncio.Task[Any]] = set()

    async def on_control(self, msg: Msg) -> None:
        try:
            control = wire.decode_control(msg.data)
        except msgspec.DecodeError:
            log.warning("node %s: undecodable control message dropped", self.node_id)
            await self._answer(msg, wire.ControlReply(ok=False, message="undecodable control message"))
            return
        r = self.resources().get(control.provider)
        if r is None:
            answer = wire.ControlReply(ok=False, message=f"node {self.node_id} does not serve {control.provider!r}")
        elif r.server is None:
            answer = wire.ControlReply(
                ok=False, message=f"{control.provider!r} has no model server its node runs (no server: block)"
            )
        else:
            was = r.server.state
            log.info("node %s: restarting the model server of %s (asked by an administrator)", self.node_id, r.cfg.id)
            task = asyncio.create_task(r.server.restart())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            answer = wire.ControlReply(ok=True, message=f"restarting the model server of {r.cfg.id} (was {was})")
        await self._answer(msg, answer)

    async def _answer(self, msg: Msg, answer: wire.ControlReply) -> None:
        if not msg.reply:
            return
        try:
            await msg.respond(wire.encode(answer))
        except nats.errors.Error as exc:
            log.debug("node %s: control answer not sent: %s", self.node_id, exc)
