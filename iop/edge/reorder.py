"""One request's replies put back in order at the edge: duplicates dropped, what came past a gap held.

A node sends its replies once, in order; NATS can lose some (a server died) and a resend brings
them again, possibly interleaved with newer ones and beside copies that did arrive. What leaves
here is what the request's reader expects: one Started, the chunks 0, 1, 2, … each once, then one
Done or Failure after the last chunk it counts.
"""

from __future__ import annotations

from iop import wire

Answer = wire.Started | wire.Chunk | wire.Done | wire.Failure


class Reorder:
    """Puts the replies of one request in order; `missing` says whether some are still to come."""

    def __init__(self) -> None:
        self.next_seq = 0
        """The chunk the reader gets next: everything below it was handed on."""
        self.started = False
        self.held: dict[int, wire.Chunk] = {}
        """Chunks that came past a gap. Bounded by the flow window: the node sends no further."""
        self.end: wire.Done | wire.Failure | None = None
        """The end as it arrived, held while it counts chunks not handed on yet."""
        self.finished = False
        self.duplicates = 0
        """Replies dropped because they had been handed on already (a resend's copies)."""

    @property
    def missing(self) -> bool:
        """Something was lost on the way: a chunk before a held one, or before the end."""
        return bool(self.held) or (self.end is not None and not self.finished)

    def take(self, reply: Answer) -> list[Answer]:
        """The replies ready for the reader now that `reply` arrived, in order (often just it)."""
        if isinstance(reply, wire.Started):
            if self.started or self.finished:
                self.duplicates += 1
                return []
            self.started = True
            return [reply]
        if isinstance(reply, wire.Chunk):
            if reply.seq < self.next_seq or reply.seq in self.held or self.finished:
                self.duplicates += 1
                return []
            if reply.seq > self.next_seq:
                self.held[reply.seq] = reply
                return []
            ready: list[Answer] = [reply]
            self.next_seq += 1
            while (held := self.held.pop(self.next_seq, None)) is not None:
                ready.append(held)
                self.next_seq += 1
            return ready + self._end_if_complete()
        if self.end is not None or self.finished:
            self.duplicates += 1
            return []
        self.end = reply
        return self._end_if_complete()

    def _end_if_complete(self) -> list[Answer]:
        end = self.end
        if end is None or self.finished or end.chunks > self.next_seq:
            return []
        # Fewer chunks counted than handed on cannot be repaired here: the reader reports the gap.
        self.finished = True
        self.held.clear()
        return [end]
