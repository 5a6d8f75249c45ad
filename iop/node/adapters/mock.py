"""The mock adapter: a simulated model with fixed latency and deterministic text, for smoke and tests."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec

from iop import config, wire
from iop.node.adapters.base import Send, writes
from iop.openai.answer import Usage, answer_writer

_WORDS = ("iop", "mock", "model", "answers", "with", "deterministic", "text")
_decode = msgspec.json.Decoder().decode


class MockAdapter:
    """Waits `latency_ms`, then emits `tokens` words `token_interval_ms` apart."""

    def __init__(self, cfg: config.MockAdapter) -> None:
        self.cfg = cfg

    async def run(self, item: wire.WorkItem, model: str | None, send: Send) -> wire.Usage | None:
        request: dict[str, Any] = _decode(item.body)
        name = model or item.alias
        writer = answer_writer(writes(item.api), item.stream, name, request)
        interval = self.cfg.token_interval_ms / 1000.0
        n = self.cfg.tokens
        usage = Usage(input_tokens=max(1, len(item.body) // 4), output_tokens=n)
        if self.cfg.latency_ms:
            await asyncio.sleep(self.cfg.latency_ms / 1000.0)
        if item.stream:
            await send(writer.start())
        for i in range(n):
            if i and interval:
                await asyncio.sleep(interval)
            piece = writer.delta(mock_token(i))
            if item.stream:
                await send(piece)
        await send(writer.finish(usage))
        return usage

    async def close(self) -> None:
        return None


def mock_token(i: int) -> str:
    """The i-th token of every mock answer (tests rebuild the expected text from this)."""
    return ("" if i == 0 else " ") + _WORDS[i % len(_WORDS)]
