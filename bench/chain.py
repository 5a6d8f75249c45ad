"""Scenario: stored-state expansion of a long `previous_response_id` chain (issue 30: 50 turns ≤ 1 ms).

In this process on the edge's event loop, as bench/fairness.py measures admission: a nats-server of
its own (file store), the edge's own `ResponseStore` and `Responses`. Chains of 1, 10 and 50 agent-like turns are built
as the edge builds them (`Responses.expand`, then `Responses.keep` with the answer): each turn a
user message or a function_call_output of 1-2 KB of source code, its answer a function_call and a
short message. At the end of each chain the next turn's expansion is timed, one at a time, on three edges in
turn (blocks of 10): the one that wrote the chain (its cache warm), another whose cache is
emptied before each expansion (cold: every turn read from the store), and one without the cache
(`cache_mb: 0`, the read path before it):

    wall          p50 / p99 of `Responses.expand(previous_response_id=last)` (ms)
    cpu           this process's CPU per expansion (time.process_time), ms
    nats          the nats-server's CPU per expansion (its /proc stat), ms
    bytes         the expanded input, encoded

and the CPU of everything else on the machine beside it.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from bench import fixtures
from bench.procs import Owned, busy_cores, cpu_s, log, machine_ticks
from bench.report import table
from iop import edgeconf
from iop.cli.common import run_async
from iop.nats import connection
from iop.nats.server import EmbeddedNats
from iop.responses.expand import Responses
from iop.responses.store import ResponseStore, owner_of

MODEL = "shared"


@dataclass
class ChainOptions:
    lengths: list[int] = field(default_factory=lambda: [1, 10, 50])
    expansions: int = 200
    """Expansions timed at the end of each chain (quick: 50)."""

    @classmethod
    def quick(cls) -> ChainOptions:
        return cls(expansions=50)


def run_chain(owned: Owned, workdir: Path, opts: ChainOptions) -> dict[str, Any]:
    """Figures by chain length (`owned` unused: the nats-server is this process's child, stopped here)."""
    del owned
    rows = run_async(_measure(workdir / "chain-nats", opts))
    return {"expansions": opts.expansions, "lengths": rows}


def _turn_input(rng: random.Random, turn: int) -> list[dict[str, Any]]:
    """A user message (the first turn and every fifth) or the output of the last turn's call: 1-2 KB."""
    size = rng.randrange(1000, 2000)
    if turn % 5 == 0:
        text = fixtures.prose(rng, size // 6)
        return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}]
    return [{"type": "function_call_output", "call_id": f"call_{turn - 1}", "output": fixtures.code(rng, size)}]


def _answer(rng: random.Random, turn: int, chain: int) -> dict[str, Any]:
    rid = f"resp_bench{chain:03d}t{turn:04d}{rng.randrange(16**8):08x}"
    return {
        "id": rid,
        "object": "response",
        "created_at": 1_700_000_000 + turn,
        "status": "completed",
        "model": MODEL,
        "output": [
            {
                "type": "message",
                "id": f"msg_{rid}",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": fixtures.prose(rng, 20), "annotations": []}],
            },
            {
                "type": "function_call",
                "id": f"fc_{rid}",
                "call_id": f"call_{turn}",
                "name": "read_file",
                "arguments": f'{{"path":"src/module_{turn}.py"}}',
                "status": "completed",
            },
        ],
        "usage": {"input_tokens": 1000 + 500 * turn, "output_tokens": 40, "total_tokens": 1040 + 500 * turn},
    }


async def _build(responses: Responses, owner: str, turns: int, chain: int) -> str:
    """A chain of `turns` kept responses, each expanded and kept as the edge does; the last one's id."""
    rng = random.Random(chain)
    last: str | None = None
    for t in range(turns):
        body: dict[str, Any] = {"model": MODEL, "input": _turn_input(rng, t), "store": True}
        if last is not None:
            body["previous_response_id"] = last
        turn = await responses.expand(body, owner)
        answer = _answer(rng, t, chain)
        await responses.keep(owner, turn, answer)
        last = answer["id"]
    assert last is not None
    return last


ARMS = ("warm", "cold", "off")
"""warm: this edge wrote the turns (its cache holds them); cold: another edge wrote them and this
edge's cache is emptied before each expansion (every turn read from the store, then cached);
off: `cache_mb: 0`, every turn read from the store (the path before the cache)."""
_BLOCK = 10
"""Expansions of one arm in a row before the next arm's: the arms share the machine's state."""


async def _measure(store_dir: Path, opts: ChainOptions) -> list[dict[str, Any]]:
    server = EmbeddedNats("127.0.0.1:0", store_dir)
    await server.start()
    out: list[dict[str, Any]] = []
    conns: list[Any] = []
    try:
        for name in ARMS:
            conns.append(await connection.connect(server.url, f"bench-chain-{name}"))
        edges = {
            name: Responses(
                await ResponseStore.open(nc, edgeconf.ResponsesSettings(cache_mb=0 if name == "off" else 64))
            )
            for name, nc in zip(ARMS, conns, strict=True)
        }
        cold = edges["cold"].store
        assert cold is not None and cold.fresh is not None
        owner = owner_of(b"sk-bench-chain")
        pid = server.pid
        assert pid is not None
        for n in opts.lengths:
            last = await _build(edges["warm"], owner, n, n)  # the warm edge writes the chain
            rng = random.Random(10_000 + n)
            body = {"model": MODEL, "previous_response_id": last, "input": _turn_input(rng, n)}
            turn = await edges["off"].expand(body, owner)  # once unmeasured: the same bytes every time
            sent = msgspec.json.decode(turn.encoded())["input"]
            size, items = len(msgspec.json.encode(sent)), len(sent)
            await edges["warm"].expand(body, owner)
            walls: dict[str, list[float]] = {a: [] for a in ARMS}
            cpu = dict.fromkeys(ARMS, 0.0)
            nats = dict.fromkeys(ARMS, 0.0)
            ticks0, t_wall0, cpu_all0, nats_all0 = machine_ticks(), time.monotonic(), time.process_time(), cpu_s(pid)
            for _ in range(0, opts.expansions, _BLOCK):
                for arm in ARMS:
                    nats0 = cpu_s(pid)
                    for _ in range(_BLOCK):
                        if arm == "cold":
                            cold.fresh.cache.clear()
                        cpu0, t0 = time.process_time(), time.perf_counter()
                        await edges[arm].expand(body, owner)
                        walls[arm].append((time.perf_counter() - t0) * 1000)
                        cpu[arm] += time.process_time() - cpu0
                    nats[arm] += cpu_s(pid) - nats0
            wall = max(1e-9, time.monotonic() - t_wall0)
            mine = time.process_time() - cpu_all0 + cpu_s(pid) - nats_all0
            other = max(0.0, busy_cores(ticks0, machine_ticks()) - mine / wall)
            for arm in ARMS:
                done = sorted(walls[arm])
                row = {
                    "turns": n,
                    "cache": arm,
                    "items": items,
                    "input_bytes": size,
                    "wall_p50_ms": round(statistics.median(done), 3),
                    "wall_p99_ms": round(done[min(len(done) - 1, int(len(done) * 0.99))], 3),
                    "cpu_ms": round(cpu[arm] / len(done) * 1000, 3),
                    "nats_cpu_ms": round(nats[arm] / len(done) * 1000, 3),
                    "other_cores": round(other, 3),
                }
                out.append(row)
                log(f"chain {n} turns, cache {arm}: {row}")
    finally:
        for nc in conns:
            await nc.close()
        await server.stop()
    return out


def render_chain(d: dict[str, Any]) -> str:
    rows = [
        [
            str(r["turns"]),
            r.get("cache", "off"),
            str(r["items"]),
            f"{r['input_bytes']:,}",
            f"{r['wall_p50_ms']:.3f}",
            f"{r['wall_p99_ms']:.3f}",
            f"{r['cpu_ms']:.3f}",
            f"{r['nats_cpu_ms']:.3f}",
            f"{r['other_cores']:.2f}",
        ]
        for r in d["lengths"]
    ]
    head = [
        "turns",
        "cache",
        "items",
        "input bytes",
        "wall p50 ms",
        "wall p99 ms",
        "CPU ms",
        "nats CPU ms",
        "other cores",
    ]
    out = (
        f"Stored-state expansion: `previous_response_id` at the end of a chain, {d['expansions']} expansions "
        "one at a time per arm, the arms alternating (this process's CPU and the nats-server's, per expansion; "
        "cache warm: this edge wrote the turns, cold: another edge did, off: cache_mb 0)\n" + table(head, rows)
    )
    return out  # its target is judged with the others (bench/report.py targets())
