"""Scenario `messages`: Anthropic Messages translated over a chat upstream, A/B/C interleaved request by request.

One Claude-Code-like turn (the system prompt in blocks with Claude Code's billing line, tool
definitions with input schemas, a history of text, tool_use and tool_result blocks), 2 KB and
800 KB, whole and streamed, sent three ways, one request at a time (c=1, one keep-alive
connection per arm), the arms' order rotating request by request:

    direct    the chat request iop's translation makes of it, straight to the bench upstream
    chat      that chat request through iop (edge → JetStream → node → upstream)
    messages  the Messages request through iop (`/v1/messages`: the node translates it to chat
              and the chat answer back to Messages)

Added = arm - direct of the same triple; the translation's own cost = messages - chat of the same
triple (p50 and p99 over the triples). CPU of edge, node and nats-server per request of each arm,
read from /proc around every request (what a request leaves the processes to do after its last
byte is charged to the next one, whose arm rotates). Then, in this process, the translation alone:
the request as the node translated it until now (a body that just arrived decoded, translated,
encoded and dropped) and each step repeated alone, the request translated as bytes
(`chat_body_of`: its texts kept as the client's JSON), count_tokens' estimate, the whole
answer, and a stream's events (the bench upstream's text answer, and a tool call in 40 pieces as
Claude Code's turns end).
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from bench import load
from bench.abtest import start_upstream
from bench.fixtures import code, prose
from bench.procs import Owned, busy_cores, cpu_s, free_port, log, machine_ticks
from bench.report import table
from bench.stack import start_stack
from bench.upstream import chat_events, chat_whole
from iop import heap
from iop.anthropic.answer import chat_to_messages_answer
from iop.anthropic.count import estimate_input_tokens
from iop.anthropic.request import chat_body_of, messages_to_chat_request
from iop.anthropic.stream import ChatToMessagesStream

ARMS = ("direct", "chat", "messages")
TOKENS = 16
"""The answer's tokens: the request's max_tokens, which the bench upstream answers with."""
_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode


@dataclass
class MessagesOptions:
    sizes: list[int] = field(default_factory=lambda: [2_000, 800_000])
    modes: list[str] = field(default_factory=lambda: ["whole", "stream"])
    requests: int = 100
    """Triples (direct, chat, messages) measured per cell, after 3 unmeasured ones."""
    storage: str = "file"
    archive: Path | None = None


# --- the turn ---------------------------------------------------------------------------------------


def _tool(rng: random.Random, i: int) -> dict[str, Any]:
    props = {f"arg_{j}": {"type": "string", "description": prose(rng, 12)} for j in range(6)}
    schema = {
        "type": "object",
        "properties": props,
        "required": ["arg_0"],
        "additionalProperties": False,
        "$schema": "http://json-schema.org/draft-07/schema#",
    }
    return {"name": f"tool_{i}", "description": prose(rng, 40), "input_schema": schema}


def turn(model: str, size: int, stream: bool, seed: int = 7) -> dict[str, Any]:
    """A Messages request of about `size` bytes as Claude Code sends one (never less than a minimal turn)."""
    rng = random.Random(seed)
    system = [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.0; cc_entrypoint=cli"},
        {"type": "text", "text": prose(rng, min(3000, max(40, size // 40))), "cache_control": {"type": "ephemeral"}},
    ]
    first = [
        {"type": "text", "text": "<system-reminder>" + prose(rng, 40) + "</system-reminder>"},
        {"type": "text", "text": prose(rng, 20), "cache_control": {"type": "ephemeral"}},
    ]
    req: dict[str, Any] = {
        "model": model,
        "max_tokens": TOKENS,
        "stream": stream,
        "system": system,
        "tools": [_tool(rng, i) for i in range(24 if size >= 20_000 else 1)],
        "metadata": {"user_id": "user_bench_account__session_0b6c1e8e"},
        "messages": [{"role": "user", "content": first}],
    }
    messages = req["messages"]
    t, n = 0, len(_encode(req))
    while n < size:
        call = f"toolu_{t:024d}"
        output = code(rng, min(12_000, max(200, size // 8)))
        # Claude Code sends a tool's output as a string, some tools' as text blocks.
        result: Any = output if t % 2 == 0 else [{"type": "text", "text": output}]
        new = [
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": prose(rng, 20)},
                    {"type": "tool_use", "id": call, "name": "tool_1", "input": {"arg_0": "x.py", "arg_1": t}},
                ],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call, "content": result}]},
        ]
        messages += new
        n += sum(len(_encode(m)) + 1 for m in new)
        t += 1
    messages.append({"role": "user", "content": "Go on."})
    return req


def chat_of(request: dict[str, Any], model: str) -> bytes:
    """The chat body iop's translation makes of `request`, for `model`: what the upstream gets in every arm."""
    return _encode(messages_to_chat_request(request, model).body)


# --- the A/B/C run ----------------------------------------------------------------------------------


def run_messages(owned: Owned, workdir: Path, opts: MessagesOptions) -> dict[str, Any]:
    port = free_port()
    upstream = start_upstream(owned, "messages-upstream", [port], "--tokens", str(TOKENS))
    url = f"http://127.0.0.1:{port}/v1"
    node = {
        "id": "messages-node",
        "adapters": [{"id": "chat", "type": "openai", "base_url": url, "api": "chat"}],
        "providers": [{"id": "chatonly", "adapter": "chat", "model": "fake-model", "capacity": 4}],
    }
    stack = start_stack(
        owned,
        workdir,
        "messages",
        models=[{"alias": "bench-chat", "pool": ["chatonly"]}],
        nodes=[node],
        storage=opts.storage,
        archive=opts.archive,
    )
    edge_port = int(stack.url.rsplit(":", 1)[1])
    procs: dict[str, Callable[[], float]] = {
        "edge": stack.edge.cpu_s,
        "node": lambda: sum(n.cpu_s() for n in stack.nodes),
        "nats": lambda: cpu_s(stack.nats_pid) if stack.nats_pid else 0.0,
    }
    ours = [*procs.values(), upstream.cpu_s, time.process_time]
    cells = []
    try:
        for size in opts.sizes:
            for mode in opts.modes:
                stream = mode == "stream"
                messages = turn("bench-chat", size, stream)
                requests = {
                    "direct": load.request_of(
                        load.Target("127.0.0.1", port, "/v1/chat/completions"), chat_of(messages, "fake-model")
                    ),
                    "chat": load.request_of(
                        load.Target("127.0.0.1", edge_port, "/v1/chat/completions"), chat_of(messages, "bench-chat")
                    ),
                    "messages": load.request_of(load.Target("127.0.0.1", edge_port, "/v1/messages"), _encode(messages)),
                }
                ports = {"direct": port, "chat": edge_port, "messages": edge_port}
                ticks, t0, own0 = machine_ticks(), time.monotonic(), sum(f() for f in ours)
                got = _triples(ports, requests, procs, opts.requests)
                wall = max(1e-9, time.monotonic() - t0)
                other = busy_cores(ticks, machine_ticks()) - (sum(f() for f in ours) - own0) / wall
                cell = _cell(size, mode, len(_encode(messages)), got, max(0.0, other))
                log(
                    f"messages {cell['cell']:<14} direct {cell['p50_ms']['direct']:.2f} added chat"
                    f" {cell['added_p50_ms']['chat']:.2f} messages {cell['added_p50_ms']['messages']:.2f}"
                    f" translation {cell['translation_p50_ms']:.3f} ms; node CPU chat"
                    f" {cell['cpu_ms']['chat']['node']:.2f} messages {cell['cpu_ms']['messages']['node']:.2f}"
                    f"  other cores {other:.2f}"
                )
                cells.append(cell)
    finally:
        stack.stop()
        owned.stop(upstream)
    return {"cells": cells, "in_process": in_process(opts.sizes)}


@dataclass
class _Got:
    ms: dict[str, list[float]]
    first_ms: dict[str, list[float]]
    cpu_s: dict[str, dict[str, float]]


def _triples(ports: dict[str, int], requests: dict[str, bytes], procs: dict[str, Callable[[], float]], n: int) -> _Got:
    got = _Got({a: [] for a in ARMS}, {a: [] for a in ARMS}, {a: dict.fromkeys(procs, 0.0) for a in ARMS})

    async def go() -> None:
        loop = asyncio.get_running_loop()
        conns: dict[str, load.Conn] = {}
        for arm in ARMS:
            _, conns[arm] = await loop.create_connection(load.Conn, "127.0.0.1", ports[arm])
        try:
            for i in range(n + 3):
                for arm in ARMS[i % 3 :] + ARMS[: i % 3]:
                    before = {k: f() for k, f in procs.items()}
                    t0 = load.clock()
                    a = await asyncio.wait_for(conns[arm].send(requests[arm]), 30)
                    if not (a.ok or (a.status == 200 and b'"message_stop"' in conns[arm].tail)):
                        raise RuntimeError(f"messages: an incomplete answer (status {a.status}) in arm {arm}")
                    if i < 3:
                        continue
                    got.ms[arm].append(1000 * (a.t_end - t0))
                    got.first_ms[arm].append(1000 * (a.t_first - t0))
                    for k, f in procs.items():
                        got.cpu_s[arm][k] += f() - before[k]
        finally:
            for c in conns.values():
                c.abort()

    with asyncio.Runner(loop_factory=load.loop_factory()) as runner:
        runner.run(go())
    return got


def _p(values: list[float], q: float) -> float:
    return round(load.pct(sorted(values), q), 3)


def _cell(size: int, mode: str, nbytes: int, got: _Got, other: float) -> dict[str, Any]:
    n = len(got.ms["direct"])

    def minus(a: dict[str, list[float]], x: str, y: str) -> list[float]:
        return [p - q for p, q in zip(a[x], a[y], strict=True)]

    translation = minus(got.ms, "messages", "chat")
    return {
        "cell": f"{size // 1000} KB {mode}",
        "bytes_asked": size,
        "bytes": nbytes,
        "stream": mode == "stream",
        "triples": n,
        "p50_ms": {a: _p(got.ms[a], 50) for a in ARMS},
        "p99_ms": {a: _p(got.ms[a], 99) for a in ARMS},
        "added_p50_ms": {a: _p(minus(got.ms, a, "direct"), 50) for a in ARMS[1:]},
        "added_p99_ms": {a: _p(minus(got.ms, a, "direct"), 99) for a in ARMS[1:]},
        "added_first_byte_p50_ms": {a: _p(minus(got.first_ms, a, "direct"), 50) for a in ARMS[1:]},
        "translation_p50_ms": _p(translation, 50),
        "translation_p99_ms": _p(translation, 99),
        "translation_mean_ms": round(statistics.fmean(translation), 3),
        "cpu_ms": {a: {k: round(1000 * v / n, 3) for k, v in got.cpu_s[a].items()} for a in ARMS[1:]},
        "other_cores": round(other, 3),
    }


# --- the translation alone, in process --------------------------------------------------------------


def _us(fn: Callable[[], object], per: int = 1, budget_s: float = 0.05) -> float:
    """CPU µs of one call of `fn` divided by `per`: the median of 5 runs of about `budget_s` each."""
    t0 = time.process_time()
    fn()
    one = max(1e-6, time.process_time() - t0)
    reps = max(1, int(budget_s / one))
    runs = []
    for _ in range(5):
        t0 = time.process_time()
        for _ in range(reps):
            fn()
        runs.append((time.process_time() - t0) / reps)
    return round(1e6 * statistics.median(runs) / per, 2)


def tool_call_events(pieces: int = 40) -> list[bytes]:
    """A chat stream that says a few words, then calls a tool whose arguments arrive in `pieces` deltas."""
    head = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 1700000000, "model": "fake-model"}

    def event(delta: dict[str, Any] | None, finish: str | None = None, **extra: Any) -> bytes:
        choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
        return b"data: " + _encode({**head, "choices": choices, **extra}) + b"\n\n"

    out = [event({"role": "assistant", "content": ""})]
    out += [event({"content": f"w{i} "}) for i in range(5)]
    fn = {"name": "tool_1", "arguments": ""}
    out.append(event({"tool_calls": [{"index": 0, "id": "call_0", "type": "function", "function": fn}]}))
    args = _encode({"arg_0": "src/" + "x" * (4 * pieces), "arg_1": 1}).decode()
    step = -(-len(args) // pieces)
    for j in range(0, len(args), step):
        out.append(event({"tool_calls": [{"index": 0, "function": {"arguments": args[j : j + step]}}]}))
    out.append(event({}, "tool_calls"))
    out.append(event(None, usage={"prompt_tokens": 8, "completion_tokens": 40, "total_tokens": 48}))
    out.append(b"data: [DONE]\n\n")
    return out


def in_process(sizes: list[int]) -> dict[str, Any]:
    """µs of CPU per request for the request's translation, per event for a streamed answer."""
    heap.keep_large_buffers()  # as the node runs (iop/cli/serve.py)
    requests = []
    for size in sizes:
        body = _encode(turn("bench-chat", size, True))
        request = _decode(body)
        chat = messages_to_chat_request(request)

        def node(body: bytes = body) -> None:
            # As the node does it: a body that just arrived, decoded, translated, encoded, dropped.
            _encode(messages_to_chat_request(_decode(bytes(bytearray(body)))).body)

        row = {
            "bytes": len(body),
            "request_us": _us(node),
            "bytes_us": _us(lambda b=body: chat_body_of(bytes(bytearray(b)))),  # type: ignore[misc]
            "decode_us": _us(lambda b=body: _decode(b)),  # type: ignore[misc]
            "translate_us": _us(lambda r=request: messages_to_chat_request(r)),  # type: ignore[misc]
            "encode_us": _us(lambda c=chat.body: _encode(c)),  # type: ignore[misc]
            "copy_us": _us(lambda b=body: bytes(bytearray(b))),  # type: ignore[misc]
            "count_tokens_us": _us(lambda r=request: estimate_input_tokens(messages_to_chat_request(r).body)),  # type: ignore[misc]
        }
        row["request_us_per_mb"] = round((row["request_us"] - row["copy_us"]) * 1e6 / len(body), 1)
        row["bytes_us_per_mb"] = round((row["bytes_us"] - row["copy_us"]) * 1e6 / len(body), 1)
        requests.append(row)
    whole = chat_whole("fake-model", TOKENS)
    answers: dict[str, Any] = {
        "whole_us": _us(lambda: _encode(chat_to_messages_answer(whole, "bench-chat"))),
    }
    for name, events in (("text", chat_events("fake-model", TOKENS, True)), ("tool_call", tool_call_events())):

        def feed(events: list[bytes] = events) -> None:
            s = ChatToMessagesStream("bench-chat")
            for e in events:
                s.feed(e)
            s.close()

        answers[f"stream_{name}"] = {"events": len(events), "us_per_event": _us(feed, len(events))}
    for r in requests:
        log(
            f"messages in process {r['bytes']:>9,} B: request {r['request_us']:.1f} µs"
            f" ({r['request_us_per_mb']:.0f} µs/MB), as bytes {r['bytes_us']:.1f} ({r['bytes_us_per_mb']:.0f} µs/MB);"
            f" alone: decode {r['decode_us']:.1f} translate {r['translate_us']:.1f} encode {r['encode_us']:.1f};"
            f" count_tokens {r['count_tokens_us']:.1f}"
        )
    log(
        f"messages in process answers: whole {answers['whole_us']:.1f} µs, stream µs per event"
        f" text {answers['stream_text']['us_per_event']:.2f},"
        f" tool call {answers['stream_tool_call']['us_per_event']:.2f}"
    )
    return {"requests": requests, "answers": answers}


def render_messages(d: dict[str, Any]) -> str:
    rows = [
        [
            c["cell"],
            f"{c['bytes']:,}",
            f"{c['p50_ms']['direct']:.2f} / {c['p99_ms']['direct']:.2f}",
            f"{c['added_p50_ms']['chat']:.2f} / {c['added_p99_ms']['chat']:.2f}",
            f"{c['added_p50_ms']['messages']:.2f} / {c['added_p99_ms']['messages']:.2f}",
            f"{c['translation_p50_ms']:.3f} / {c['translation_p99_ms']:.3f}",
            " / ".join(f"{c['cpu_ms'][a]['edge']:.2f}" for a in ("chat", "messages")),
            " / ".join(f"{c['cpu_ms'][a]['node']:.2f}" for a in ("chat", "messages")),
            f"{c['other_cores']:.2f}",
        ]
        for c in d["cells"]
    ]
    head = [
        "turn",
        "bytes",
        "direct p50 / p99",
        "chat added p50 / p99",
        "messages added p50 / p99",
        "messages - chat p50 / p99",
        "edge CPU chat / messages",
        "node CPU chat / messages",
        "other cores",
    ]
    n = d["cells"][0]["triples"] if d["cells"] else 0
    out = (
        f"Anthropic Messages translation, c=1, {n} triples per cell, arms rotating request by request (ms;"
        " CPU-ms per request)\n" + table(head, rows)
    )
    ip = d.get("in_process") or {}
    req_rows = [
        [
            f"{r['bytes']:,}",
            f"{r['request_us']:.1f} ({r['request_us_per_mb']:.0f} per MB)",
            f"{r['bytes_us']:.1f} ({r['bytes_us_per_mb']:.0f} per MB)",
            f"{r['decode_us']:.1f}",
            f"{r['translate_us']:.1f}",
            f"{r['encode_us']:.1f}",
            f"{r['count_tokens_us']:.1f}",
        ]
        for r in ip.get("requests", [])
    ]
    if req_rows:
        head = ["bytes", "request, decoded", "request, as bytes", "decode alone", "translate alone", "encode alone"]
        out += "\n\nThe translation alone, in process (CPU µs; alone: each step repeated on the same objects)\n"
        out += table([*head, "count_tokens estimate"], req_rows)
        a = ip["answers"]
        out += (
            f"\nanswer: whole {a['whole_us']:.1f} µs; stream per event: text {a['stream_text']['us_per_event']:.2f} µs"
            f" ({a['stream_text']['events']} events), tool call {a['stream_tool_call']['us_per_event']:.2f} µs"
            f" ({a['stream_tool_call']['events']} events)"
        )
    return out
