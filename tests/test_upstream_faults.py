"""Broken upstreams: answers that look like success but are not, and the two timeouts of an adapter.

A raw TCP server plays the broken upstream (it must write exactly the bytes under test, framing
included); a real edge, node and nats-server carry the request. A good fake upstream beside it
shows that what is detected before the first byte fails over.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from iop import config, wire
from iop.errors import UpstreamError
from iop.nats.server import EmbeddedNats
from iop.node.adapters.openai import OpenAIAdapter, upstream_request_id
from tests.fakes import fake_upstream, serve_asgi
from tests.harness import deployment, deployment_running, sse_events

Answer = Callable[[asyncio.StreamWriter], Awaitable[None]]

CHUNK = b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'


@asynccontextmanager
async def broken_upstream(answer: Answer) -> AsyncIterator[str]:
    """An upstream that reads one request per connection and answers with `answer`'s raw bytes."""
    writers: set[asyncio.StreamWriter] = set()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.add(writer)
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(
                int(line.split(b":", 1)[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length")
            )
            await reader.readexactly(length)
            await answer(writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            writers.discard(writer)

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        for w in list(writers):
            w.close()
        server.close()
        await server.wait_closed()


def one_provider(url: str, extra: str = "") -> str:
    return f"""
models: [{{alias: m, pool: [bad]}}]
nodes:
  - id: n
    adapters: [{{id: up, type: openai, base_url: "{url}", api: both{extra}}}]
    providers: [{{id: bad, adapter: up, capacity: 2}}]
"""


def bad_and_good(bad_url: str, good_url: str) -> str:
    # The bad provider has the most free slots, so every request tries it first.
    return f"""
models: [{{alias: m, pool: [bad, good]}}]
nodes:
  - id: n
    adapters:
      - {{id: up-bad, type: openai, base_url: "{bad_url}", api: both}}
      - {{id: up-good, type: openai, base_url: "{good_url}", api: both}}
    providers:
      - {{id: bad, adapter: up-bad, capacity: 4}}
      - {{id: good, adapter: up-good, capacity: 1}}
"""


CHAT = {"model": "m", "messages": [{"role": "user", "content": "x"}]}


async def garbage_200(w: asyncio.StreamWriter) -> None:
    w.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 12\r\n\r\n\x00\xffnot json!!")
    await w.drain()


async def json_200(w: asyncio.StreamWriter) -> None:
    body = b'{"id":"c","object":"chat.completion","choices":[]}'
    w.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
    await w.drain()


async def cut_until_close(w: asyncio.StreamWriter) -> None:
    # No content-length, no chunked coding: the body ends when the connection closes.
    w.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n" + CHUNK * 3)
    await w.drain()


async def test_garbage_with_200_is_an_error_and_fails_over(nats_server: EmbeddedNats) -> None:
    async with broken_upstream(garbage_200) as bad, fake_upstream() as good:
        async with deployment_running(deployment(one_provider(bad)), nats_server.url) as h, h.http() as http:
            r = await http.post("/v1/chat/completions", json=CHAT)
            # Before: 200 with the garbage as the body.
            assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_bad_answer"
        async with deployment_running(deployment(bad_and_good(bad, good.url)), nats_server.url) as h, h.http() as http:
            r = await http.post("/v1/chat/completions", json=CHAT)
            assert r.status_code == 200 and r.headers["x-iop-provider"] == "good"


async def test_a_json_body_answering_a_stream_is_an_error_and_fails_over(nats_server: EmbeddedNats) -> None:
    async with broken_upstream(json_200) as bad, fake_upstream() as good:
        async with deployment_running(deployment(one_provider(bad)), nats_server.url) as h, h.http() as http:
            r = await http.post("/v1/chat/completions", json={**CHAT, "stream": True})
            # Before: 200 text/event-stream carrying the JSON object, taken for a finished stream.
            assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_bad_answer"
            assert "JSON body" in r.json()["error"]["message"]
        async with deployment_running(deployment(bad_and_good(bad, good.url)), nats_server.url) as h, h.http() as http:
            r = await http.post("/v1/chat/completions", json={**CHAT, "stream": True})
            assert r.status_code == 200 and r.headers["x-iop-provider"] == "good"
            assert r.text.rstrip().endswith("data: [DONE]")


async def test_a_stream_cut_without_done_under_until_close_framing_ends_with_an_error_event(
    nats_server: EmbeddedNats,
) -> None:
    async with (
        broken_upstream(cut_until_close) as bad,
        deployment_running(deployment(one_provider(bad)), nats_server.url) as h,
        h.http() as http,
    ):
        r = await http.post("/v1/chat/completions", json={**CHAT, "stream": True})
        assert r.status_code == 200  # the chunks had started: the error can only be an event
        events = sse_events(r.text)
        # Before: the three chunks and a clean end, as if the answer were whole.
        assert [e["choices"][0]["delta"]["content"] for e in events[:3]] == ["hi"] * 3
        assert events[-1]["error"]["code"] == "upstream_truncated"


async def test_a_translated_messages_stream_cut_short_ends_with_one_anthropic_error_event(
    nats_server: EmbeddedNats,
) -> None:
    async with (
        broken_upstream(cut_until_close) as bad,
        deployment_running(deployment(one_provider(bad)), nats_server.url) as h,
        h.http() as http,
    ):
        body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}], "stream": True}
        r = await http.post("/v1/messages", json=body)
        assert r.status_code == 200  # the text had started: the error can only be an event
        events = sse_events(r.text)
        assert events[0]["type"] == "message_start"
        assert [e["delta"]["text"] for e in events if e["type"] == "content_block_delta"] == ["hi"] * 3
        # The stream's last event, once: Anthropic's error shape (never a chat error, never two).
        assert [e["type"] for e in events].count("error") == 1 and events[-1]["type"] == "error"
        assert events[-1]["error"]["type"] == "api_error" and "cut short" in events[-1]["error"]["message"]
        assert "message_stop" not in [e["type"] for e in events]


async def test_timeout_s_bounds_the_whole_request_and_idle_timeout_s_each_silence(nats_server: EmbeddedNats) -> None:
    async def trickle(w: asyncio.StreamWriter) -> None:
        w.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        while True:  # a byte every 50 ms for ever: never silent, never done
            w.write(b"%x\r\n%s\r\n" % (len(CHUNK), CHUNK))
            await w.drain()
            await asyncio.sleep(0.05)

    async def silent(w: asyncio.StreamWriter) -> None:
        await asyncio.sleep(30)

    async with broken_upstream(trickle) as url:
        dep = deployment(one_provider(url, ", timeout_s: 1, idle_timeout_s: 5"))
        async with deployment_running(dep, nats_server.url) as h, h.http() as http:
            t0 = time.monotonic()
            r = await http.post("/v1/chat/completions", json={**CHAT, "stream": True}, timeout=httpx.Timeout(20))
            took = time.monotonic() - t0
            # Before: timeout_s bounded only the silences, so this stream never ended.
            assert r.status_code == 200 and sse_events(r.text)[-1]["error"]["code"] == "upstream_timeout"
            assert 1.0 <= took < 5.0
    async with broken_upstream(silent) as url:
        dep = deployment(one_provider(url, ", timeout_s: 30, idle_timeout_s: 0.5"))
        async with deployment_running(dep, nats_server.url) as h, h.http() as http:
            t1 = time.monotonic()
            r = await http.post("/v1/chat/completions", json=CHAT, timeout=httpx.Timeout(20))
            idle = time.monotonic() - t1
            assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_timeout"
            assert 0.5 <= idle < 5.0
    print(
        f"\ntrickling stream ended at timeout_s 1 after {took:.2f}s; "
        f"silent upstream at idle_timeout_s 0.5 after {idle:.2f}s"
    )


def strict_request_ids() -> tuple[Starlette, list[str]]:
    """An upstream that, like llama-cpp-python's server, answers an empty 400 to any `x-request-id`
    that is not a (version 4) UUID; the ids it accepted."""
    seen: list[str] = []

    async def chat(request: Request) -> Response:
        rid = request.headers.get("x-request-id")
        if rid is not None:
            try:
                if uuid.UUID(rid).version != 4:
                    raise ValueError(rid)
            except ValueError:
                return Response(b"", 400)
            seen.append(rid)
        answer = {"id": "c", "object": "chat.completion", "choices": [{"index": 0, "message": {"content": "ok"}}]}
        return JSONResponse(answer)

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])]), seen


async def test_upstream_ids_are_uuids_a_strict_upstream_accepts(nats_server: EmbeddedNats) -> None:
    app, seen = strict_request_ids()
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    async with (
        serve_asgi(app) as url,
        deployment_running(deployment(one_provider(url + "/v1")), nats_server.url) as h,
        h.http() as http,
    ):
        given = "0b6f1d1e-8e43-4d8e-9f6a-3c2d1b0a9f8e"
        for rid in ("ticket-4711", None, given):
            headers = {"x-request-id": rid} if rid else {}
            r = await http.post("/v1/chat/completions", json=body, headers=headers)
            assert r.status_code == 200, r.text
    # Derived from the request id, the same each time, so the upstream's log joins iop's; a UUID stays.
    assert seen[0] == upstream_request_id("ticket-4711") == upstream_request_id("ticket-4711")
    assert seen[2] == given and len(set(seen)) == 3


def _uuid_of(request_id: str) -> str:
    """The reference: uuid's own reading of the id, else the UUID of its SHA-256 (version 4)."""
    try:
        return str(uuid.UUID(request_id))
    except ValueError:
        return str(uuid.UUID(bytes=hashlib.sha256(request_id.encode()).digest()[:16], version=4))


_UUIDISH = st.sampled_from([*"0123456789abcdefABCDEF-{}", "urn:", "uuid:", "g", "é"])


@settings(max_examples=500, deadline=None)
@given(
    st.one_of(
        st.text(max_size=40),
        st.lists(_UUIDISH, min_size=30, max_size=40).map("".join),
        st.uuids().map(str),
        st.uuids().map(lambda u: "urn:uuid:{" + u.hex.upper() + "}"),
    )
)
def test_the_upstream_request_id_is_uuids_own_reading_or_the_uuid_of_the_ids_hash(request_id: str) -> None:
    assert upstream_request_id(request_id) == _uuid_of(request_id)


async def test_an_upstream_error_with_an_empty_body_names_its_status_and_says_it_was_empty(
    nats_server: EmbeddedNats,
) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    for status, client_status in ((400, 400), (500, 502)):

        async def empty(writer: asyncio.StreamWriter, status: int = status) -> None:
            writer.write(b"HTTP/1.1 %d Oops\r\ncontent-length: 0\r\n\r\n" % status)
            await writer.drain()

        async with (
            broken_upstream(empty) as url,
            deployment_running(deployment(one_provider(url)), nats_server.url) as h,
            h.http() as http,
        ):
            r = await http.post("/v1/chat/completions", json=body)
        assert r.status_code == client_status, r.text
        message = r.json()["error"]["message"]
        assert f"answered {status} with an empty body" in message, message


async def test_timeout_s_is_the_adapters_own_cancel_and_no_one_elses() -> None:
    # The bound is a timer that cancels the request's task: at timeout_s it is upstream_timeout,
    # a cancel from elsewhere (the edge's Cancel) stays a cancel, and the task's count of pending
    # cancels is even again after either (as asyncio.timeout leaves it).
    chat = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}]}).encode()
    item = wire.WorkItem(id="r1", api="chat", stream=False, alias="m", body=chat, reply_to="", deadline=0)

    async def sent(data: bytes, headers: Mapping[str, str] | None = None) -> None:
        raise AssertionError("the upstream never answers here")

    gate = asyncio.Event()
    async with fake_upstream(gate=gate) as up:
        for n, timeout_s in enumerate((0.2, 30.0), 1):
            adapter = OpenAIAdapter(config.OpenAIAdapter(id="up", base_url=up.url, api="chat", timeout_s=timeout_s))
            counts: list[int] = []

            async def run(adapter: OpenAIAdapter = adapter, counts: list[int] = counts) -> None:
                try:
                    await adapter.run(item, None, sent)
                finally:
                    counts.append(asyncio.current_task().cancelling())  # type: ignore[union-attr]

            task = asyncio.create_task(run())
            await up.wait_for(lambda u, n=n: u.total == n)  # the request is upstream, held there
            if timeout_s < 1:
                with pytest.raises(UpstreamError) as err:
                    await asyncio.wait_for(task, 5)
                assert err.value.code == "upstream_timeout" and counts == [0]
            else:
                task.cancel()  # the edge's Cancel, long before timeout_s
                with pytest.raises(asyncio.CancelledError):
                    await task
                assert counts == [1]
            await adapter.close()
        gate.set()
