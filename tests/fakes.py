"""A fake OpenAI upstream (the outside world in tests): records peak concurrency, can hold or fail."""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import struct
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route


@dataclass
class FakeUpstream:
    """Behaviour knobs and what it saw. `api` is what it serves: "both" (chat and responses), or a
    comma-separated list of chat, responses, messages, embeddings, completions."""

    api: str = "both"
    latency_s: float = 0.0
    tokens: int = 3
    token_interval_s: float = 0.0
    fail_status: int | None = None
    gate: asyncio.Event | None = None
    """When set to an unset Event, every request waits for it before answering."""
    in_flight: int = 0
    peak: int = 0
    total: int = 0
    by_path: dict[str, int] = field(default_factory=dict)
    bodies: list[dict[str, Any]] = field(default_factory=list)
    raw_bodies: list[bytes] = field(default_factory=list)
    """The bytes of each model request's body (chat, Responses and the others), as they arrived."""
    request_ids: list[str | None] = field(default_factory=list)
    """The `x-request-id` header of each request, as the node sent it."""
    traceparents: list[str | None] = field(default_factory=list)
    """The `traceparent` header of each request (a traced request's upstream call)."""
    disconnects: int = 0
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    url: str = ""

    def text(self) -> str:
        return " ".join(f"w{i}" for i in range(self.tokens))

    async def wait_for(self, predicate: Any, timeout_s: float = 10.0) -> None:
        """Wait until `predicate(self)` holds (checked on every change), or fail the test."""
        async with asyncio.timeout(timeout_s), self.changed:
            await self.changed.wait_for(lambda: predicate(self))

    async def _notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    async def _enter(self, path: str, body: dict[str, Any]) -> None:
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        self.total += 1
        self.by_path[path] = self.by_path.get(path, 0) + 1
        self.bodies.append(body)
        await self._notify()

    async def _leave(self) -> None:
        self.in_flight -= 1
        await self._notify()

    async def _hold(self) -> None:
        if self.gate is not None:
            await self.gate.wait()
        if self.latency_s:
            await asyncio.sleep(self.latency_s)  # the simulated model's think time, not test sync

    def app(self) -> Starlette:
        async def handle(request: Request) -> Response:
            path = request.url.path
            kind = path.rsplit("/", 1)[1]
            kind = {"completions": "chat" if path.endswith("/chat/completions") else "completions"}.get(kind, kind)
            served = self.serves() | ({"compact"} if "responses" in self.serves() else set())
            if kind not in served:
                return JSONResponse({"error": {"message": "not found", "type": "not_found"}}, 404)
            raw = await request.body()
            self.raw_bodies.append(raw)
            body = json.loads(raw)
            self.request_ids.append(request.headers.get("x-request-id"))
            self.traceparents.append(request.headers.get("traceparent"))
            await self._enter(path, body)
            try:
                await self._hold()
                if self.fail_status is not None:
                    err = {"error": {"message": f"fake upstream fails with {self.fail_status}", "type": "x"}}
                    return JSONResponse(err, self.fail_status)
                if kind not in ("chat", "responses"):
                    return self._other(kind, body)
                if body.get("stream"):
                    gen = self._chat_stream(body) if kind == "chat" else self._responses_stream(body)
                    return StreamingResponse(self._tracked(gen), media_type="text/event-stream")
                data = self._chat_body(body) if kind == "chat" else self._responses_body(body)
                return JSONResponse(data)
            finally:
                if not body.get("stream") or self.fail_status is not None:
                    await self._leave()

        return Starlette(
            routes=[
                Route("/v1/chat/completions", handle, methods=["POST"]),
                Route("/v1/responses", handle, methods=["POST"]),
                Route("/v1/responses/compact", handle, methods=["POST"]),
                Route("/v1/messages", handle, methods=["POST"]),
                Route("/v1/embeddings", handle, methods=["POST"]),
                Route("/v1/completions", handle, methods=["POST"]),
                Route("/tokenize", self._tokenize, methods=["POST"]),
                Route("/apply-template", self._apply_template, methods=["POST"]),
            ]
        )

    async def _tokenize(self, request: Request) -> Response:
        """vLLM's /tokenize (chat messages; a token per word of every message) or llama.cpp's (`content`)."""
        body = json.loads(await request.body())
        await self._enter("/tokenize", body)
        await self._leave()
        if "content" in body:
            return JSONResponse({"tokens": list(range(len(body["content"].split())))})
        words = sum(len(str(m.get("content") or "").split()) for m in body["messages"])
        return JSONResponse({"count": words, "max_model_len": 4096, "tokens": list(range(words))})

    async def _apply_template(self, request: Request) -> Response:
        """llama.cpp's /apply-template: the messages as one prompt (a `<turn>` word per message)."""
        body = json.loads(await request.body())
        await self._enter("/apply-template", body)
        await self._leave()
        return JSONResponse({"prompt": " ".join(f"<turn> {m.get('content') or ''}" for m in body["messages"])})

    def serves(self) -> set[str]:
        return {"chat", "responses"} if self.api == "both" else set(self.api.split(","))

    def _other(self, kind: str, body: dict[str, Any]) -> Response:
        if kind == "embeddings":
            data = embeddings_answer(body)
            return JSONResponse(data)
        if kind == "compact":
            # OpenAI's answer: the window's user messages and one compaction item only it can read.
            item = {"type": "compaction", "id": "cmp_upstream", "encrypted_content": "upstream-sealed"}
            usage = {"input_tokens": 5, "output_tokens": 2, "total_tokens": 7}
            return JSONResponse({"id": "resp_c", "object": "response.compaction", "output": [item], "usage": usage})
        if kind == "completions":
            if body.get("stream"):
                return StreamingResponse(self._tracked(self._completions_stream(body)), media_type="text/event-stream")
            return JSONResponse(self._completion(body))
        if body.get("stream"):
            return StreamingResponse(self._tracked(self._messages_stream(body)), media_type="text/event-stream")
        return JSONResponse(self._message(body))

    def completion_text(self, body: dict[str, Any]) -> str:
        """The fake's completion: its words, then the `suffix` it was given (so a test sees it arrived)."""
        suffix = body.get("suffix")
        return self.text() + (f" <fim {suffix}>" if suffix else "")

    def _completion(self, body: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": "cmpl-fake",
            "object": "text_completion",
            "created": int(time.time()),
            "model": body.get("model"),
            "choices": [{"index": 0, "text": self.completion_text(body), "finish_reason": "stop", "logprobs": None}],
            "usage": {"prompt_tokens": 4, "completion_tokens": self.tokens, "total_tokens": 4 + self.tokens},
        }

    async def _completions_stream(self, body: dict[str, Any]) -> AsyncIterator[bytes]:
        base = {"id": "cmpl-fake", "object": "text_completion", "created": int(time.time()), "model": body.get("model")}
        for piece in self.completion_text(body).split(" "):
            chunk = {**base, "choices": [{"index": 0, "text": piece + " ", "finish_reason": None, "logprobs": None}]}
            yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
        last = {**base, "choices": [{"index": 0, "text": "", "finish_reason": "stop", "logprobs": None}]}
        yield b"data: " + json.dumps(last).encode() + b"\n\n"
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": 4, "completion_tokens": self.tokens, "total_tokens": 4 + self.tokens}
            yield b"data: " + json.dumps({**base, "choices": [], "usage": usage}).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"

    def _message(self, body: dict[str, Any]) -> dict[str, Any]:
        """A Messages answer of an upstream that serves Messages itself (its id says so: msg_native)."""
        return {
            "id": "msg_native",
            "type": "message",
            "role": "assistant",
            "model": body.get("model"),
            "content": [{"type": "text", "text": self.text()}],
            "stop_reason": "end_turn",
            "stop_sequence": None,
            "usage": {"input_tokens": 6, "output_tokens": self.tokens},
        }

    async def _messages_stream(self, body: dict[str, Any]) -> AsyncIterator[bytes]:
        def ev(kind: str, **data: Any) -> bytes:
            return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n".encode()

        start = {
            **self._message(body),
            "content": [],
            "stop_reason": None,
            "usage": {"input_tokens": 6, "output_tokens": 0},
        }
        yield ev("message_start", message=start)
        yield ev("content_block_start", index=0, content_block={"type": "text", "text": ""})
        for i in range(self.tokens):
            piece = ("" if i == 0 else " ") + f"w{i}"
            yield ev("content_block_delta", index=0, delta={"type": "text_delta", "text": piece})
        yield ev("content_block_stop", index=0)
        yield ev(
            "message_delta",
            delta={"stop_reason": "end_turn", "stop_sequence": None},
            usage={"output_tokens": self.tokens},
        )
        yield ev("message_stop")

    async def _tracked(self, gen: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        try:
            async for piece in gen:
                yield piece
        except (asyncio.CancelledError, GeneratorExit):
            self.disconnects += 1
            raise
        finally:
            await self._leave()

    @staticmethod
    def wants_tool(body: dict[str, Any]) -> bool:
        """A model that calls the first tool offered, then answers once the tool's output is in."""
        msgs = body.get("messages") or []
        return bool(body.get("tools")) and not any(m.get("role") == "tool" for m in msgs)

    def _tool_call(self, body: dict[str, Any]) -> dict[str, Any]:
        name = body["tools"][0]["function"]["name"]
        return {"id": "call_fake1", "type": "function", "function": {"name": name, "arguments": '{"city": "Paris"}'}}

    def _chat_body(self, body: dict[str, Any]) -> dict[str, Any]:
        if self.wants_tool(body):
            message: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": [self._tool_call(body)]}
            return {
                "id": "chatcmpl-fake",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": body.get("model"),
                "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls"}],
                "usage": {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12},
            }
        return {
            "id": "chatcmpl-fake",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model"),
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": self.text()}, "finish_reason": "stop"}
            ],
            "usage": {"prompt_tokens": 5, "completion_tokens": self.tokens, "total_tokens": 5 + self.tokens},
        }

    async def _chat_stream(self, body: dict[str, Any]) -> AsyncIterator[bytes]:
        base = {
            "id": "chatcmpl-fake",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": body.get("model"),
        }
        first = {
            **base,
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
        }
        yield b"data: " + json.dumps(first).encode() + b"\n\n"
        if self.wants_tool(body):
            call = self._tool_call(body)
            head = {
                "index": 0,
                "id": call["id"],
                "type": "function",
                "function": {"name": call["function"]["name"], "arguments": ""},
            }
            for delta in (
                {"tool_calls": [head]},
                {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]},
                {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]},
            ):
                chunk = {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
                yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
            last = {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}
            yield b"data: " + json.dumps(last).encode() + b"\n\n"
            if (body.get("stream_options") or {}).get("include_usage"):
                usage: dict[str, Any] = {
                    **base,
                    "choices": [],
                    "usage": {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12},
                }
                yield b"data: " + json.dumps(usage).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"
            return
        for i in range(self.tokens):
            if self.token_interval_s:
                await asyncio.sleep(self.token_interval_s)
            piece = ("" if i == 0 else " ") + f"w{i}"
            chunk = {**base, "choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]}
            yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
        last = {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
        yield b"data: " + json.dumps(last).encode() + b"\n\n"
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {
                **base,
                "choices": [],
                "usage": {"prompt_tokens": 5, "completion_tokens": self.tokens, "total_tokens": 5 + self.tokens},
            }
            yield b"data: " + json.dumps(usage).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"

    def _response_obj(self, body: dict[str, Any], status: str, text: str | None, n: int = 0) -> dict[str, Any]:
        """A response object; `n` tells this request's ids from others' (ids are unique, as a store needs)."""
        output = []
        if text is not None:
            output = [
                {
                    "id": f"msg_fake{n}",
                    "type": "message",
                    "status": "completed",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": text, "annotations": []}],
                }
            ]
        return {
            "id": f"resp_fake{n}",
            "object": "response",
            "created_at": int(time.time()),
            "status": status,
            "model": body.get("model"),
            "output": output,
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
            "error": None,
            "incomplete_details": None,
            "instructions": None,
            "metadata": {},
            "temperature": None,
            "top_p": None,
            "usage": {
                "input_tokens": 5,
                "output_tokens": self.tokens,
                "total_tokens": 5 + self.tokens,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens_details": {"reasoning_tokens": 0},
            }
            if text is not None
            else None,
        }

    def _responses_body(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._response_obj(body, "completed", self.text(), self.total)

    async def _responses_stream(self, body: dict[str, Any]) -> AsyncIterator[bytes]:
        seq = 0

        def ev(kind: str, **data: Any) -> bytes:
            nonlocal seq
            payload = {"type": kind, "sequence_number": seq, **data}
            seq += 1
            return f"event: {kind}\ndata: {json.dumps(payload)}\n\n".encode()

        n = self.total
        yield ev("response.created", response=self._response_obj(body, "in_progress", None, n))
        item = {"id": f"msg_fake{n}", "type": "message", "status": "in_progress", "role": "assistant", "content": []}
        yield ev("response.output_item.added", output_index=0, item=item)
        part = {"type": "output_text", "text": "", "annotations": []}
        yield ev("response.content_part.added", item_id=f"msg_fake{n}", output_index=0, content_index=0, part=part)
        for i in range(self.tokens):
            if self.token_interval_s:
                await asyncio.sleep(self.token_interval_s)
            piece = ("" if i == 0 else " ") + f"w{i}"
            yield ev(
                "response.output_text.delta",
                item_id=f"msg_fake{n}",
                output_index=0,
                content_index=0,
                delta=piece,
                logprobs=[],
            )
        yield ev("response.completed", response=self._response_obj(body, "completed", self.text(), n))


def embeddings_answer(body: dict[str, Any]) -> dict[str, Any]:
    """One 3-number vector per input, and a prompt token per word of every input (batches add up)."""
    inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
    if inputs and isinstance(inputs[0], int):
        inputs = [inputs]  # one input given as token ids
    data = []
    tokens = 0
    for i, item in enumerate(inputs):
        n = len(item) if isinstance(item, list) else len(item.split())
        tokens += n
        vector = [float(i), float(n), 0.5]
        embedding: Any = vector
        if body.get("encoding_format") == "base64":
            embedding = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
        data.append({"object": "embedding", "index": i, "embedding": embedding})
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    return {"object": "list", "data": data, "model": body.get("model"), "usage": usage}


def bound_socket() -> socket.socket:
    """A listening loopback socket on a port the OS picks: its URL is known before the server runs.

    Made with proto IPPROTO_TCP, as `iop edge` makes its own (iop.edge.http.bind): asyncio's loop,
    the one tests run on, turns Nagle's algorithm off only on such sockets' connections. A bare
    socket.socket() kept it on, and every fake and in-test edge held a streamed answer's next small
    write for the client's delayed ACK (~40 ms), unlike a real server.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    return sock


@asynccontextmanager
async def serve_asgi(app: Any) -> AsyncIterator[str]:
    """Serve an ASGI app with real uvicorn on loopback; yields its base URL.

    The socket is bound before uvicorn starts, so clients may connect at once (the kernel queues
    them) and nothing needs to wait for start-up.
    """
    sock = bound_socket()
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="error", access_log=False, lifespan="off", timeout_graceful_shutdown=1)
    )
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task
        sock.close()


@asynccontextmanager
async def fake_upstream(**knobs: Any) -> AsyncIterator[FakeUpstream]:
    up = FakeUpstream(**knobs)
    async with serve_asgi(up.app()) as url:
        up.url = url + "/v1"
        yield up
