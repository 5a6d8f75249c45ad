"""The protocol and capability probes: each sends a fixed request and judges the answer by parsing it.

Nothing here judges prose: a check looks at statuses, JSON shapes, token counts, a tool call's
name, parameters, types and values (the way BFCL's AST checker does), and a schema's validity.
"""

from __future__ import annotations

import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from iop.client import EdgeClient
from iop.qualify.calls import Streamed, Whole, stream, whole
from iop.qualify.schema import Check, CheckStatus, Group

MAX_TOKENS_PROBE = 8
"""The `max_tokens` asked of an answer told to be long: more back is a failure."""
OVERSIZED_PROMPT_WORDS = 600_000
"""Far past any context window served today (~600k tokens), and still under the edge's body limit."""


@dataclass
class Target:
    """A provider as the probes reach it: the edge's pinned path, the alias its node expects."""

    client: EdgeClient
    provider: str
    alias: str
    timeout_s: float = 60.0

    def chat(self, content: str, **extra: Any) -> dict[str, Any]:
        return {"model": self.alias, "messages": [{"role": "user", "content": content}], **extra}


def nonce() -> str:
    """A random opening so that no two probes share a prefix (no prefix-cache rides)."""
    return f"[{random.getrandbits(48):012x}] "


@dataclass
class Outcome:
    status: CheckStatus
    reason: str = ""


Probe = Callable[[Target], Awaitable[Outcome]]


def ok(reason: str = "") -> Outcome:
    return Outcome("pass", reason)


def fail(reason: str) -> Outcome:
    return Outcome("fail", reason)


# --- protocol -----------------------------------------------------------------------------------


def _chat_text(w: Whole) -> tuple[str | None, str]:
    """The message text of a whole chat answer, or None and why not."""
    if w.status != 200:
        return None, f"HTTP {w.status}: {w.text[:160]}"
    try:
        msg = w.body["choices"][0]["message"]
    except (TypeError, KeyError, IndexError):
        return None, "the answer has no choices[0].message"
    content = msg.get("content")
    if content is None and msg.get("tool_calls"):
        return "", ""
    if not isinstance(content, str):
        return None, "choices[0].message.content is not a string"
    return content, ""


async def chat_whole(t: Target) -> Outcome:
    w = await whole(
        t.client, t.provider, "chat", t.chat(nonce() + "Reply with one word: ready.", max_tokens=16), t.timeout_s
    )
    text, why = _chat_text(w)
    if text is None:
        return fail(why)
    return ok() if text.strip() else fail("the answer's content is empty")


async def chat_stream(t: Target) -> Outcome:
    s = await stream(
        t.client, t.provider, "chat", t.chat(nonce() + "Reply with one word: ready.", max_tokens=16), t.timeout_s
    )
    return _stream_outcome(s)


def _stream_outcome(s: Streamed) -> Outcome:
    if s.error:
        return fail(s.error)
    if s.malformed:
        return fail(s.malformed)
    if not s.content.strip():
        return fail("the stream carried no answer text")
    return ok(f"{s.events} events")


async def responses_whole(t: Target) -> Outcome:
    body = {"model": t.alias, "input": nonce() + "Reply with one word: ready.", "max_output_tokens": 16}
    w = await whole(t.client, t.provider, "responses", body, t.timeout_s)
    if w.status != 200:
        return fail(f"HTTP {w.status}: {w.text[:160]}")
    if not isinstance(w.body, dict) or w.body.get("object") != "response":
        return fail("the answer is not a response object")
    texts = [
        part.get("text", "")
        for item in w.body.get("output") or []
        if item.get("type") == "message"
        for part in item.get("content") or []
        if part.get("type") == "output_text"
    ]
    if not "".join(texts).strip():
        return fail("the response has no output_text")
    return ok(f"status {w.body.get('status')}")


async def responses_stream(t: Target) -> Outcome:
    body = {"model": t.alias, "input": nonce() + "Reply with one word: ready.", "max_output_tokens": 16}
    return _stream_outcome(await stream(t.client, t.provider, "responses", body, t.timeout_s))


def _usage_problem(usage: Any, names: tuple[str, str]) -> str:
    if not isinstance(usage, dict):
        return "no usage in the answer"
    for name in names:
        if not isinstance(usage.get(name), int):
            return f"usage has no integer {name}"
    if usage[names[1]] <= 0:
        return f"usage says {names[1]} = {usage[names[1]]} for a non-empty answer"
    return ""


async def usage_whole(t: Target) -> Outcome:
    w = await whole(
        t.client, t.provider, "chat", t.chat(nonce() + "Reply with one word: ready.", max_tokens=16), t.timeout_s
    )
    if w.status != 200 or not isinstance(w.body, dict):
        return fail(f"HTTP {w.status}: {w.text[:160]}")
    problem = _usage_problem(w.body.get("usage"), ("prompt_tokens", "completion_tokens"))
    return fail(problem) if problem else ok()


async def usage_stream(t: Target) -> Outcome:
    body = t.chat(nonce() + "Reply with one word: ready.", max_tokens=16, stream_options={"include_usage": True})
    s = await stream(t.client, t.provider, "chat", body, t.timeout_s)
    if s.error:
        return fail(s.error)
    if s.usage is None:
        return fail("the stream reported no usage (asked with stream_options.include_usage)")
    problem = _usage_problem(s.usage, ("prompt_tokens", "completion_tokens"))
    return fail(problem) if problem else ok()


async def max_tokens_honoured(t: Target) -> Outcome:
    body = t.chat(
        nonce() + "Count from 1 to 300, one number per line, with no other text.", max_tokens=MAX_TOKENS_PROBE
    )
    w = await whole(t.client, t.provider, "chat", body, t.timeout_s)
    if w.status != 200 or not isinstance(w.body, dict):
        return fail(f"HTTP {w.status}: {w.text[:160]}")
    usage = w.body.get("usage") or {}
    got = usage.get("completion_tokens")
    if not isinstance(got, int):
        return Outcome("warn", "no usage.completion_tokens to compare with max_tokens")
    if got > MAX_TOKENS_PROBE:
        return fail(f"asked for at most {MAX_TOKENS_PROBE} tokens, got {got}")
    reason = (w.body.get("choices") or [{}])[0].get("finish_reason")
    if reason != "length":
        return fail(f"cut at max_tokens but finish_reason is {reason!r}, not 'length'")
    return ok(f"{got} tokens, finish_reason length")


async def stop_honoured(t: Target) -> Outcome:
    body = t.chat(
        nonce() + "Write exactly this and nothing else: one two three four five six", max_tokens=32, stop=["four"]
    )
    w = await whole(t.client, t.provider, "chat", body, t.timeout_s)
    text, why = _chat_text(w)
    if text is None:
        return fail(why)
    if "four" in text.lower():
        return fail("the answer runs past the stop sequence 'four'")
    if "three" not in text.lower():
        return Outcome("warn", "the answer did not reach the stop sequence, so it says nothing about stop")
    return ok()


async def oversized_prompt(t: Target) -> Outcome:
    words = " ".join(random.choice(("alpha", "beta", "gamma", "delta")) for _ in range(OVERSIZED_PROMPT_WORDS))
    w = await whole(t.client, t.provider, "chat", t.chat(nonce() + words, max_tokens=1), t.timeout_s)
    if 400 <= w.status < 500:
        if isinstance(w.body, dict) and isinstance(w.body.get("error"), dict):
            return ok(f"HTTP {w.status}: {str(w.body['error'].get('message', ''))[:120]}")
        return fail(f"HTTP {w.status} without an OpenAI error body")
    if w.status == 200:
        return Outcome("warn", f"a ~{OVERSIZED_PROMPT_WORDS // 1000}k-token prompt was accepted (truncated?)")
    return fail(f"HTTP {w.status} instead of a clean 4xx: {w.text[:120]}")


# --- capability ---------------------------------------------------------------------------------

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city name, e.g. Paris"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}


def check_tool_call(calls: list[dict[str, Any]]) -> str:
    """BFCL's AST order: function name, required parameters, types, then each value in its accepted set."""
    if not calls:
        return "no tool call (the answer was text)"
    call = calls[0]
    if call.get("name") != "get_weather":
        return f"called {call.get('name')!r}, not 'get_weather'"
    raw = call.get("arguments")
    try:
        args = msgspec.json.decode(raw) if isinstance(raw, str | bytes) else raw
    except msgspec.DecodeError:
        return f"the arguments are not JSON: {str(raw)[:80]!r}"
    if not isinstance(args, dict):
        return "the arguments are not a JSON object"
    for name in ("city", "unit"):
        if name not in args:
            return f"required parameter {name!r} is missing"
        if not isinstance(args[name], str):
            return f"parameter {name!r} is {type(args[name]).__name__}, not string"
    extra = set(args) - {"city", "unit"}
    if extra:
        return f"unknown parameters {sorted(extra)}"
    if not args["city"].strip().lower().startswith("paris"):
        return f"city is {args['city']!r}, not Paris"
    if args["unit"] != "celsius":
        return f"unit is {args['unit']!r}, not 'celsius'"
    return ""


async def tool_call(t: Target) -> Outcome:
    body = t.chat(
        nonce() + "What is the weather in Paris right now, in celsius? Use the tool.",
        tools=[WEATHER_TOOL],
        max_tokens=256,
    )
    w = await whole(t.client, t.provider, "chat", body, t.timeout_s)
    if w.status != 200 or not isinstance(w.body, dict):
        return fail(f"HTTP {w.status}: {w.text[:160]}")
    try:
        msg = w.body["choices"][0]["message"]
    except (KeyError, IndexError, TypeError):
        return fail("the answer has no choices[0].message")
    calls = [
        {"name": (c.get("function") or {}).get("name"), "arguments": (c.get("function") or {}).get("arguments")}
        for c in msg.get("tool_calls") or []
    ]
    problem = check_tool_call(calls)
    return fail(problem) if problem else ok("get_weather(city=Paris, unit=celsius)")


PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def schema_problem(value: Any, schema: dict[str, Any] = PERSON_SCHEMA) -> str:
    """What makes `value` invalid against the (flat) probe schema; empty when valid."""
    if not isinstance(value, dict):
        return "not a JSON object"
    for name in schema["required"]:
        if name not in value:
            return f"required property {name!r} is missing"
    for name, v in value.items():
        spec = schema["properties"].get(name)
        if spec is None:
            return f"property {name!r} is not allowed (additionalProperties: false)"
        kind = spec["type"]
        if kind == "string" and not isinstance(v, str):
            return f"{name!r} is not a string"
        if kind == "integer" and (not isinstance(v, int) or isinstance(v, bool)):
            return f"{name!r} is not an integer"
    return ""


async def json_schema(t: Target) -> Outcome:
    body = t.chat(
        nonce() + "Alice is 31 years old. Give her name and age as JSON.",
        max_tokens=128,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True},
        },
    )
    w = await whole(t.client, t.provider, "chat", body, t.timeout_s)
    text, why = _chat_text(w)
    if text is None:
        return fail(why)
    try:
        value = msgspec.json.decode(text.strip())
    except msgspec.DecodeError:
        return fail(f"the answer is not JSON: {text[:80]!r}")
    problem = schema_problem(value)
    return fail(f"invalid against the schema: {problem}") if problem else ok()


async def reasoning(t: Target) -> Outcome:
    body = t.chat(nonce() + "Is 91 a prime number? Answer yes or no.", max_tokens=512)
    w = await whole(t.client, t.provider, "chat", body, t.timeout_s)
    if w.status != 200 or not isinstance(w.body, dict):
        return fail(f"HTTP {w.status}: {w.text[:160]}")
    msg = ((w.body.get("choices") or [{}])[0]).get("message") or {}
    details = (w.body.get("usage") or {}).get("completion_tokens_details") or {}
    for field in ("reasoning_content", "reasoning"):
        if msg.get(field):
            return Outcome("info", f"present (message.{field})")
    if details.get("reasoning_tokens"):
        return Outcome("info", f"present ({details['reasoning_tokens']} reasoning tokens, text not returned)")
    return Outcome("info", "absent")


async def digits(t: Target) -> Outcome:
    """LLMPerf's deterministic correctness probe: a number in words, asked back as digits."""
    n = random.randint(101, 999)
    body = t.chat(nonce() + f"Write the number {number_words(n)} as digits only.", max_tokens=16)
    w = await whole(t.client, t.provider, "chat", body, t.timeout_s)
    text, why = _chat_text(w)
    if text is None:
        return fail(why)
    return ok() if str(n) in text.replace(",", "") else fail(f"asked for {n}, got {text.strip()[:40]!r}")


_ONES = [
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
    "thirteen",
    "fourteen",
    "fifteen",
    "sixteen",
    "seventeen",
    "eighteen",
    "nineteen",
]
_TENS = ["_", "_", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]


def number_words(n: int) -> str:
    hundreds, rest = divmod(n, 100)
    out = f"{_ONES[hundreds]} hundred"
    if rest:
        out += " " + (_ONES[rest] if rest < 20 else _TENS[rest // 10] + (f"-{_ONES[rest % 10]}" if rest % 10 else ""))
    return out


PROTOCOL: list[tuple[str, Probe]] = [
    ("chat_whole", chat_whole),
    ("chat_stream", chat_stream),
    ("responses_whole", responses_whole),
    ("responses_stream", responses_stream),
    ("usage_whole", usage_whole),
    ("usage_stream", usage_stream),
    ("max_tokens", max_tokens_honoured),
    ("stop", stop_honoured),
    ("oversized_prompt", oversized_prompt),
]
CAPABILITY: list[tuple[str, Probe]] = [
    ("tool_call", tool_call),
    ("json_schema", json_schema),
    ("reasoning", reasoning),
    ("digits", digits),
]


async def run_checks(t: Target, budget_s: float) -> list[Check]:
    """Every probe once, in order; a probe that fails to run at all is a fail with its error."""
    checks: list[Check] = []
    until = time.monotonic() + budget_s
    groups: list[tuple[Group, list[tuple[str, Probe]]]] = [("protocol", PROTOCOL), ("capability", CAPABILITY)]
    for group, probes in groups:
        for cid, probe in probes:
            if time.monotonic() > until:
                checks.append(Check(id=cid, group=group, status="skip", reason="out of the time budget"))
                continue
            t0 = time.monotonic()
            try:
                out = await probe(t)
            except Exception as exc:  # broad on purpose: one probe's crash is its own failure, not the run's
                out = fail(f"{type(exc).__name__}: {exc}")
            checks.append(
                Check(
                    id=cid,
                    group=group,
                    status=out.status,
                    reason=out.reason,
                    duration_ms=round((time.monotonic() - t0) * 1000, 1),
                )
            )
    return checks


async def context_window(t: Target, limit_tokens: int, budget_s: float) -> int | None:
    """The largest prompt accepted, by binary search on its size up to `limit_tokens` (prompt tokens of usage)."""
    lo, hi = 0, limit_tokens
    best: int | None = None
    until = time.monotonic() + budget_s
    while hi - lo > max(256, limit_tokens // 64) and time.monotonic() < until:
        mid = (lo + hi) // 2
        words = " ".join(random.choice(("alpha", "beta", "gamma", "delta")) for _ in range(mid))
        w = await whole(t.client, t.provider, "chat", t.chat(nonce() + words, max_tokens=1), t.timeout_s)
        if w.status == 200 and isinstance(w.body, dict):
            lo = mid
            prompt = (w.body.get("usage") or {}).get("prompt_tokens")
            best = prompt if isinstance(prompt, int) else mid
        else:
            hi = mid
    return best
