"""iop/lru.py: exactly least recently used first, and nothing for the cyclic collector to walk."""

from __future__ import annotations

import gc
import random
from collections import OrderedDict

import msgspec
import pytest

from iop.lru import Lru


class _Value(msgspec.Struct, gc=False):
    size: int


def test_lru_evicts_exactly_as_an_ordered_dict_would_under_random_use() -> None:
    rng = random.Random(30)
    lru: Lru[_Value] = Lru(5_000, lambda v: v.size)
    model: OrderedDict[str, _Value] = OrderedDict()
    weight = 0
    for step in range(60_000):
        key = f"k{rng.randrange(400)}"
        op = rng.random()
        if op < 0.45:
            value = _Value(rng.randrange(1, 60))
            lru.put(key, value)
            if key in model:
                weight -= model.pop(key).size
            model[key] = value
            weight += value.size
            while weight > 5_000:
                weight -= model.popitem(last=False)[1].size
        elif op < 0.9:
            got = lru.get(key)
            want = model.get(key)
            if want is not None:
                model.move_to_end(key)
            assert got is want, step
        else:
            gone = lru.pop(key)
            want = model.pop(key, None)
            if want is not None:
                weight -= want.size
            assert gone is want, step
        assert lru.weight == weight, step
        if step % 997 == 0:
            assert list(lru) == list(model), step  # the same keys in the same order
    assert list(lru) == list(model) and len(lru) == len(model)


def test_lru_counts_entries_without_a_weight_and_keeps_the_newest() -> None:
    lru: Lru[int] = Lru(3)
    for i in range(10):
        lru.put(f"k{i}", i)
    assert list(lru) == ["k7", "k8", "k9"] and lru.weight == 3
    assert lru.get("k7") == 7  # now the most recently used: k8 goes next
    lru.put("k10", 10)
    assert list(lru) == ["k9", "k7", "k10"] and lru.peek("k9") == 9 and "k8" not in lru
    lru.clear()
    assert len(lru) == 0 and lru.weight == 0 and lru.get("k9") is None


LAZY_DICTS = not gc.is_tracked({})
"""CPython 3.11-3.13 track a dict only once it holds something trackable; 3.14 tracks every dict."""


def test_lru_gives_the_cyclic_collector_nothing_to_walk() -> None:
    if not LAZY_DICTS:
        pytest.skip("this CPython tracks every dict (3.14+): the maps are walked whatever they hold")
    lru: Lru[_Value] = Lru(10_000, lambda v: 1)
    gc.disable()  # no collection meanwhile: one would untrack a dict that something had tracked again
    try:
        for i in range(20_000):  # turns over several times
            lru.put(f"owner.item_{i}", _Value(i))
            if i % 3 == 0:
                lru.get(f"owner.item_{i // 2}")
            if i % 997 == 0:
                maps = [v for v in vars(lru).values() if isinstance(v, dict)]
                assert len(maps) == 2 and not any(gc.is_tracked(m) for m in maps), i
    finally:
        gc.enable()
    gc.collect()  # a tuple of strings (the order) is untracked by the first collection that sees it
    held = [v for v in vars(lru).values() if isinstance(v, dict | tuple)]
    assert len(held) == 3 and not any(gc.is_tracked(v) for v in held)  # both maps and the order
    assert len(lru) == 10_000


def test_lru_refuses_none_which_get_gives_for_a_missing_key() -> None:
    lru: Lru[int | None] = Lru(3)
    with pytest.raises(ValueError, match="no None"):
        lru.put("a", None)
    assert len(lru) == 0 and lru.weight == 0
