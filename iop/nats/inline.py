"""Subscriptions whose handler runs as nats-py reads each message, with no task in between.

nats-py puts every message of a subscription on the subscription's queue, which a task of its
own reads and hands to the callback: one more turn of the event loop, and one more wake-up of a
task, between the read of a message and its handling. On the request path that is every reply a
node sends (the edge's relay), every ack of a work item's publish, every work item a node's pull
receives and every part of a large body sent to it: at c=1 each such hop took 40 µs of a 2-core
VM's 1.5 ms (`python -m bench.experiments.c1_timeline`).

Here the handler is a plain function, called by nats-py's reader as it takes the message off the
wire, in wire order. It must neither block nor await: what has to wait (a publish in answer) it
starts as a task. An exception it raises is logged and the message dropped, as nats-py's own
task does with its callback's.

This replaces the subscription's queue with an object that hands each message on at once
(`Subscription._pending_queue`, nats-py 2.16's; the tests pin that version and every test that
sends a request goes through here).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

log = logging.getLogger("iop.nats")

Handler = Callable[[Msg], None]


async def subscribe(nc: NATS, subject: str, handler: Handler) -> Subscription:
    """`nc.subscribe(subject)` with `handler(msg)` called as each message is read."""
    sub = await nc.subscribe(subject, cb=_unused)
    pending = sub._pending_queue  # nats-py's: see the module's docstring
    sub._pending_queue = _AtOnce(sub, handler, subject)  # type: ignore[assignment]
    while not pending.empty():  # read while the subscription was being made: none in practice
        sub._pending_queue.put_nowait(pending.get_nowait())
    return sub


async def _unused(msg: Msg) -> None:
    """nats-py's subscription task waits on the queue this module took away: it is never called."""


class _AtOnce:
    """Stands for a subscription's queue (what nats-py calls on it): a message put is handled now."""

    def __init__(self, sub: Subscription, handler: Handler, subject: str) -> None:
        self._sub = sub
        self._handler = handler
        self._subject = subject

    def put_nowait(self, msg: Msg) -> None:
        # nats-py counted its bytes as pending (its slow-consumer bound); they are handled now.
        self._sub._pending_size -= len(msg.data)
        try:
            self._handler(msg)
        except Exception:
            log.exception("handling a message on %s", self._subject)

    def qsize(self) -> int:
        return 0

    def empty(self) -> bool:
        return True

    def task_done(self) -> None:
        pass

    async def join(self) -> None:
        pass

    async def get(self) -> Any:
        await asyncio.get_running_loop().create_future()  # nothing is ever queued here
