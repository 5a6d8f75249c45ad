"""The requests `iop smoke` sends: both OpenAI APIs, streamed and whole, each answer checked for its shape."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx

from iop.contracts.status import PoolStatus

PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses"}
KINDS: list[tuple[str, bool]] = [("chat", False), ("chat", True), ("responses", False), ("responses", True)]
"""The burst cycles through these, so half goes to each API and half of each is streamed."""
MAX_TOKENS = 32
"""Short answers: a real upstream should spend its time being concurrent, not generating."""


@dataclass
class Outcome:
    """One request as the client saw it. Times are seconds since the burst started."""

    alias: str
    api: str
    stream: bool
    ok: bool
    status: int | None
    problem: str
    """Why the answer is not acceptable; empty when ok."""
    provider: str
    sent_s: float
    latency_ms: float
    queue_ms: float | None
    """What the edge reports in x-iop-queue-ms: how long the request waited before a node started it."""

    @property
    def started_s(self) -> float | None:
        """When a node started it (the edge's queue wait added to when it was sent)."""
        return None if self.queue_ms is None else self.sent_s + self.queue_ms / 1000

    @property
    def done_s(self) -> float:
        return self.sent_s + self.latency_ms / 1000


def body_of(api: str, alias: str, stream: bool, n: int) -> dict[str, Any]:
    prompt = f"iop smoke request {n}: reply with the single word ok."
    if api == "chat":
        return {
            "model": alias,
            "messages": [{"role": "user", "content": prompt}],
            "stream": stream,
            "max_tokens": MAX_TOKENS,
        }
    return {"model": alias, "input": prompt, "stream": stream, "max_output_tokens": MAX_TOKENS}


async def send(client: httpx.AsyncClient, alias: str, api: str, stream: bool, n: int, t0: float) -> Outcome:
    """Send one request and judge its answer; never raises for what the server or network does."""
    sent = time.monotonic()
    status: int | None = None
    provider = ""
    queue_ms: float | None = None
    try:
        async with client.stream("POST", PATHS[api], json=body_of(api, alias, stream, n)) as response:
            status = response.status_code
            provider = response.headers.get("x-iop-provider", "")
            queue_ms = _float(response.headers.get("x-iop-queue-ms"))
            if status != 200:
                problem = f"HTTP {status}: {_error_text(await response.aread())}"
            elif stream:
                problem = await _judge_stream(api, response)
            else:
                problem = _judge_whole(api, await response.aread())
    except httpx.TimeoutException:
        problem = f"no answer within {client.timeout.read or 0:g}s"
    except httpx.HTTPError as exc:
        problem = f"{type(exc).__name__}: {exc}"
    latency_ms = (time.monotonic() - sent) * 1000
    return Outcome(alias, api, stream, not problem, status, problem, provider, sent - t0, latency_ms, queue_ms)


def _float(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def _error_text(raw: bytes) -> str:
    """`code: message` from an OpenAI error body, else the start of the body."""
    try:
        err = json.loads(raw).get("error")
    except (ValueError, AttributeError):
        err = None
    if isinstance(err, dict):
        code = err.get("code") or err.get("type") or "error"
        return f"{code}: {err.get('message', '')}"
    return raw[:200].decode(errors="replace") or "(empty body)"


def _judge_whole(api: str, raw: bytes) -> str:
    try:
        data = json.loads(raw)
    except ValueError:
        return f"answer is not JSON: {raw[:120].decode(errors='replace')!r}"
    if not isinstance(data, dict):
        return "answer is not a JSON object"
    if api == "chat":
        choices = data.get("choices")
        message = choices[0].get("message") if isinstance(choices, list) and choices else None
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            return "chat answer has no choices[0].message.content"
        return ""
    if not isinstance(data.get("output"), list):
        return "Responses answer has no output list"
    if data.get("status") not in ("completed", "incomplete"):
        return f"Responses answer has status {data.get('status')!r}"
    return ""


async def _judge_stream(api: str, response: httpx.Response) -> str:
    """Read an SSE answer to its end: chat must end with `data: [DONE]`, Responses with response.completed."""
    last = ""
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            last = data
            continue
        try:
            event = json.loads(data)
        except ValueError:
            return f"stream event is not JSON: {data[:120]!r}"
        if not isinstance(event, dict):
            return "stream event is not a JSON object"
        if "error" in event and event.get("type") in (None, "error"):
            err = event["error"] if isinstance(event["error"], dict) else {"message": event["error"]}
            return f"stream ended with an error: {err.get('code') or 'error'}: {err.get('message', '')}"
        if api == "responses":
            last = str(event.get("type", ""))
            if last == "response.failed":
                err = (event.get("response") or {}).get("error") or {}
                return f"stream ended with response.failed: {err.get('code')}: {err.get('message')}"
        elif last == "[DONE]":
            return "chat stream has events after data: [DONE]"
    if api == "chat" and last != "[DONE]":
        return "chat stream did not end with data: [DONE]"
    # An answer cut by max_output_tokens ends with response.incomplete: still a whole, well-formed answer.
    if api == "responses" and last not in ("response.completed", "response.incomplete"):
        return f"Responses stream did not end with response.completed (last event: {last or 'none'})"
    return ""


@dataclass
class Saturation:
    """What the edge's /status said about the pool while the burst ran (sampled every few tens of ms)."""

    seen: bool = False
    running: int = 0
    """Slots taken when first seen saturated."""
    waiting: int = 0
    at_s: float = 0.0
    """When the pool was first seen with requests waiting, i.e. every slot taken."""
    max_waiting: int = 0
    samples: int = 0


@dataclass
class BurstResult:
    pool: list[Outcome]
    """In send order."""
    direct: Outcome | None
    saturation: Saturation
    unanswered_at_direct: int
    """Pool requests still unanswered when the direct request was answered."""
    duration_s: float


SAMPLE_S = 0.05


async def run_burst(
    client: httpx.AsyncClient,
    read_pool: Callable[[], Awaitable[PoolStatus | None]],
    alias: str,
    direct: str | None,
    n: int,
    say: Callable[[str], None],
) -> BurstResult:
    """Send `n` pool requests at once; once the edge shows requests waiting, one to `direct`.

    `read_pool` returns the pool's current /status entry (None: no answer); it is sampled for as long as the burst
    runs, to see the moment every slot is taken and how long the queue grew.
    """
    t0 = time.monotonic()
    done = 0
    marks = {n * q // 4 for q in (1, 2, 3)}

    def count(task: asyncio.Task[Outcome]) -> None:
        nonlocal done
        if task.cancelled():
            return
        done += 1
        if done in marks:
            say(f"burst: {done}/{n} answered")

    tasks = []
    for i in range(n):
        api, stream = KINDS[i % len(KINDS)]
        task = asyncio.create_task(send(client, alias, api, stream, i, t0))
        task.add_done_callback(count)
        tasks.append(task)
    # return_exceptions: when an interruption cancels the requests, the gather must not hold an
    # exception nobody retrieves (send() itself never raises).
    all_done: asyncio.Future[list[Outcome | BaseException]] = asyncio.ensure_future(
        asyncio.gather(*tasks, return_exceptions=True)
    )
    sat = Saturation()
    saturated = asyncio.Event()

    async def watch() -> None:
        while not all_done.done():
            pool = await read_pool()
            sat.samples += 1
            waiting = pool.waiting if pool is not None else 0
            sat.max_waiting = max(sat.max_waiting, waiting)
            if pool is not None and waiting > 0 and not sat.seen:
                # Slots taken (dispatched), not started: a node may not have picked the newest up yet.
                sat.seen, sat.running, sat.waiting = True, pool.dispatched_in_flight, waiting
                sat.at_s = time.monotonic() - t0
                saturated.set()
            # Sampling the edge while the burst runs: a status read is cheap next to 40 answers.
            await asyncio.sleep(SAMPLE_S)

    watcher = asyncio.create_task(watch())
    filled: asyncio.Future[Any] = asyncio.ensure_future(saturated.wait())
    direct_outcome: Outcome | None = None
    unanswered = 0
    try:
        await asyncio.wait({all_done, filled}, return_when=asyncio.FIRST_COMPLETED)
        if direct is not None:
            if sat.seen:
                say(f"pool {alias} full ({sat.running} slots taken, {sat.waiting} waiting): 1 request to {direct}")
            else:
                say(f"pool {alias} never showed waiting requests; sending 1 request to {direct} anyway")
            direct_outcome = await send(client, direct, "chat", False, n, t0)
            unanswered = sum(1 for t in tasks if not t.done())
        outcomes = [o for o in await all_done if isinstance(o, Outcome)]
        await watcher
    finally:
        watcher.cancel()
        filled.cancel()
        # Cancel the requests, not the gather: a cancelled gather nobody awaits logs its CancelledError.
        for t in tasks:
            t.cancel()
    return BurstResult(outcomes, direct_outcome, sat, unanswered, time.monotonic() - t0)
