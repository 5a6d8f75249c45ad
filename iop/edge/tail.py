"""`/usage/tail` followers: one ledger consumer shared by every live follower, and limits on how many.

Each follower used to open its own JetStream consumer on IOP_LEDGER: 300 of them, which one
client key could open, cut the edge from ~400 to ~55 requests/s, as the server pushed and the
edge decoded every batch 300 times. Now the live followers share one consumer, made when the
first arrives and removed when the last leaves; each batch is decoded once and each follower
gets the records it may see in a bounded queue — what a status page follower costs. A follower
that replays from `since` still needs a consumer of its own (it starts elsewhere in the stream),
and counts against the same limits.
"""

from __future__ import annotations

import asyncio
from typing import Any

from nats.js import JetStreamContext

from iop.edge.ledger import RequestRecord
from iop.edge.usage_query import follow
from iop.errors import QueueFull, Unavailable

TAIL_BUFFER = 10_000
"""Records a slow follower may fall behind by before the oldest are skipped."""
TAIL_PER_KEY = 4
"""Followers one key (or, without keys, everyone together) may hold open at once; 429 past it."""
TAIL_TOTAL = 64
"""Followers this edge serves at once; 503 past it."""


class Follower:
    """One open `/usage/tail`: what it may see, and the records waiting for it."""

    def __init__(self, label: str, who: str | None, alias: str | None) -> None:
        self.label = label
        self.who = who
        self.alias = alias
        self.queue: asyncio.Queue[RequestRecord] = asyncio.Queue(TAIL_BUFFER)
        self.own: Any = None
        """Its own subscription when it replays from `since`; None while it shares the feed."""

    def offer(self, records: list[RequestRecord]) -> None:
        for r in records:
            if self.alias is not None and r.alias != self.alias:
                continue
            if self.who is not None and r.key != self.who:
                continue  # a client key sees only its own records
            if self.queue.full():
                self.queue.get_nowait()  # a reader that cannot keep up sees the newest records
            self.queue.put_nowait(r)


class TailFeed:
    """The followers of one edge and the one ledger subscription the live ones share."""

    def __init__(self, js: JetStreamContext, *, per_key: int = TAIL_PER_KEY, total: int = TAIL_TOTAL) -> None:
        self.js = js
        self.per_key = per_key
        self.total = total
        self.followers: set[Follower] = set()
        self._live: set[Follower] = set()
        self._sub: Any = None
        self._lock = asyncio.Lock()

    def held_by(self, label: str) -> int:
        return sum(1 for f in self.followers if f.label == label)

    async def join(self, who: str | None, alias: str | None, since: float | None) -> Follower:
        """A new follower of `who`'s records (None: everyone's); QueueFull/Unavailable past the limits."""
        label = who if who is not None else "*"
        if self.held_by(label) >= self.per_key:
            raise QueueFull(
                f"this key already follows the ledger {self.per_key} times; close one (at most "
                f"{self.per_key} /usage/tail per key)",
                code="too_many_followers",
            )
        if len(self.followers) >= self.total:
            raise Unavailable(
                f"this edge already serves {self.total} ledger followers; retry later",
                code="too_many_followers",
                headers={"Retry-After": "5"},
            )
        follower = Follower(label, who, alias)
        self.followers.add(follower)
        try:
            if since is not None:
                follower.own = await follow(self.js, alias, follower.offer, since)
            else:
                async with self._lock:
                    if self._sub is None:
                        self._sub = await follow(self.js, None, self._fan_out)
                    self._live.add(follower)
        except BaseException:
            self.followers.discard(follower)
            raise
        return follower

    async def leave(self, follower: Follower) -> None:
        self.followers.discard(follower)
        if follower.own is not None:
            await follower.own.unsubscribe()
            return
        async with self._lock:
            self._live.discard(follower)
            if not self._live and self._sub is not None:
                sub, self._sub = self._sub, None
                await sub.unsubscribe()

    def _fan_out(self, records: list[RequestRecord]) -> None:
        for follower in self._live:
            follower.offer(records)
