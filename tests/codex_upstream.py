"""A chat-only model server that answers from a script (the outside world in the Codex CLI tests).

Each request takes the next `Turn`: optional reasoning, text and tool calls, streamed the way vLLM
and llama.cpp stream them (`reasoning_content` deltas, arguments in pieces, the usage chunk when
asked). Every request body is recorded, so a test can assert what reached the model server.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tests.fakes import serve_asgi


@dataclass
class Call:
    """A tool call the scripted model makes: the chat function name and its JSON arguments."""

    name: str
    arguments: dict[str, Any] | str
    call_id: str = ""


@dataclass
class Turn:
    text: str = ""
    reasoning: str = ""
    calls: list[Call] = field(default_factory=list)
    usage: tuple[int, int] = (11, 7)


Script = list[Turn] | Callable[[dict[str, Any]], Turn]


@dataclass
class ScriptedChat:
    """Serves only /v1/chat/completions; answers request k with `script[k]` (or `script(body)`)."""

    script: Script
    bodies: list[dict[str, Any]] = field(default_factory=list)
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    url: str = ""

    def turn(self, body: dict[str, Any]) -> Turn | None:
        if callable(self.script):
            return self.script(body)
        index = len(self.bodies) - 1
        return self.script[index] if index < len(self.script) else None

    async def wait_for(self, predicate: Callable[[ScriptedChat], bool], timeout_s: float = 30.0) -> None:
        async with asyncio.timeout(timeout_s), self.changed:
            await self.changed.wait_for(lambda: predicate(self))

    def app(self) -> Starlette:
        async def chat(request: Request) -> Response:
            body = json.loads(await request.body())
            self.bodies.append(body)
            async with self.changed:
                self.changed.notify_all()
            turn = self.turn(body)
            if turn is None:
                err = {"error": {"message": f"the script has no turn {len(self.bodies)}", "type": "script_ended"}}
                return JSONResponse(err, 500)
            if body.get("stream"):
                return StreamingResponse(_stream(body, turn), media_type="text/event-stream")
            return JSONResponse(_whole(body, turn))

        async def elsewhere(request: Request) -> Response:
            return JSONResponse({"error": {"message": "a chat-only server", "type": "not_found"}}, 404)

        return Starlette(
            routes=[
                Route("/v1/chat/completions", chat, methods=["POST"]),
                Route("/v1/{rest:path}", elsewhere, methods=["GET", "POST"]),
            ]
        )


def _call_id(turn: Turn, i: int, call: Call) -> str:
    return call.call_id or f"call_script_{id(turn) % 10_000}_{i}"


def _arguments(call: Call) -> str:
    return call.arguments if isinstance(call.arguments, str) else json.dumps(call.arguments)


def _usage(turn: Turn) -> dict[str, int]:
    prompt, completion = turn.usage
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _whole(body: dict[str, Any], turn: Turn) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": turn.text or None}
    if turn.reasoning:
        message["reasoning_content"] = turn.reasoning
    if turn.calls:
        message["tool_calls"] = [
            {"id": _call_id(turn, i, c), "type": "function", "function": {"name": c.name, "arguments": _arguments(c)}}
            for i, c in enumerate(turn.calls)
        ]
    return {
        "id": "chatcmpl-script",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body.get("model"),
        "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls" if turn.calls else "stop"}],
        "usage": _usage(turn),
    }


def _halves(text: str) -> list[str]:
    middle = len(text) // 2
    return [piece for piece in (text[:middle], text[middle:]) if piece]


async def _stream(body: dict[str, Any], turn: Turn) -> AsyncIterator[bytes]:
    base = {"id": "chatcmpl-script", "object": "chat.completion.chunk", "created": int(time.time())}
    base["model"] = body.get("model")

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        data = {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
        return b"data: " + json.dumps(data).encode() + b"\n\n"

    yield chunk({"role": "assistant", "content": ""})
    for piece in _halves(turn.reasoning):
        yield chunk({"reasoning_content": piece})
    for piece in _halves(turn.text):
        yield chunk({"content": piece})
    for i, call in enumerate(turn.calls):
        head = {"index": i, "id": _call_id(turn, i, call), "type": "function"}
        yield chunk({"tool_calls": [{**head, "function": {"name": call.name, "arguments": ""}}]})
        for piece in _halves(_arguments(call)):
            yield chunk({"tool_calls": [{"index": i, "function": {"arguments": piece}}]})
    yield chunk({}, "tool_calls" if turn.calls else "stop")
    if (body.get("stream_options") or {}).get("include_usage"):
        yield b"data: " + json.dumps({**base, "choices": [], "usage": _usage(turn)}).encode() + b"\n\n"
    yield b"data: [DONE]\n\n"


@asynccontextmanager
async def scripted_chat(script: Script) -> AsyncIterator[ScriptedChat]:
    up = ScriptedChat(script)
    async with serve_asgi(up.app()) as url:
        up.url = url + "/v1"
        yield up
