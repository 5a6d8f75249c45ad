"""Scenario: stored-state expansion of a long `previous_response_id` chain (issue 30: 50 turns ≤ 1 ms).

In this process, as bench/fairness.py measures admission: a nats-server of its own (file store),
the edge's own `ResponseStore` and `Responses`. Chains of 1, 10 and 50 agent-like turns are built
as the edge builds them (`Responses.expand`, then `Responses.keep` with the answer): each turn a
user message or a function_call_output of 1-2 KB of source code, its answer a function_call and a
short message. At the end of each chain the next turn's expansion is timed, one at a time:

    wall          p50 / p99 of `Responses.expand(previous_response_id=last)` (ms)
    cpu           this process's CPU per expansion (time.process_time), ms
    nats          the nats-server's CPU per expansion (its /proc stat), ms
    bytes         the expanded input, encoded

and the CPU of everything else on the machine beside it.
"""

from __future__ import annotations

import asyncio
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
from iop import config
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
    rows = asyncio.run(_measure(workdir / "chain-nats", opts))
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


async def _measure(store_dir: Path, opts: ChainOptions) -> list[dict[str, Any]]:
    server = EmbeddedNats("127.0.0.1:0", store_dir)
    await server.start()
    out: list[dict[str, Any]] = []
    try:
        nc = await connection.connect(server.url, "bench-chain")
        settings = config.ResponsesSettings()
        responses = Responses(await ResponseStore.open(nc, settings))
        owner = owner_of(b"sk-bench-chain")
        pid = server.pid
        assert pid is not None
        for n in opts.lengths:
            last = await _build(responses, owner, n, n)
            rng = random.Random(10_000 + n)
            body = {"model": MODEL, "previous_response_id": last, "input": _turn_input(rng, n)}
            turn = await responses.expand(body, owner)  # once unmeasured: the same bytes every time
            size = len(msgspec.json.encode(turn.body["input"]))
            items = len(turn.body["input"])
            walls: list[float] = []
            ticks0, t_wall0 = machine_ticks(), time.monotonic()
            nats0, cpu0 = cpu_s(pid), time.process_time()
            for _ in range(opts.expansions):
                t0 = time.perf_counter()
                await responses.expand(body, owner)
                walls.append((time.perf_counter() - t0) * 1000)
            cpu, nats = time.process_time() - cpu0, cpu_s(pid) - nats0
            wall = max(1e-9, time.monotonic() - t_wall0)
            other = max(0.0, busy_cores(ticks0, machine_ticks()) - (cpu + nats) / wall)
            walls.sort()
            row = {
                "turns": n,
                "items": items,
                "input_bytes": size,
                "wall_p50_ms": round(statistics.median(walls), 3),
                "wall_p99_ms": round(walls[min(len(walls) - 1, int(len(walls) * 0.99))], 3),
                "cpu_ms": round(cpu / opts.expansions * 1000, 3),
                "nats_cpu_ms": round(nats / opts.expansions * 1000, 3),
                "other_cores": round(other, 3),
            }
            out.append(row)
            log(f"chain {n} turns: {row}")
        await nc.close()
    finally:
        await server.stop()
    return out


def render_chain(d: dict[str, Any]) -> str:
    rows = [
        [
            str(r["turns"]),
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
    head = ["turns", "items", "input bytes", "wall p50 ms", "wall p99 ms", "CPU ms", "nats CPU ms", "other cores"]
    out = (
        f"Stored-state expansion: `previous_response_id` at the end of a chain, {d['expansions']} expansions "
        "one at a time (this process's CPU and the nats-server's, per expansion)\n" + table(head, rows)
    )
    return out  # its target is judged with the others (bench/report.py targets())
