"""Pool work: one fetch loop per provider slot on the provider's JetStream consumer."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import msgspec
import nats.errors
from nats.aio.msg import Msg

from iop import wire
from iop.errors import Unavailable, failure_of
from iop.node import pull, replay
from iop.node.resource import Resource
from iop.node.running import RunningRequests
from iop.node.servers import ManagedServer

log = logging.getLogger("iop.node")

FETCH_TIMEOUT_S = 1.0
"""How long one pull request waits; bounds how fast an idle worker notices the node stopping."""
SERVER_WAIT_CHECK_S = 1.0
"""While a model server starts, how often its waiting items look at their deadline and cancels (and
keep their message with a progress ack, well within `wire.ACK_WAIT_S`)."""
LEASE_CHECK_S = 5.0
"""How long a fetched message waits for an edge to confirm this instance before it is handed back."""


def start_workers(running: RunningRequests, r: Resource, slots: range) -> list[asyncio.Task[None]]:
    """One fetch loop per slot in `slots` of provider `r`."""
    return [asyncio.create_task(fetch_loop(running, r, i)) for i in slots]


async def fetch_loop(running: RunningRequests, r: Resource, index: int) -> None:
    """Serve slot `index` of a provider: one outstanding pull of one message at a time.

    Each loop pulls on an inbox of its own (iop.node.pull). Loops sharing one see each other's
    responses (a message, or the 408 that ends an expired pull) on one inbox, so a loop can go on
    waiting for a pull the server has already expired: measured, a shared subscription kept 1 of 4
    slots busy where one per loop kept 3.6 (bench/experiments/pull_fetch.py). A lowered capacity or a
    retired provider ends the loop.
    """
    slot = pull.SlotPull(running.nc, wire.WORK_STREAM, wire.consumer_name(r.cfg.id), FETCH_TIMEOUT_S)
    try:
        await slot.open()
    except (nats.errors.Error, OSError) as exc:
        log.error("provider %s: cannot subscribe slot %d's inbox: %s", r.cfg.id, index, exc)
        return
    try:
        await _fetch_until_done(running, r, slot, index)
        await _hand_back(r, slot, index)
    finally:
        await slot.close()


async def _hand_back(r: Resource, slot: pull.SlotPull, index: int) -> None:
    """A run sent the slot's next pull just before the slot stopped serving (retired, capacity
    lowered, stopping): whatever that pull brings goes back to the broker at once."""
    if not slot.waiting:
        return
    try:
        msg = await slot.next()
        if msg is not None:
            await msg.nak()
    except (nats.errors.Error, OSError) as exc:
        log.debug("provider %s: slot %d's last pull: %s", r.cfg.id, index, exc)


async def _fetch_until_done(running: RunningRequests, r: Resource, slot: pull.SlotPull, index: int) -> None:
    def serving() -> bool:
        return not running.stopping and not r.retired and index < (r.cfg.capacity or 0)

    async def ahead() -> None:
        """The slot's next pull, sent by the run that frees it (see `RunningRequests._run`)."""
        if serving() and running.lease.fresh():
            await slot.begin()

    while serving():
        if not running.lease.fresh():
            # Maybe frozen or cut off long enough for the edge to let another instance in: pull
            # nothing until an edge confirms us, and end once one says the id is taken.
            if running.lease.state == "replaced":
                return
            await running.lease.wait(FETCH_TIMEOUT_S)
            continue
        try:
            msg = await slot.next()
        except nats.errors.ConnectionClosedError:
            return
        except (nats.errors.Error, OSError) as exc:
            # A publish refused while nats-py reconnects (it reconnects by itself): don't spin meanwhile.
            log.debug("pull for %s failed: %s", r.cfg.id, exc)
            await asyncio.sleep(pull.PAUSE_S)
            continue
        if msg is not None:
            await _take(running, r, msg, ahead)


async def _take(running: RunningRequests, r: Resource, msg: Msg, ahead: Callable[[], Awaitable[None]]) -> None:
    try:
        item = wire.decode_work(msg.data)
    except msgspec.DecodeError:
        log.error("provider %s: undecodable work message dropped", r.cfg.id)
        await msg.term()
        return
    if running.was_cancelled(item.id):
        await msg.term()
        return
    claimed = False
    if not running.lease.fresh() or running.lease.after_lapse():
        if not await running.lease.wait(LEASE_CHECK_S):
            # Delivered to a pull made before a freeze: hand it back at once for the live instance.
            log.info("provider %s: request %s handed back (this instance is not confirmed live)", r.cfg.id, item.id)
            await msg.nak()
            return
        # Taken while this instance was silent (frozen, cut off): its edge may have declared the
        # node lost meanwhile and failed the request (502 node_lost), and its client may have
        # retried. Only the edge knows whether the client still waits for it; no clear yes, no run.
        if not await _claim(running, item):
            log.info("provider %s: request %s dropped (its client no longer waits for it)", r.cfg.id, item.id)
            await msg.term()
            return
        claimed = True
    if msg.metadata.num_delivered > 1 and running.redelivered(item, msg):
        # Ran (or runs) here already, its ack or progress lost with a NATS server: never again.
        # An ended one is acked now and its answer sent again, in case the edge lost it too.
        if item.id not in running.by_id:
            await msg.ack()
            await replay.resend(running.nc, running.replay, wire.Resend(item.id, 0, started=True))
        return
    if msg.metadata.num_delivered > 1 and not claimed and not await _claim(running, item):
        # Redelivered: the earlier delivery may have run. Only the edge knows whether the client
        # still waits for it, and it never lets a request run twice once a byte reached the client.
        log.info("provider %s: redelivered request %s dropped (its edge does not want it again)", r.cfg.id, item.id)
        await msg.term()
        return
    server = r.server
    cold_ms = 0.0
    if server is not None:
        waited = await _wait_for_server(running, server, item, msg)
        if not isinstance(waited, float):
            await _not_run(running, r, item, msg, waited)
            return
        cold_ms = round(waited * 1000, 3)
    try:
        if time.time() > item.deadline:
            await msg.term()
            late = Unavailable("waited past its deadline", code="queue_timeout")
            await running.publish(item, failure_of(late, item.id, 0))
            return
        run = running.start(r, item, msg, cold_start_ms=cold_ms, trace=msg.headers, ahead=ahead)
        assert run.freed is not None
        # Until the upstream has answered and the work is acked, not until the Done is out: the
        # next pull then reaches the broker before the edge's next publish does, and the broker's
        # max_ack_pending still holds the provider to its capacity. (Awaited directly, one loop
        # turn: the run yields one turn for it. Cancelled here, the run goes on by itself.)
        await run.freed
    finally:
        if server is not None:
            server.release()


async def _wait_for_server(
    running: RunningRequests, server: ManagedServer, item: wire.WorkItem, msg: Msg
) -> float | Unavailable | None:
    """Wait for the item's model server to be ready (a cold start, a swap); the seconds it took.

    The message stays taken meanwhile, kept from redelivery with progress acks: the slot it holds
    is the one it runs in, so capacity stays exact. None: the client left, the deadline passed, or
    the node is stopping; Unavailable: the server's start failed.
    """
    acquiring = asyncio.create_task(server.acquire())
    while not acquiring.done():
        await asyncio.wait({acquiring}, timeout=SERVER_WAIT_CHECK_S)
        if acquiring.done():
            break
        if running.stopping or running.was_cancelled(item.id) or time.time() > item.deadline:
            acquiring.cancel()
            await asyncio.wait({acquiring})
            break
        try:
            await msg.in_progress()
        except (nats.errors.Error, OSError) as exc:
            log.debug("progress of %s not sent: %s", item.id, exc)
    if acquiring.cancelled():
        return None
    if (error := acquiring.exception()) is not None:
        return error if isinstance(error, Unavailable) else None
    return acquiring.result()  # granted even if it was given up at the same instant: released by the caller


async def _not_run(
    running: RunningRequests, r: Resource, item: wire.WorkItem, msg: Msg, failed: Unavailable | None
) -> None:
    """An item given up while its model server started (or whose start `failed`): say why, and
    leave the message to whom it belongs."""
    if running.stopping:
        await msg.nak()  # the node's next instance, or another node's provider, takes it
    elif running.was_cancelled(item.id):
        await msg.term()
    else:
        await msg.term()
        why = failed or Unavailable(
            f"the model server of {r.cfg.id} was not ready before the queue timeout", code="queue_timeout"
        )
        await running.publish(item, failure_of(why, item.id, 0))


async def _claim(running: RunningRequests, item: wire.WorkItem) -> bool:
    """Ask the edge whether a redelivered item may run (its first delivery may have run already)."""
    try:
        reply = await running.nc.request(item.reply_to, wire.encode(wire.Claim(item.id)), timeout=2.0)
        return wire.decode_verdict(reply.data).go
    except (nats.errors.Error, TimeoutError, msgspec.DecodeError) as exc:
        # No clear yes: not running it is the safe side (the edge fails or retries the request).
        log.debug("claim of %s unanswered: %s", item.id, exc)
        return False
