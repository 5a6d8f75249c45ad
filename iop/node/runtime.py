"""A running node: fetch loops per provider, a subscriber per CLI resource, heartbeats, cancels."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from iop import __version__, bus, config, wire
from iop.errors import IopError, RequestError, Unavailable
from iop.node import adapters
from iop.node.catalog import CatalogSource
from iop.node.flow import STALL_TIMEOUT_S, FlowWindow

log = logging.getLogger("iop.node")

FETCH_TIMEOUT_S = 1.0
"""How long one pull request waits; bounds how fast an idle worker notices the node stopping."""
CANCEL_MEMORY_S = 120.0
CHUNK_BYTES = 256 * 1024
"""The largest piece of an answer in one NATS message (far below any server's max_payload)."""
PROBES_UNANSWERED = 2
"""Consecutive probes without a responder after which the edge of a request counts as gone."""


@dataclass(eq=False)
class Running:
    """One request this node runs, with what the edge told it about its client."""

    item: wire.WorkItem
    msg: Msg | None
    window: FlowWindow
    since: float
    task: asyncio.Task[None] | None = None
    unanswered: int = 0
    """Consecutive probes that found no responder at the edge."""
    answered: bool = False
    """The adapter has finished: the edge may already have forgotten it, nothing to stop any more."""


class NodeRefused(IopError):
    """The edge refused this node (unknown id, or another process holds the id)."""


@dataclass
class Resource:
    """One entry of the node's catalog with its adapter and live counts."""

    cfg: config.Provider
    adapter: adapters.Adapter
    kind: str  # "pool" or "cli"
    in_flight: int = 0
    peak_in_flight: int = 0
    served: int = 0
    failed: int = 0
    workers: list[asyncio.Task[None]] = field(default_factory=list)
    retired: bool = False
    """Taken out of the catalog: fetches no more work, finishes what it runs."""
    sub: Any = None

    def live(self) -> wire.ProviderLive:
        return wire.ProviderLive(
            id=self.cfg.id,
            kind="pool" if self.kind == "pool" else "cli",
            capacity=self.cfg.capacity,
            in_flight=self.in_flight,
            peak_in_flight=self.peak_in_flight,
            served=self.served,
            failed=self.failed,
        )


class NodeRuntime:
    """Serves one node's catalog over NATS. There is no node-wide limit of any kind."""

    def __init__(
        self,
        deployment: config.Deployment | None,
        node_id: str,
        nats_url: str,
        *,
        access: bus.NatsAccess | None = None,
        follow_edge: bool = True,
    ) -> None:
        """`deployment` None: take the catalog from the edge (the iop_catalog bucket) at start.

        With a deployment, the node starts from its section and, if `follow_edge`, switches to the
        edge's section when one exists and follows it from then on.
        """
        self.node_id = node_id
        self.node = deployment.node(node_id) if deployment is not None else config.Node(id=node_id)
        self.from_file = deployment is not None
        self.follow_edge = follow_edge
        self.nats_url = nats_url
        self.access = access
        self.instance = secrets.token_hex(6)
        self.started_at = time.time()
        self.nc: NATS | None = None
        self._adapters: dict[str, adapters.Adapter] = {}
        self._adapter_cfgs: dict[str, config.Adapter] = {}
        self._old_adapters: list[adapters.Adapter] = []
        self.resources: dict[str, Resource] = {}
        self._running: dict[str, Running] = {}
        self._cancelled: dict[str, float] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._stopping = False
        self._hb_seq = 0
        self.stall_timeout_s = STALL_TIMEOUT_S
        self.probe_interval_s = wire.PROBE_INTERVAL_S
        self.changed = asyncio.Event()
        """Set when a request starts, ends, or waits for credit (observers clear it, then wait)."""

    def requests(self) -> list[Running]:
        """The requests running now (status, tests)."""
        return list(self._running.values())

    # --- lifecycle ------------------------------------------------------------------------------

    async def start(self, *, connect_wait_s: float | None = None, catalog_wait_s: float = 60.0) -> None:
        access = self.access if self.access is not None else bus.default_access.get()
        self.nc = await bus.connect(self.nats_url, f"iop-node-{self.node_id}", access=access, wait_s=connect_wait_s)
        self.catalog = CatalogSource(self.nc, self.node_id)
        if not self.from_file:
            self.node = await self.catalog.wait_first(catalog_wait_s)
        elif self.follow_edge:
            got = await self.catalog.get()
            if got is not None:
                self.catalog.revision, edge_node = got
                if edge_node != self.node:
                    log.warning(
                        "node %s: the edge's catalog differs from the local file; following the edge", self.node_id
                    )
                    self.node = edge_node
        await self._hello()
        await self.nc.subscribe(wire.cancel_subject(self.node_id), cb=self._on_cancel)
        await self.nc.subscribe(wire.credit_subject(self.node_id), cb=self._on_credit, pending_msgs_limit=1_000_000)
        await self._apply(self.node)
        # "Started" means the server has our subscriptions, not that they are still in our buffer.
        await self.nc.flush(timeout=5)
        self._spawn(self._heartbeat_loop())
        self._spawn(self._progress_loop())
        self._spawn(self._probe_loop())
        if self.follow_edge:
            self._spawn(self.catalog.follow(self.apply_catalog))
        await self._heartbeat()
        pool = [r for r in self.resources.values() if r.kind == "pool"]
        log.info(
            "node %s serving %d providers, %d CLI resources (instance %s)",
            self.node_id,
            len(pool),
            len(self.resources) - len(pool),
            self.instance,
        )

    async def apply_catalog(self, node: config.Node) -> None:
        """Switch to a new catalog while serving: running requests finish where they run."""
        await self._apply(node)
        await self._heartbeat()

    async def _apply(self, node: config.Node) -> None:
        assert self.nc is not None
        self.node = node
        new_cfgs = {a.id: a for a in node.adapters}
        for aid, cfg in new_cfgs.items():
            if self._adapter_cfgs.get(aid) != cfg:
                if aid in self._adapters:
                    self._old_adapters.append(self._adapters[aid])  # closed at stop: requests may still use it
                self._adapters[aid] = adapters.build(cfg)
                self._adapter_cfgs[aid] = cfg
        for aid in list(self._adapters):
            if aid not in new_cfgs:
                self._old_adapters.append(self._adapters.pop(aid))
                del self._adapter_cfgs[aid]
        wanted = {p.id: p for p in node.providers}
        for pid, gone in list(self.resources.items()):
            p = wanted.get(pid)
            if p is None or _kind(node, p) != gone.kind:
                await self._retire(gone)
                del self.resources[pid]
        js = self.nc.jetstream()
        for pid, p in wanted.items():
            adapter = self._adapters[p.adapter]
            existing = self.resources.get(pid)
            if existing is None:
                fresh = self.resources[pid] = Resource(cfg=p, adapter=adapter, kind=_kind(node, p))
                await self._serve(fresh, js)
                continue
            r = existing
            before = r.cfg.capacity or 0
            r.cfg, r.adapter = p, adapter
            if r.kind == "pool" and (p.capacity or 0) > before:
                # One fetch loop per slot: more slots, more loops (fewer: the extra loops end).
                r.workers += [asyncio.create_task(self._fetch_loop(r, js, i)) for i in range(before, p.capacity or 0)]

    async def _serve(self, r: Resource, js: Any) -> None:
        assert self.nc is not None
        if r.kind == "cli":
            r.sub = await self.nc.subscribe(
                wire.cli_subject(self.node_id, r.cfg.id), cb=self._cli_handler(r), pending_msgs_limit=100_000
            )
            return
        assert r.cfg.capacity is not None
        await bus.ensure_work_stream(js)
        await bus.ensure_provider_consumer(js, r.cfg.id, r.cfg.capacity, update=False)
        # One fetch loop per slot, each with its own pull subscription (see _fetch_loop).
        r.workers = [asyncio.create_task(self._fetch_loop(r, js, i)) for i in range(r.cfg.capacity)]

    async def _retire(self, r: Resource) -> None:
        """Stop taking work for a resource the catalog no longer has; what runs, finishes."""
        r.retired = True
        if r.sub is not None:
            with contextlib.suppress(Exception):
                await r.sub.unsubscribe()
        log.info("node %s: %s left the catalog (finishing %d running)", self.node_id, r.cfg.id, r.in_flight)

    async def stop(self, grace_s: float = 30.0) -> None:
        """Stop taking work, let running items finish up to `grace_s`, fail the rest, leave."""
        self._stopping = True
        workers = [w for r in self.resources.values() for w in r.workers]
        if workers:
            # Fetches are never cancelled (a cancelled pull request can swallow a message): they
            # time out within FETCH_TIMEOUT_S and the loops end by themselves.
            await asyncio.wait(workers, timeout=FETCH_TIMEOUT_S * 3)
        running = [run.task for run in self._running.values() if run.task is not None]
        if running:
            log.info("node %s: waiting up to %gs for %d running requests", self.node.id, grace_s, len(running))
            _, pending = await asyncio.wait(running, timeout=grace_s)
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.wait(pending, timeout=5.0)
        for t in list(self._tasks):
            t.cancel()
        if self.nc is not None and self.nc.is_connected:
            with contextlib.suppress(Exception):
                await self._heartbeat(leaving=True)
        if self.nc is not None:
            # Not drain(): it waits out every idle pull request. All work has ended; flush and go.
            with contextlib.suppress(Exception):
                await self.nc.flush(timeout=2)
            await self.nc.close()
        for a in [*self._adapters.values(), *self._old_adapters]:
            await a.close()

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        t = asyncio.create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    async def _hello(self) -> None:
        """Announce ourselves; a refusal is final only once a previous instance had time to be declared lost.

        A node restarted right after a crash finds the edge still counting its old instance as
        connected for up to HEARTBEATS_MISSED heartbeats: it retries for that long before giving up.
        """
        assert self.nc is not None
        hello = wire.Hello(node=self.node_id, instance=self.instance, providers=[p.id for p in self.node.providers])
        loop = asyncio.get_running_loop()
        give_up = loop.time() + wire.HEARTBEAT_INTERVAL_S * (wire.HEARTBEATS_MISSED + 2)
        while True:
            try:
                reply = await self.nc.request(wire.hello_subject(self.node.id), wire.encode(hello), timeout=2.0)
            except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
                log.warning("node %s: no edge answered yet; serving, the edge will see our heartbeats", self.node.id)
                return
            welcome = wire.decode_welcome(reply.data)
            if welcome.accepted:
                return
            if loop.time() >= give_up:
                raise NodeRefused(f"edge {welcome.edge} refused node {self.node.id}: {welcome.reason}")
            await asyncio.sleep(wire.HEARTBEAT_INTERVAL_S / 2)

    # --- heartbeats -----------------------------------------------------------------------------

    async def _heartbeat(self, *, leaving: bool = False) -> None:
        assert self.nc is not None
        self._hb_seq += 1
        hb = wire.NodeHeartbeat(
            node=self.node.id,
            instance=self.instance,
            started_at=self.started_at,
            seq=self._hb_seq,
            providers=[r.live() for r in self.resources.values()],
            legacy_concurrency=self.node.legacy_concurrency(),
            version=__version__,
            leaving=leaving,
        )
        await self.nc.publish(wire.heartbeat_subject(self.node.id), wire.encode(hb))
        if leaving:
            await self.nc.flush(timeout=2)

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(wire.HEARTBEAT_INTERVAL_S)
            try:
                await self._heartbeat()
            except (nats.errors.Error, OSError) as exc:
                log.debug("heartbeat not sent: %s", exc)

    async def _progress_loop(self) -> None:
        # Long answers outlive ack_wait; tell the broker they are alive so it never redelivers them.
        while True:
            await asyncio.sleep(wire.ACK_WAIT_S / 3)
            for run in list(self._running.values()):
                if run.msg is not None:
                    with contextlib.suppress(Exception):
                        await run.msg.in_progress()

    async def _probe_loop(self) -> None:
        # A dead edge raises nothing when we publish to it; asking is how a node finds out, and the
        # answer also carries the latest credit in case a Credit message was lost.
        while True:
            await asyncio.sleep(self.probe_interval_s)
            now = time.monotonic()
            due = [run for run in self._running.values() if now - run.since >= self.probe_interval_s]
            if due:
                await asyncio.gather(*(self._probe(run) for run in due))

    async def _probe(self, run: Running) -> None:
        assert self.nc is not None
        try:
            reply = await self.nc.request(
                run.item.reply_to, wire.encode(wire.Probe(run.item.id)), timeout=self.probe_interval_s
            )
            credit = wire.decode_credit(reply.data)
        except nats.errors.NoRespondersError:
            # Twice in a row, so that an edge reconnecting to NATS is not taken for a dead one.
            run.unanswered += 1
            if run.unanswered >= PROBES_UNANSWERED:
                self._abandon(run, "its edge is gone")
            return
        except (nats.errors.Error, TimeoutError, OSError, msgspec.DecodeError) as exc:
            log.debug("probe for %s unanswered: %s", run.item.id, exc)
            return
        run.unanswered = 0
        if credit.known:
            run.window.grant(credit.chunks, credit.nbytes)
        else:
            self._abandon(run, "its edge no longer has it")

    def _abandon(self, run: Running, why: str) -> None:
        if run.task is not None and not run.task.done() and not run.answered:
            log.warning("node %s: stopping request %s: %s", self.node.id, run.item.id, why)
            run.task.cancel()

    # --- pool work ------------------------------------------------------------------------------

    async def _fetch_loop(self, r: Resource, js: Any, index: int) -> None:
        """Serve slot `index` of a provider: one outstanding fetch(batch=1) at a time.

        Each loop binds its own pull subscription. Loops sharing one see each other's responses
        (a message, or the 408 that ends an expired pull) on one inbox, so a loop can go on waiting
        for a pull the server has already expired: measured, a shared subscription kept 1 of 4
        slots busy where one per loop kept 3.6 (bench/pull_fetch.py). A lowered capacity or a
        retired provider ends the loop.
        """
        try:
            psub = await js.pull_subscribe_bind(durable=wire.consumer_name(r.cfg.id), stream=wire.WORK_STREAM)
        except (nats.errors.Error, OSError) as exc:
            log.error("provider %s: cannot bind its consumer: %s", r.cfg.id, exc)
            return
        try:
            await self._fetch_until_done(r, psub, index)
        finally:
            with contextlib.suppress(Exception):
                await psub.unsubscribe()

    async def _fetch_until_done(self, r: Resource, psub: Any, index: int) -> None:
        while not self._stopping and not r.retired and index < (r.cfg.capacity or 0):
            try:
                msgs = await psub.fetch(1, timeout=FETCH_TIMEOUT_S)
            except (nats.errors.TimeoutError, TimeoutError):
                continue
            except nats.errors.ConnectionClosedError:
                return
            except (nats.errors.Error, OSError) as exc:
                # Disconnected: nats-py reconnects by itself; don't spin meanwhile.
                log.debug("fetch for %s failed: %s", r.cfg.id, exc)
                await asyncio.sleep(0.5)
                continue
            for msg in msgs:
                await self._take(r, msg)

    async def _take(self, r: Resource, msg: Msg) -> None:
        try:
            item = wire.decode_work(msg.data)
        except Exception:
            log.error("provider %s: undecodable work message dropped", r.cfg.id)
            await msg.term()
            return
        if item.id in self._cancelled:
            await msg.term()
            return
        if msg.metadata.num_delivered > 1 and not await self._claim(item):
            # Redelivered: the earlier delivery may have run. Only the edge knows whether the client
            # still waits for it, and it never lets a request run twice once a byte reached the client.
            log.info("provider %s: redelivered request %s dropped (its edge does not want it again)", r.cfg.id, item.id)
            await msg.term()
            return
        if time.time() > item.deadline:
            await msg.term()
            await self._publish(item, wire.Failure(item.id, 0, 503, "queue_timeout", "waited past its deadline"))
            return
        run = self._start(r, item, msg)
        assert run.task is not None
        await asyncio.wait({run.task})

    async def _claim(self, item: wire.WorkItem) -> bool:
        assert self.nc is not None
        try:
            reply = await self.nc.request(item.reply_to, wire.encode(wire.Claim(item.id)), timeout=2.0)
        except (nats.errors.Error, TimeoutError):
            return False
        return wire.decode_verdict(reply.data).go

    # --- running an item (pool or CLI) --------------------------------------------------------

    def _start(self, r: Resource, item: wire.WorkItem, msg: Msg | None) -> Running:
        # Registered before the task runs, so a Credit or Cancel arriving at once finds it.
        run = Running(item, msg, FlowWindow(self.changed), time.monotonic())
        self._running[item.id] = run
        run.task = asyncio.create_task(self._run(r, run))
        self.changed.set()
        return run

    async def _run(self, r: Resource, run: Running) -> None:
        item, msg, window = run.item, run.msg, run.window
        r.in_flight += 1
        if r.in_flight > r.peak_in_flight:
            r.peak_in_flight = r.in_flight

        async def send(data: bytes) -> None:
            # Whatever an adapter hands over, no NATS message exceeds CHUNK_BYTES, and no more than
            # the window is ever unread at the edge: a slow client slows the upstream, not memory.
            for i in range(0, len(data), CHUNK_BYTES):
                piece = data[i : i + CHUNK_BYTES]
                seq = await window.reserve(len(piece), self.stall_timeout_s)
                await self._publish(item, wire.Chunk(item.id, seq, piece))

        try:
            ack = msg.reply if msg is not None else ""
            await self._publish(item, wire.Started(item.id, self.node.id, self.instance, ack))
            if item.body_size:
                item = msgspec.structs.replace(item, body=await self._fetch_body(item), body_size=0)
            usage = await r.adapter.run(item, r.cfg.model, send)
            run.answered = True
            if msg is not None:
                await msg.ack()  # before Done: the slot is free by the time the edge hears of it
            await self._publish(item, wire.Done(item.id, window.sent_chunks, usage))
            r.served += 1
        except asyncio.CancelledError:
            r.failed += 1
            if msg is not None:
                await _quietly(msg.term())
            reason = "node is stopping" if self._stopping else "cancelled"
            await _quietly(self._publish(item, wire.Failure(item.id, window.sent_chunks, 503, "cancelled", reason)))
        except RequestError as exc:
            r.failed += 1
            if msg is not None:
                await _quietly(msg.term())
            failure = wire.Failure(item.id, window.sent_chunks, exc.status, exc.code, exc.message, exc.ended_stream)
            await _quietly(self._publish(item, failure))
        except Exception as exc:
            r.failed += 1
            log.exception("provider %s: request %s failed", r.cfg.id, item.id)
            if msg is not None:
                await _quietly(msg.term())
            failure = wire.Failure(item.id, window.sent_chunks, 502, "node_error", f"{type(exc).__name__}: {exc}")
            await _quietly(self._publish(item, failure))
        finally:
            r.in_flight -= 1
            self._running.pop(item.id, None)
            self.changed.set()

    async def _fetch_body(self, item: wire.WorkItem) -> bytes:
        """The body of an item that was too large to travel inline, fetched from its edge in parts."""
        assert self.nc is not None
        parts: list[bytes] = []
        got = 0
        while got < item.body_size:
            try:
                reply = await self.nc.request(item.reply_to, wire.encode(wire.BodyPart(item.id, got)), timeout=5.0)
            except (nats.errors.Error, TimeoutError) as exc:
                raise Unavailable(
                    f"the request body could not be fetched from the edge: {type(exc).__name__}", code="cancelled"
                ) from exc
            if not reply.data:
                raise Unavailable("the edge no longer has this request", code="cancelled")
            parts.append(reply.data)
            got += len(reply.data)
        if got != item.body_size:
            raise Unavailable(f"the request body arrived with {got} of {item.body_size} bytes", code="cancelled")
        return b"".join(parts)

    async def _publish(self, item: wire.WorkItem, message: Any) -> None:
        assert self.nc is not None
        await self.nc.publish(item.reply_to, wire.encode(message))

    def _cli_handler(self, r: Resource) -> Any:
        async def handle(msg: Msg) -> None:
            # Subscription callbacks run one at a time: hand each request to its own task at once.
            try:
                item = wire.decode_work(msg.data)
            except Exception:
                log.error("CLI resource %s: undecodable request dropped", r.cfg.id)
                return
            if self._stopping:
                return  # no Accepted: the edge reports the resource unavailable
            assert self.nc is not None
            if msg.reply:
                await self.nc.publish(msg.reply, wire.encode(wire.Accepted(item.id)))
            self._start(r, item, None)

        return handle

    async def _on_cancel(self, msg: Msg) -> None:
        try:
            cancel = wire.decode_cancel(msg.data)
        except Exception:
            return
        now = time.monotonic()
        self._cancelled[cancel.id] = now
        if len(self._cancelled) > 10_000:
            self._cancelled = {k: t for k, t in self._cancelled.items() if now - t < CANCEL_MEMORY_S}
        run = self._running.get(cancel.id)
        if run is not None and run.task is not None:
            run.task.cancel()

    async def _on_credit(self, msg: Msg) -> None:
        try:
            credit = wire.decode_credit(msg.data)
        except msgspec.DecodeError:
            return
        run = self._running.get(credit.id)
        if run is not None:
            run.window.grant(credit.chunks, credit.nbytes)


def _kind(node: config.Node, p: config.Provider) -> str:
    return "cli" if isinstance(node.adapter(p.adapter), config.CliAdapter) else "pool"


async def _quietly(aw: Any) -> None:
    try:
        await aw
    except (nats.errors.Error, OSError, TimeoutError) as exc:
        log.debug("ignored while failing a request: %s", exc)
