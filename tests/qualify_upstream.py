"""A fake OpenAI chat server with limited parallel compute, for `iop qualify`'s tests.

Up to `parallel` requests decode at full speed; beyond that they share the compute (processor
sharing), so the aggregate decode rate plateaus past `parallel` concurrent requests, as a real
server's does once its batch is full. Time to first token grows with the prompt. It answers the
qualification probes the way a good model would, unless a `flaw` says otherwise.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from iop.qualify.probes import number_words

Flaw = Literal["", "bad_tool_call", "no_stream_usage", "ignores_max_tokens"]
_NUMBERS = {number_words(n): n for n in range(101, 1000)}
CATCH_UP_S = 0.5
"""The most lateness of the loop a request's clock makes up for."""


@dataclass
class _Pace:
    """One request's compute clock: when its work so far is due to be done."""

    due: float = field(default_factory=time.monotonic)


@dataclass
class LimitedUpstream:
    parallel: int
    """K: requests that decode at full speed at once."""
    token_s: float = 0.004
    """Decode time of one token while at most `parallel` run."""
    prefill_s_per_word: float = 0.00005
    tokens_per_chunk: int = 2
    context_words: int = 20_000
    flaw: Flaw = ""
    tag: str = ""
    """Requests whose last message holds this tag are counted in `tagged` (user traffic in tests)."""
    active: int = 0
    peak_active: int = 0
    requests: int = 0
    tagged: int = 0
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def _share(self) -> float:
        return max(1.0, self.active / self.parallel)

    async def _compute(self, seconds: float, pace: _Pace) -> None:
        # Processor sharing: past `parallel` each request gets parallel/active of the compute. The
        # work ends at a time on the request's own clock, so a wake-up that the test machine's loop
        # delays is counted as work done instead of adding up chunk after chunk: the fake's rate is
        # its model's, not the load of the machine running it.
        now = time.monotonic()
        pace.due = max(pace.due, now - CATCH_UP_S) + seconds * self._share()
        await asyncio.sleep(max(0.0, pace.due - now))  # simulated work: the fake's model of a GPU

    def _answer(self, body: dict[str, Any]) -> tuple[str, str, list[str]]:
        """(text, finish reason, tokens) for a chat request, honouring max_tokens and stop unless flawed."""
        prompt = str((body.get("messages") or [{}])[-1].get("content") or "")
        limit = body.get("max_tokens") or body.get("max_completion_tokens") or 64
        if m := re.search(r"Write exactly this and nothing else: (.*)$", prompt):
            words = m.group(1).split()
        elif "Count from 1 to" in prompt:
            words = [str(i) for i in range(1, 301)]
        elif m := re.search(r"Write the number (.*) as digits only", prompt):
            words = [str(_NUMBERS.get(m.group(1), 0))]
        elif "Reply with one word" in prompt:
            words = ["ready"]
        elif "response_format" in body:
            words = ['{"name":', '"Alice",', '"age":', "31}"]
        elif "Continue this list" in prompt:  # the sweep's prompts: as long as max_tokens allows
            words = [f"w{i}" for i in range(10_000)]
        else:
            words = ["no,", "it", "is", "7", "x", "13."]
        cap = max(limit, 40) if self.flaw == "ignores_max_tokens" else limit
        finish = "length" if len(words) > cap else "stop"
        words = words[:cap]
        text = " ".join(words)
        for stop in body.get("stop") or []:
            if stop in text:
                text, finish = text[: text.index(stop)], "stop"
                words = text.split()
        return text, finish, words

    def _tool_args(self) -> str:
        if self.flaw == "bad_tool_call":
            return '{"city": "Paris", "unit": '
        return '{"city": "Paris", "unit": "celsius"}'

    def app(self) -> Starlette:
        async def chat(request: Request) -> Response:
            body = await request.json()
            prompt_words = sum(len(str(m.get("content") or "").split()) for m in body.get("messages") or [])
            if prompt_words > self.context_words:
                err = {"message": f"prompt of {prompt_words} tokens exceeds the context of {self.context_words}"}
                return JSONResponse({"error": {**err, "type": "invalid_request_error", "code": None}}, 400)
            self.requests += 1
            if self.tag and self.tag in str((body.get("messages") or [{}])[-1].get("content")):
                self.tagged += 1
            if body.get("stream"):
                return StreamingResponse(self._stream(body, prompt_words), media_type="text/event-stream")
            self._enter()
            pace = _Pace()
            try:
                await self._compute(prompt_words * self.prefill_s_per_word, pace)
                if body.get("tools"):
                    call = {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": self._tool_args()},
                    }
                    message: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": [call]}
                    finish, n = "tool_calls", 12
                else:
                    text, finish, words = self._answer(body)
                    await self._compute(len(words) * self.token_s, pace)
                    message, n = {"role": "assistant", "content": text}, len(words)
            finally:
                self._leave()
            return JSONResponse(
                {
                    "id": "chatcmpl-q",
                    "object": "chat.completion",
                    "created": int(time.time()),
                    "model": body.get("model"),
                    "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                    "usage": {"prompt_tokens": prompt_words, "completion_tokens": n, "total_tokens": prompt_words + n},
                }
            )

        return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])

    def _enter(self) -> None:
        self.active += 1
        self.peak_active = max(self.peak_active, self.active)
        self.changed.set()

    def _leave(self) -> None:
        self.active -= 1
        self.changed.set()

    async def _stream(self, body: dict[str, Any], prompt_words: int) -> AsyncIterator[bytes]:
        base = {
            "id": "chatcmpl-q",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": body.get("model"),
        }

        def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
            data = {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
            return b"data: " + json.dumps(data).encode() + b"\n\n"

        self._enter()
        pace = _Pace()
        try:
            await self._compute(prompt_words * self.prefill_s_per_word, pace)
            yield chunk({"role": "assistant", "content": ""})
            if body.get("tools"):
                call = {
                    "index": 0,
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": self._tool_args()},
                }
                yield chunk({"tool_calls": [call]})
                finish, n = "tool_calls", 12
            else:
                _, finish, words = self._answer(body)
                n = len(words)
                step = self.tokens_per_chunk
                for i in range(0, n, step):
                    piece = words[i : i + step]
                    await self._compute(len(piece) * self.token_s, pace)
                    yield chunk({"content": ("" if i == 0 else " ") + " ".join(piece)})
            yield chunk({}, finish)
            if (body.get("stream_options") or {}).get("include_usage") and self.flaw != "no_stream_usage":
                usage = {"prompt_tokens": prompt_words, "completion_tokens": n, "total_tokens": prompt_words + n}
                yield b"data: " + json.dumps({**base, "choices": [], "usage": usage}).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"
        finally:
            self._leave()
