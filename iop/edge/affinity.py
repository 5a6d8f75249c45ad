"""Prefix-cache affinity: which provider served a session last, so its next turn can go there again.

A local model server answers a conversation's next turn far faster while the conversation's prefix
is still in its cache. The edge remembers, per pool and session key, the provider that took the
session's last request, and the scheduler prefers that provider when it has a free slot (or within
the pool's `affinity_wait_ms`). Sessions live in one bounded LRU per edge: the oldest session is
forgotten first, and a forgotten session costs one cache miss, nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass

from iop.lru import Lru

MAX_SESSIONS = 65_536
"""Sessions one edge remembers, the least recently used going first: 22-43 MiB of memory when all
are 250-character keys (iop/lru.py), 8-16 MiB with 36-character ones."""
MAX_KEY_CHARS = 256
"""Longer session keys are cut: a key is an identifier, never a payload to keep."""


@dataclass
class AffinityCounts:
    """One pool's affinity decisions since this edge started."""

    hits: int = 0
    """Requests that went to the provider their session used last."""
    misses: int = 0
    """Requests of a known session that went elsewhere (that provider busy, gone or failed)."""


class Sessions:
    """The bounded LRU of (pool alias, session key) → provider id, and the per-pool counts."""

    def __init__(self, max_sessions: int = MAX_SESSIONS) -> None:
        self.max_sessions = max_sessions
        self._last: Lru[str] = Lru(max_sessions)
        """By `alias\\nsession key` (an alias holds no whitespace): a string key, so nothing of it is
        tracked by the cyclic collector (iop/lru.py), however many sessions it holds."""
        self.counts: dict[str, AffinityCounts] = {}

    def __len__(self) -> int:
        return len(self._last)

    def preferred(self, alias: str, session: str) -> str | None:
        """The provider that served this session of `alias` last, if it is remembered."""
        return self._last.get(f"{alias}\n{session[:MAX_KEY_CHARS]}")

    def served(self, alias: str, session: str, provider: str, preferred: str | None) -> bool:
        """A slot of `provider` was granted to this session; returns whether affinity routed it."""
        self._last.put(f"{alias}\n{session[:MAX_KEY_CHARS]}", provider)
        if preferred is None:
            return False
        counts = self.counts.get(alias)
        if counts is None:
            counts = self.counts[alias] = AffinityCounts()
        hit = provider == preferred
        if hit:
            counts.hits += 1
        else:
            counts.misses += 1
        return hit
