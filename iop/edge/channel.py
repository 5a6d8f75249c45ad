"""One request's line to its node at the edge: its replies in order and what it must undo if it ends early."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Protocol

from nats.aio.msg import Msg

from iop import wire
from iop.edge.reorder import Reorder


class Holder(Protocol):
    """What a request holds while its node runs it (the dispatch's attempt and its slot)."""

    def node_started(self) -> None: ...
    def node_ended(self) -> None:
        """The node's end reached the edge: free what the request held, before its client read it all."""
        ...


@dataclass(eq=False)
class Channel:
    """The replies of one request, in order, plus what the edge must undo if it ends early.

    The relay knows nothing of pools or slots: the `holder` (the dispatch's attempt) learns of its
    life as the replies arrive: `node_started` (the node began running it) and `node_ended` (it is
    over for the node: done, failed, lost, or closed by the edge). Each is told at most once, and
    `node_started` never after `node_ended`.
    """

    id: str
    node: str = ""
    """The node the work goes to (where a cancel or credit is sent)."""
    holder: Holder | None = None
    """What the request holds while its node runs it (a slot), told of the node's start and end."""
    queue: asyncio.Queue[wire.Started | wire.Chunk | wire.Done | wire.Failure] = field(default_factory=asyncio.Queue)
    stream_seq: int = 0
    """The work message's JetStream sequence, to delete it if the request ends before it starts."""
    started: bool = False
    ended: bool = False
    started_mono: float = 0.0
    first_chunk_mono: float = 0.0
    cold_start_ms: float = 0.0
    """How long the node waited for its model server to start before it ran the request (its Started says)."""
    ack_subject: str = ""
    body: bytes = b""
    """The request body, kept here when it was too large to travel inside the work item."""
    taken_chunks: int = 0
    """Chunks (and bytes, below) the HTTP side has taken: what flow-control credit is granted from."""
    taken_bytes: int = 0
    credited_chunks: int = 0
    credited_bytes: int = 0
    buffered_bytes: int = 0
    """Answer bytes received from the node and not yet taken by the HTTP side (bounded by the window)."""
    peak_buffered_bytes: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    """HTTP headers the node asked for (on its first chunk), sent with the client's answer."""
    publishing: asyncio.Future[Msg] | None = None
    """The work's publish ack still on its way, when the request ended before it told the stream
    sequence (`Publisher.withdraw` waits for it)."""
    outcome: wire.Done | wire.Failure | None = None
    """The node's last message: what only it knows (tokens, upstream status, exit code)."""
    last_heard: float = 0.0
    """Monotonic time of the node's last message about this request (a reply or a Probe)."""
    published_mono: float = 0.0
    """When the work message was stored in the stream."""
    checked: bool = False
    """Whether the sweep has asked the stream about this request once already."""
    order: Reorder = field(default_factory=Reorder)
    """The node's replies in order, each once, whatever NATS lost and a resend sent again."""
    resending: bool = False
    """A Resend for this request is waiting for the node's answer."""
    resend_mono: float = 0.0
    """When the last Resend was asked."""

    def start(self, at: float | None = None) -> None:
        """The node began running the request (`at`: when, on the monotonic clock; default now)."""
        if not self.started and not self.ended:
            self.started = True
            self.started_mono = time.monotonic() if at is None else at
            if self.holder is not None:
                self.holder.node_started()

    def end(self) -> None:
        if not self.ended:
            self.ended = True
            holder, self.holder = self.holder, None  # told once; and the attempt holds this channel
            if holder is not None:
                holder.node_ended()
