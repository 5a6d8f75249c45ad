"""Request bodies shaped like an agent's turn: a long system prompt, tool definitions, a long history.

Agent traffic resends its whole conversation every turn (median ~0.8 MB of JSON, p90 ~2 MB in
Claude Code sessions): a system prompt of a few thousand words, a few dozen tools with JSON
schemas, then user turns, assistant tool calls and tool outputs full of source code. The text is
deterministic (seeded), has the escapes real code has (quotes, newlines, backslashes) and a little
non-ASCII, so parsing and validating it costs what a real turn costs.
"""

from __future__ import annotations

import json
import random
from typing import Any

_WORDS = tuple(
    [
        "the",
        "function",
        "returns",
        "a",
        "value",
        "when",
        "its",
        "argument",
        "is",
        "valid",
        "otherwise",
        "it",
        "raises",
        "an",
        "error",
        "that",
        "names",
        "the",
        "field",
        "read",
        "file",
        "path",
        "line",
        "column",
        "offset",
        "buffer",
        "request",
        "response",
        "stream",
        "token",
        "model",
        "provider",
    ]
)
_CODE = (
    'def handle(self, req: "Request") -> dict[str, Any]:\n'
    '    """Answer one request; raise on a bad one."""\n'
    "    if not req.ok:\n"
    '        raise ValueError(f"bad request: {req.id!r}\\t(état: {req.state})")\n'
    "    return {'id': req.id, \"path\": 'C:\\\\tmp\\\\x'}\n"
)


def prose(rng: random.Random, words: int) -> str:
    """`words` words of a tool's or a user's prose."""
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def code(rng: random.Random, size: int) -> str:
    """`size` characters of source code as a tool's output holds it: quotes, escapes, non-ASCII."""
    out: list[str] = []
    n = 0
    while n < size:
        piece = _CODE.replace("handle", f"handle_{rng.randrange(10_000)}")
        out.append(piece)
        n += len(piece)
    return "".join(out)[:size]


def _schema(rng: random.Random, i: int) -> dict[str, Any]:
    props = {
        f"arg_{j}": {"type": rng.choice(["string", "integer", "boolean"]), "description": prose(rng, 12)}
        for j in range(6)
    }
    return {"type": "object", "properties": props, "required": ["arg_0", "arg_1"]}


def _tools(rng: random.Random, n: int) -> list[tuple[str, str, dict[str, Any]]]:
    return [(f"tool_{i}", prose(rng, 40), _schema(rng, i)) for i in range(n)]


def chat_body(model: str, size: int, stream: bool, seed: int = 7) -> bytes:
    """A chat completion request of about `size` bytes (never less than a minimal turn)."""
    rng = random.Random(seed)
    system = prose(rng, min(3000, max(20, size // 40)))
    tools = [
        {"type": "function", "function": {"name": n, "description": d, "parameters": p}}
        for n, d, p in _tools(rng, 0 if size < 20_000 else 24)
    ]
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    req: dict[str, Any] = {"model": model, "messages": messages, "stream": stream, "max_tokens": 16}
    if tools:
        req["tools"] = tools
    turn, n = 0, len(_dump(req))
    while n < size:
        messages.append({"role": "user", "content": prose(rng, 30)})
        call = f"call_{turn}"
        messages.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": call, "type": "function", "function": {"name": "tool_1", "arguments": '{"arg_0":"x.py"}'}}
                ],
            }
        )
        messages.append({"role": "tool", "tool_call_id": call, "content": code(rng, min(12_000, size // 8 + 64))})
        n += sum(len(_dump(m)) + 1 for m in messages[-3:])
        turn += 1
    messages.append({"role": "user", "content": "Go on."})
    return _dump(req)


def responses_body(model: str, size: int, stream: bool, seed: int = 7, store: bool = False) -> bytes:
    """A Responses request of about `size` bytes: instructions, tools, input items with tool calls."""
    rng = random.Random(seed)
    tools = [
        {"type": "function", "name": n, "description": d, "parameters": p}
        for n, d, p in _tools(rng, 0 if size < 20_000 else 24)
    ]
    items: list[dict[str, Any]] = []
    req: dict[str, Any] = {
        "model": model,
        "instructions": prose(rng, min(3000, max(20, size // 40))),
        "input": items,
        "stream": stream,
        "max_output_tokens": 16,
    }
    if not store:
        req["store"] = False  # as Codex sends; a kept turn leaves `store` out, as the openai SDK does
    if tools:
        req["tools"] = tools
    turn, n = 0, len(_dump(req))
    while n < size:
        items.append({"type": "message", "role": "user", "content": [{"type": "input_text", "text": prose(rng, 30)}]})
        call = f"call_{turn}"
        fc: dict[str, Any] = {"type": "function_call", "call_id": call, "name": "tool_1"}
        fc["arguments"] = '{"arg_0":"x.py"}'
        if store:
            fc["id"] = f"fc_{turn}"  # a client resending its history resends the output items' ids
        items.append(fc)
        output = code(rng, min(12_000, size // 8 + 64))
        items.append({"type": "function_call_output", "call_id": call, "output": output})
        n += sum(len(_dump(i)) + 1 for i in items[-3:])
        turn += 1
    items.append({"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Go on."}]})
    return _dump(req)


def body(api: str, model: str, size: int, stream: bool, store: bool = False) -> bytes:
    """`store`: a Responses request that asks for its turn to be kept (`store: true`)."""
    if api == "chat":
        return chat_body(model, size, stream)
    return responses_body(model, size, stream, store=store)


def _dump(req: dict[str, Any]) -> bytes:
    return json.dumps(req, separators=(",", ":"), ensure_ascii=False).encode()
