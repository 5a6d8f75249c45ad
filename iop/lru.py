"""A least-recently-used map the cyclic collector never walks: string keys, untracked values.

An `OrderedDict` is always tracked, and every full collection visits each of its keys and values
(two cache misses an entry): the edge's turn cache and item index, tens of thousands of entries
between them, cost 5 ms a full collection with requests waiting meanwhile. A plain `dict` whose
keys are strings and whose values are untracked (msgspec Structs with `gc=False`, numbers, strings)
is itself never tracked, so `Lru` keeps its entries in two of them:

- `young`: entries put or used since the last turnover, in the order of their last use (a use
  moves its entry to the end);
- `old`: the rest, every one used less recently than any young entry, in that order by `_order`
  (a tuple of their keys, taken at the turnover; tuples of strings are untracked after their first
  collection).

Eviction takes `old`'s entries by `_order`, skipping those used again (moved to `young`) or
removed; once `old` is empty, `young` turns over into it. The order is exactly least recently used
first; each operation is a few dict operations, a turnover one pass over the young keys. `_order`
holds its keys until the next turnover, evicted ones too: at most one key object per entry more
than the map holds (65,536 affinity sessions with 250-character keys: 22-43 MiB, where an
`OrderedDict` held 31).

CPython 3.11-3.13 leave such a dict untracked; 3.14 tracks every dict (and collects the oldest
generation incrementally), so there the maps are visited again, their values only (string keys
are not), one cache miss an entry instead of two.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

V = TypeVar("V")

_GONE = object()


class Lru(Generic[V]):
    """At most `max_weight` of entries (each weighs `weigh(value)`, or 1), least recently used out first.

    Values must not be None; store only untracked ones (see above), or the map is tracked again."""

    def __init__(self, max_weight: int, weigh: Callable[[V], int] | None = None) -> None:
        self.max_weight = max_weight
        self.weight = 0
        self._weigh = weigh
        self._young: dict[str, V] = {}
        self._old: dict[str, V] = {}
        self._order: tuple[str, ...] = ()
        self._at = 0

    def __len__(self) -> int:
        return len(self._young) + len(self._old)

    def __contains__(self, key: str) -> bool:
        return key in self._young or key in self._old

    def __iter__(self) -> Iterator[str]:
        """The keys, least recently used first."""
        yield from (k for k in self._order[self._at :] if k in self._old)
        yield from self._young

    def values(self) -> list[V]:
        return [*self._old.values(), *self._young.values()]

    def peek(self, key: str) -> V | None:
        """The value, its use not counted."""
        value = self._young.get(key)
        return value if value is not None else self._old.get(key)

    def get(self, key: str) -> V | None:
        """The value, now the most recently used."""
        young = self._young
        value = young.pop(key, None)
        if value is None:
            value = self._old.pop(key, None)
            if value is None:
                return None
        young[key] = value
        return value

    def put(self, key: str, value: V) -> None:
        """Set `key` (the most recently used now), then evict the least recently used past the bound."""
        if value is None:
            raise ValueError("an Lru holds no None: get() says None for a missing key")
        self.pop(key)
        self._young[key] = value
        self.weight += self._weigh(value) if self._weigh is not None else 1
        while self.weight > self.max_weight and self._evict():
            pass

    def pop(self, key: str) -> V | None:
        value = self._young.pop(key, None)
        if value is None:
            value = self._old.pop(key, None)
            if value is None:
                return None
        self.weight -= self._weigh(value) if self._weigh is not None else 1
        return value

    def clear(self) -> None:
        self._young, self._old, self._order, self._at, self.weight = {}, {}, (), 0, 0

    def _evict(self) -> bool:
        """Drop the least recently used entry; False when there is none."""
        old, order = self._old, self._order
        while True:
            if self._at >= len(order):
                if not self._young:
                    return False
                # `old` is empty here: each of its keys was in `order`, and is evicted, used or removed.
                self._old = old = self._young
                self._young = {}
                self._order = order = tuple(old)
                self._at = 0
            key = order[self._at]
            self._at += 1
            value = old.pop(key, _GONE)
            if value is not _GONE:
                self.weight -= self._weigh(value) if self._weigh is not None else 1  # type: ignore[arg-type]
                return True
