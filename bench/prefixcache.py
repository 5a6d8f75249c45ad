"""A fake OpenAI chat upstream that simulates a model server's prefix cache, one cache per port.

    python -m bench.prefixcache --port 18000 [--port 18001 ...] [--cache-tokens 96000]
        [--prefill-us-per-token 20] [--decode-ms 16]

Each port is one provider (one model server) with its own cache of bounded size, counted in
tokens (a message is len(content) / 4 + 4 tokens). A request's prompt is its chat `messages`; the
cache holds prompts as chains of message blocks, least recently used evicted first, as vLLM's and
llama.cpp's prefix caches do. The time to the first token is proportional to the part of the prompt
not in the cache (`--prefill-us-per-token` each); the rest of the answer follows `--decode-ms` later.
The answer is streamed (SSE, chunked) or whole, and reports `prompt_tokens_details.cached_tokens`.

    GET  /stats    per port: requests, follow_ups (a turn after the first), warm (a follow-up whose
                   whole previous turn was still cached), prompt_tokens, cached_tokens
    POST /reset    empty every cache and zero the counters

Loopback only; standard library asyncio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any


def tokens_of(message: dict[str, Any]) -> int:
    content = message.get("content")
    return (len(content) if isinstance(content, str) else 0) // 4 + 4


@dataclass
class PrefixCache:
    """One model server's cache: prompt prefixes as chains of message blocks, LRU, bounded in tokens."""

    capacity: int
    blocks: OrderedDict[int, int] = field(default_factory=OrderedDict)
    """Chain hash of a prefix ending in a message → that message's tokens."""
    used: int = 0
    requests: int = 0
    follow_ups: int = 0
    warm: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0

    def serve(self, messages: list[dict[str, Any]]) -> tuple[int, int]:
        """(prompt tokens, cached tokens) of this prompt; the prompt is cached afterwards."""
        chain: list[tuple[int, int]] = []
        h = 0
        for m in messages:
            h = hash((h, str(m.get("role")), str(m.get("content"))))
            chain.append((h, tokens_of(m)))
        cached = hit_blocks = 0
        for key, toks in chain:
            if key not in self.blocks:
                break
            self.blocks.move_to_end(key)
            cached += toks
            hit_blocks += 1
        for key, toks in chain[hit_blocks:]:
            self.blocks[key] = toks
            self.used += toks
        while self.used > self.capacity and self.blocks:
            self.used -= self.blocks.popitem(last=False)[1]
        prompt = sum(t for _, t in chain)
        self.requests += 1
        self.prompt_tokens += prompt
        self.cached_tokens += cached
        if len(chain) >= 3:
            # A later turn: its prompt is the previous turn's, plus that turn's answer and a new message.
            self.follow_ups += 1
            self.warm += hit_blocks >= len(chain) - 2
        return prompt, cached

    def stats(self) -> dict[str, int]:
        return {
            "requests": self.requests,
            "follow_ups": self.follow_ups,
            "warm": self.warm,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "cache_used_tokens": self.used,
        }


@dataclass
class Settings:
    cache_tokens: int
    prefill_s_per_token: float
    decode_s: float
    caches: dict[int, PrefixCache]


ANSWER = "Done: the change compiles and the tests pass."


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def _answer(settings: Settings, cache: PrefixCache, req: dict[str, Any], writer: asyncio.StreamWriter) -> None:
    messages = req.get("messages") or []
    prompt, cached = cache.serve(messages)
    usage = {
        "prompt_tokens": prompt,
        "completion_tokens": 12,
        "total_tokens": prompt + 12,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    await asyncio.sleep((prompt - cached) * settings.prefill_s_per_token)
    model = str(req.get("model") or "fake-model")
    if req.get("stream") is not True:
        await asyncio.sleep(settings.decode_s)
        body = json.dumps(
            {
                "id": "chatcmpl-pc",
                "object": "chat.completion",
                "created": 1_700_000_000,
                "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": ANSWER}, "finish_reason": "stop"}],
                "usage": usage,
            }
        ).encode()
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body))
        writer.write(body)
        return
    head = {"id": "chatcmpl-pc", "object": "chat.completion.chunk", "created": 1_700_000_000, "model": model}
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
    first = {
        **head,
        "choices": [{"index": 0, "delta": {"role": "assistant", "content": "Done:"}, "finish_reason": None}],
    }
    writer.write(_chunk(_event(first)))
    await writer.drain()
    await asyncio.sleep(settings.decode_s)
    rest = {**head, "choices": [{"index": 0, "delta": {"content": ANSWER[5:]}, "finish_reason": None}]}
    end = {**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
    tail = _event(rest) + _event(end)
    if (req.get("stream_options") or {}).get("include_usage"):
        tail += _event({**head, "choices": [], "usage": usage})
    writer.write(_chunk(tail + b"data: [DONE]\n\n") + b"0\r\n\r\n")


def _json(obj: Any) -> bytes:
    body = json.dumps(obj).encode()
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)


async def _connection(
    settings: Settings, port: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            length = 0
            for line in lines[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            body = await reader.readexactly(length) if length else b""
            if method == "POST" and path.endswith("/chat/completions"):
                await _answer(settings, settings.caches[port], json.loads(body), writer)
            elif method == "GET" and path == "/stats":
                writer.write(_json({str(p): c.stats() for p, c in settings.caches.items()}))
            elif method == "POST" and path == "/reset":
                for p in settings.caches:
                    settings.caches[p] = PrefixCache(settings.cache_tokens)
                writer.write(_json({"reset": True}))
            else:
                writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def serve(host: str, ports: list[int], settings: Settings) -> None:
    servers = []
    for port in ports:

        async def on_connect(r: asyncio.StreamReader, w: asyncio.StreamWriter, port: int = port) -> None:
            await _connection(settings, port, r, w)

        servers.append(await asyncio.start_server(on_connect, host, port, reuse_address=True))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(json.dumps({"prefixcache": "ready", "ports": ports}), flush=True)
    await stop.wait()
    for srv in servers:
        srv.close()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, action="append", required=True, help="one port per provider")
    ap.add_argument("--cache-tokens", type=int, default=96_000, help="each provider's cache size in tokens")
    ap.add_argument("--prefill-us-per-token", type=float, default=20.0)
    ap.add_argument("--decode-ms", type=float, default=16.0)
    a = ap.parse_args(argv)
    if not (a.host.startswith("127.") or a.host in ("localhost", "::1")):
        sys.exit("prefixcache: refusing to listen beyond loopback")
    settings = Settings(
        cache_tokens=a.cache_tokens,
        prefill_s_per_token=a.prefill_us_per_token / 1e6,
        decode_s=a.decode_ms / 1000,
        caches={p: PrefixCache(a.cache_tokens) for p in a.port},
    )
    asyncio.run(serve(a.host, a.port, settings))


if __name__ == "__main__":
    main()
