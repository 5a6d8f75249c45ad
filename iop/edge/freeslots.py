"""A pool's providers ranked by free slots, so a dispatch finds the best one without scanning the pool.

Providers sit in one bucket per free-slot count; a heap holds the counts that have a bucket. The
best provider is the first of the highest bucket: O(1) to find, O(log k) to move (k distinct
counts, at most the largest capacity + 1), independent of how many providers the pool has. Within a
bucket the order is the order of arrival at that count, so providers with equal free slots take
turns: the one just chosen has one slot fewer and, once released, rejoins its bucket at the end.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from typing import Generic, Protocol, TypeVar


class Ranked(Protocol):
    @property
    def id(self) -> str: ...


T = TypeVar("T", bound=Ranked)


class FreeSlots(Generic[T]):
    """Items by a positive count (their free slots), highest first, equal counts in turn."""

    __slots__ = ("_buckets", "_counts", "_heap", "_where")

    def __init__(self) -> None:
        self._buckets: dict[int, dict[T, None]] = {}
        """count → items with that count, in the order they arrived at it (a dict: an ordered set)."""
        self._heap: list[int] = []
        """Negated counts; one entry per count in `_counts`, removed lazily once its bucket is gone."""
        self._counts: set[int] = set()
        """The counts in `_heap`: a count is pushed once, so the heap never outgrows the counts seen."""
        self._where: dict[T, int] = {}

    def __len__(self) -> int:
        return len(self._where)

    def __iter__(self) -> Iterator[T]:
        """Every ranked item (no order promised)."""
        return iter(self._where)

    def __contains__(self, item: T) -> bool:
        return item in self._where

    def count_of(self, item: T) -> int | None:
        return self._where.get(item)

    def set(self, item: T, count: int | None) -> None:
        """Rank `item` at `count`, or take it out (None); unchanged counts keep their place."""
        old = self._where.get(item)
        if old == count:
            return
        if old is not None:
            bucket = self._buckets[old]
            del bucket[item]
            if not bucket:
                del self._buckets[old]
            del self._where[item]
        if count is None:
            return
        into = self._buckets.get(count)
        if into is None:
            into = self._buckets[count] = {}
            if count not in self._counts:
                self._counts.add(count)
                heapq.heappush(self._heap, -count)
        into[item] = None
        self._where[item] = count

    def clear(self) -> None:
        self._buckets.clear()
        self._heap.clear()
        self._counts.clear()
        self._where.clear()

    def first(self, exclude: frozenset[str] = frozenset()) -> T | None:
        """The item with the highest count whose id is not in `exclude`; among equals, the earliest."""
        heap = self._heap
        while heap and -heap[0] not in self._buckets:
            self._counts.discard(-heapq.heappop(heap))
        if not heap:
            return None
        top = self._buckets[-heap[0]]
        if not exclude:
            return next(iter(top))
        for item in self._ranked(top, exclude):
            return item
        return None

    def _ranked(self, top: dict[T, None], exclude: frozenset[str]) -> Iterator[T]:
        # A retry excludes the few providers it already tried: the top bucket almost always has
        # another; only when it doesn't are the lower counts sorted (k of them, not the pool).
        for item in top:
            if item.id not in exclude:
                yield item
        for count in sorted(self._buckets, reverse=True)[1:]:
            for item in self._buckets[count]:
                if item.id not in exclude:
                    yield item
