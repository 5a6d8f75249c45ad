"""Traces of requests (issue 29): one tree per request across the edge, NATS and the node, exported
over OTLP/HTTP to a receiver that decodes the real protobuf (tests/otlp.py).

One nats-server, one receiver, one edge and its nodes serve the whole module.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import sys
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import pytest_asyncio

from iop.nats.server import EmbeddedNats
from iop.tracing import NEW, Tracing
from iop.tracingconf import TracingSettings
from iop.usageview import record_line
from tests.fakes import FakeUpstream, fake_upstream
from tests.harness import EdgeHandle, deployment, eventually, free_port, running_edge, running_node
from tests.otlp import CLIENT, CONSUMER, PRODUCER, SERVER, Collector, SeenSpan, otlp_collector

pytestmark = pytest.mark.asyncio(loop_scope="module")

ECHO = [sys.executable, "-c", "import sys; sys.stdout.write(sys.stdin.read())"]
SECRET = "PROMPT-" + secrets.token_hex(6)
"""A word in every prompt here: no span may hold it."""


def traced_yaml(endpoint: str, good: str, bad: str, gated: str) -> str:
    return f"""
edge:
  queue: {{timeout_s: 10}}
tracing: {{endpoint: "{endpoint}", export_interval_ms: 20, export_timeout_s: 0.5}}
models:
  - {{alias: m, pool: [good-p]}}
  - {{alias: f, pool: [bad-p, good-f]}}
  - {{alias: g, pool: [gated-p]}}
  - {{alias: agent, route: n-cli/echo}}
nodes:
  - id: n-good
    adapters: [{{id: up, type: openai, base_url: "{good}", api: both}}]
    providers:
      - {{id: good-p, adapter: up, model: up-model, capacity: 4}}
      - {{id: good-f, adapter: up, capacity: 1}}
  - id: n-bad
    adapters: [{{id: up, type: openai, base_url: "{bad}", api: both}}]
    providers: [{{id: bad-p, adapter: up, capacity: 4}}]
  - id: n-gated
    adapters: [{{id: up, type: openai, base_url: "{gated}", api: both}}]
    providers: [{{id: gated-p, adapter: up, capacity: 1}}]
  - id: n-cli
    adapters: [{{id: echo, type: cli, command: {ECHO!r}}}]
    providers: [{{id: echo, adapter: echo}}]
"""


@dataclass
class Traced:
    h: EdgeHandle
    http: httpx.AsyncClient
    collector: Collector
    good: FakeUpstream
    gated: FakeUpstream
    nats_url: str


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def traced(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Traced]:
    server = EmbeddedNats("127.0.0.1:0", Path(tmp_path_factory.mktemp("nats")))
    await server.start()
    try:
        async with (
            otlp_collector() as collector,
            fake_upstream() as good,
            fake_upstream(fail_status=500) as bad,
            fake_upstream(gate=asyncio.Event()) as gated,
        ):
            dep = deployment(traced_yaml(collector.url, good.url, bad.url, gated.url))
            async with running_edge(dep, server.url) as h, AsyncExitStack() as stack:
                nodes = ["n-good", "n-bad", "n-gated", "n-cli"]
                for node in nodes:
                    await stack.enter_async_context(running_node(dep, node, server.url))
                await h.edge.registry.wait_connected(nodes, timeout_s=10)
                async with h.http() as http:
                    yield Traced(h, http, collector, good, gated, server.url)
                assert gated.gate is not None
                gated.gate.set()
    finally:
        await server.stop()


def chat(model: str, **kw: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": f"say {SECRET}"}], **kw}


def client_context() -> tuple[str, str]:
    """A client's own trace id and its traceparent (sampled)."""
    trace_id = secrets.token_hex(16)
    return trace_id, f"00-{trace_id}-{secrets.token_hex(8)}-01"


def one(spans: list[SeenSpan], prefix: str) -> SeenSpan:
    found = [s for s in spans if s.name.startswith(prefix)]
    assert len(found) == 1, (prefix, [s.name for s in spans])
    return found[0]


async def tree(c: Collector, trace_id: str, *names: str, timeout_s: float = 10.0) -> list[SeenSpan]:
    """The trace's spans once every name (a prefix) is there, ended, in the collector."""

    def complete(c: Collector) -> bool:
        spans = c.trace(trace_id)
        return all(any(s.name.startswith(n) for s in spans) for n in names)

    await c.wait_for(complete, timeout_s)
    return c.trace(trace_id)


async def test_tracing_pool_request_is_one_tree_across_edge_nats_node_and_upstream(traced: Traced) -> None:
    trace_id, parent = client_context()
    r = await traced.http.post("/v1/chat/completions", json=chat("m"), headers={"traceparent": parent})
    assert r.status_code == 200
    spans = await tree(traced.collector, trace_id, "POST", "iop.queue", "iop.attempt", "iop.node.work", "chat up-model")
    # One span where time goes that no other shows: admission, route and answer are attributes and events.
    assert sorted(s.name for s in spans) == [
        "POST /v1/chat/completions", "chat up-model", "iop.attempt good-p", "iop.node.work", "iop.queue"
    ]  # fmt: skip
    root = one(spans, "POST /v1/chat/completions")
    assert root.kind == SERVER and root.service == "iop-edge"
    assert root.parent_id == parent.split("-")[2]  # the client's span is the parent: its trace continues
    assert root.attributes["http.response.status_code"] == 200
    assert root.attributes["gen_ai.request.model"] == "m" and root.attributes["gen_ai.response.model"] == "up-model"
    assert root.attributes["iop.request_id"] == r.headers["x-request-id"]
    assert root.attributes["gen_ai.usage.output_tokens"] == 3
    assert root.attributes["iop.tenant"] == "" and root.attributes["http.request.body.size"] > 0  # the admission
    for name in ("iop.queue", "iop.attempt"):
        assert one(spans, name).parent_id == root.span_id, name
    assert one(spans, "iop.queue").attributes["iop.queue.outcome"] == "granted"
    attempt = one(spans, "iop.attempt good-p")
    assert attempt.kind == PRODUCER and attempt.attributes["iop.node"] == "n-good"
    assert attempt.attributes["iop.route.chosen"] == "good-p"
    assert attempt.attributes["iop.route.candidates"] == ["good-p"]
    assert [name for name, _ in attempt.events] == ["iop.answer"] and attempt.attributes["iop.bytes_out"] > 0
    # Across NATS: the node's span is the try's child, in the node's own service.
    work = one(spans, "iop.node.work")
    assert work.parent_id == attempt.span_id and work.kind == CONSUMER and work.service == "iop-node"
    assert work.attributes["iop.outcome"] == "ok" and work.attributes["iop.stream_wait_ms"] >= 0
    upstream = one(spans, "chat up-model")
    assert upstream.parent_id == work.span_id and upstream.kind == CLIENT
    assert upstream.attributes["http.response.status_code"] == 200
    assert upstream.attributes["gen_ai.usage.output_tokens"] == 3
    # The upstream request itself carried the call's context.
    assert f"00-{trace_id}-{upstream.span_id}-01" in traced.good.traceparents
    assert all(s.start_ns <= s.end_ns for s in spans)


async def test_tracing_edge_starts_a_trace_without_a_client_context(
    traced: Traced,
) -> None:
    r = await traced.http.post("/v1/chat/completions", json=chat("m", stream=True))
    assert r.status_code == 200
    rid = r.headers["x-request-id"]
    c = traced.collector
    await c.wait_for(lambda c: any(s.attributes.get("iop.request_id") == rid and s.kind == SERVER for s in c.spans))
    root = next(s for s in c.spans if s.attributes.get("iop.request_id") == rid and s.kind == SERVER)
    assert root.parent_id == ""
    await tree(c, root.trace_id, "iop.node.work", "chat")


async def test_tracing_client_context_not_sampled_records_nothing(traced: Traced) -> None:
    trace_id, parent = client_context()
    unsampled = parent[:-2] + "00"
    r = await traced.http.post("/v1/chat/completions", json=chat("m"), headers={"traceparent": unsampled})
    assert r.status_code == 200
    # A sampled request after it is exported; by then the unsampled one would have been too.
    later, sampled = client_context()
    await traced.http.post("/v1/chat/completions", json=chat("m"), headers={"traceparent": sampled})
    await tree(traced.collector, later, "POST", "chat")
    assert traced.collector.trace(trace_id) == []
    assert f"00-{trace_id}" not in " ".join(str(t) for t in traced.good.traceparents)


async def test_tracing_failover_shows_each_attempt_and_its_node(traced: Traced) -> None:
    trace_id, parent = client_context()
    r = await traced.http.post("/v1/chat/completions", json=chat("f"), headers={"traceparent": parent})
    assert r.status_code == 200
    spans = await tree(traced.collector, trace_id, "POST", "iop.attempt bad-p", "iop.attempt good-f")
    root = one(spans, "POST")
    failed, answered = one(spans, "iop.attempt bad-p"), one(spans, "iop.attempt good-f")
    assert failed.parent_id == answered.parent_id == root.span_id
    assert failed.attributes["iop.failover"] is True and failed.status == 2 and "error.type" in failed.attributes
    assert answered.attributes["iop.failover"] is False and answered.attributes["iop.attempt"] == 2
    assert failed.attributes["iop.route.reason"] and answered.attributes["iop.route.reason"] == "failover"
    assert answered.attributes["iop.route.excluded"] == ["bad-p"] and failed.start_ns < answered.start_ns
    await traced.collector.wait_for(lambda c: len(c.named(trace_id, "iop.node.work")) == 2)
    works = {s.parent_id: s for s in traced.collector.named(trace_id, "iop.node.work")}
    assert works[failed.span_id].attributes["iop.outcome"] != "ok"
    assert works[answered.span_id].attributes["iop.outcome"] == "ok"
    assert root.attributes["iop.attempts"] == 2


async def test_tracing_queued_request_shows_its_wait(traced: Traced) -> None:
    gate = traced.gated.gate
    assert gate is not None
    gate.clear()
    first = asyncio.create_task(traced.http.post("/v1/chat/completions", json=chat("g")))
    await traced.gated.wait_for(lambda u: u.in_flight == 1)
    trace_id, parent = client_context()
    second = asyncio.create_task(
        traced.http.post("/v1/chat/completions", json=chat("g"), headers={"traceparent": parent})
    )
    await eventually(lambda: _true(traced.h.edge.scheduler.waiting("g") == 1))
    gate.set()
    assert (await first).status_code == 200 and (await second).status_code == 200
    spans = await tree(traced.collector, trace_id, "POST", "iop.queue", "iop.node.work")
    queue = one(spans, "iop.queue")
    assert queue.attributes["iop.queue.outcome"] == "granted" and queue.attributes["iop.pool"] == "g"
    assert queue.attributes["iop.queue.position"] == 0  # the first to wait
    assert queue.end_ns > queue.start_ns
    assert one(spans, "POST").attributes["iop.queue_ms"] > 0


async def _true(value: bool) -> bool:
    return value


async def test_tracing_cli_request_shows_the_process(traced: Traced) -> None:
    trace_id, parent = client_context()
    r = await traced.http.post("/v1/chat/completions", json=chat("agent"), headers={"traceparent": parent})
    assert r.status_code == 200
    spans = await tree(traced.collector, trace_id, "POST", "iop.attempt echo", "iop.node.work", "iop.cli echo")
    attempt, work, cli = one(spans, "iop.attempt echo"), one(spans, "iop.node.work"), one(spans, "iop.cli echo")
    assert attempt.parent_id == one(spans, "POST").span_id and attempt.attributes["iop.route"] == "direct"
    assert work.parent_id == attempt.span_id and work.attributes["iop.kind"] == "cli"
    assert cli.parent_id == work.span_id and cli.attributes["process.exit.code"] == 0


async def test_tracing_cancelled_request_ends_every_span_as_cancelled(traced: Traced) -> None:
    gate = traced.gated.gate
    assert gate is not None
    gate.clear()
    trace_id, parent = client_context()
    async with httpx.AsyncClient(base_url=traced.h.url, timeout=10) as client:
        request = client.build_request(
            "POST", "/v1/chat/completions", json=chat("g", stream=True), headers={"traceparent": parent}
        )
        task = asyncio.create_task(client.send(request))
        await traced.gated.wait_for(lambda u: u.in_flight == 1)
        task.cancel()  # the client goes away while the upstream still holds the answer
        with pytest.raises(asyncio.CancelledError):
            await task
    spans = await tree(traced.collector, trace_id, "POST", "iop.attempt", "iop.node.work", "chat")
    gate.set()
    root = one(spans, "POST")
    assert root.attributes["iop.cancelled"] is True and root.attributes["http.response.status_code"] == 499
    assert one(spans, "iop.node.work").attributes["iop.outcome"] == "cancelled"
    assert one(spans, "iop.attempt").attributes["error.type"] == "cancelled"


async def test_tracing_spans_hold_no_prompt_or_answer(traced: Traced) -> None:
    # Every request of this module had SECRET in its prompt; the fake's answers are "w0 w1 w2".
    trace_id, parent = client_context()
    await traced.http.post("/v1/chat/completions", json=chat("m"), headers={"traceparent": parent})
    await tree(traced.collector, trace_id, "POST", "chat")
    raw = b"".join(traced.collector.raw)
    assert traced.collector.posts > 0 and SECRET.encode() not in raw and b"w0 w1 w2" not in raw
    assert b"Bearer" not in raw


async def test_tracing_trace_id_is_in_the_record_the_access_log_and_the_exemplars(
    traced: Traced, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "iop.access")
    trace_id, parent = client_context()
    r = await traced.http.post("/v1/chat/completions", json=chat("m"), headers={"traceparent": parent})
    assert r.status_code == 200
    await tree(traced.collector, trace_id, "POST")
    (line,) = [x for x in caplog.records if x.name == "iop.access" and r.headers["x-request-id"] in x.getMessage()]
    assert line.getMessage().endswith(f"trace={trace_id}")
    assert line.fields["trace_id"] == trace_id  # type: ignore[attr-defined]
    # The record the ledger and `iop usage --tail` get carries it too (the same RequestRecord).
    assert record_line({"start": 0, "id": "req_x", "status": 200, "duration_ms": 1.0, "trace_id": trace_id}).endswith(
        f"trace={trace_id}"
    )
    # An OpenMetrics scrape links the latency buckets to traces; the plain text format stays as it was.
    om = await traced.http.get("/metrics", headers={"accept": "application/openmetrics-text; version=1.0.0"})
    assert om.headers["content-type"].startswith("application/openmetrics-text")
    exemplars = [x for x in om.text.splitlines() if x.startswith("iop_request_duration_seconds_bucket") and "#" in x]
    assert any(f'trace_id="{trace_id}"' in x for x in exemplars)
    plain = await traced.http.get("/metrics")
    assert plain.headers["content-type"].startswith("text/plain") and "trace_id" not in plain.text


async def test_tracing_dead_collector_costs_only_dropped_spans(traced: Traced) -> None:
    dead = f"http://127.0.0.1:{free_port()}/v1/traces"  # nothing listens there
    # A second edge of the same deployment (so the nodes keep serving), exporting to nowhere.
    dep = traced.h.edge.current.deployment
    tracing = msgspec.structs.replace(dep.tracing, endpoint=dead)
    async with running_edge(msgspec.structs.replace(dep, tracing=tracing), traced.nats_url) as h:
        await h.edge.registry.wait_connected(["n-good"], timeout_s=10)
        async with h.http() as http:
            for _ in range(3):
                r = await http.post("/v1/chat/completions", json=chat("m"))
                assert r.status_code == 200
            # Each request leaves its spans (request, queue, attempt): all dropped.
            await eventually(lambda: _true(h.edge.tracing.dropped >= 3 * 3))
            assert h.edge.tracing.exported == 0
            metrics = (await http.get("/metrics")).text
            line = next(x for x in metrics.splitlines() if x.startswith("iop_trace_spans_dropped_total"))
            assert float(line.split()[-1]) >= 9


async def test_tracing_off_starts_no_exporter_thread() -> None:
    """Off costs nothing in the background; on (an endpoint nobody serves) the exporter's thread runs."""
    code = (
        "import sys, threading\n"
        "from iop.tracingconf import TracingSettings\n"
        "from iop.tracing import Tracing\n"
        "import iop.edge.app, iop.node.runtime\n"
        "env = {'OTEL_EXPORTER_OTLP_ENDPOINT': 'http://127.0.0.1:9'} if sys.argv[1] == 'on' else {}\n"
        "t = Tracing(TracingSettings(), 'iop-edge', env=env)\n"
        "print(t.on, sorted(th.name for th in threading.enumerate() if th is not threading.main_thread()))\n"
        "t.shutdown(1.0)\n"
    )
    seen = []
    for mode in ("off", "on"):
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", code, mode, stdout=asyncio.subprocess.PIPE)
        async with asyncio.timeout(60):
            out, _ = await proc.communicate()
        assert proc.returncode == 0
        seen.append(out.decode().strip())
    assert seen == ["False []", "True ['iop-trace-export']"]


async def test_tracing_settings_follow_the_otel_variables() -> None:
    file = TracingSettings(endpoint="http://file:4318/v1/traces", sample_ratio=0.5, service_name="svc")
    assert Tracing(TracingSettings(), "iop-edge", env={}).on is False
    t = Tracing(
        file, "iop-edge", env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://env:4318/", "OTEL_TRACES_SAMPLER_ARG": "0.1"}
    )
    assert (t.endpoint, t.ratio, t.service) == ("http://env:4318/v1/traces", 0.1, "svc")
    t.shutdown()
    env = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://sig:1/x", "OTEL_SERVICE_NAME": "mine"}
    t = Tracing(file, "iop-edge", env={**env, "OTEL_TRACES_SAMPLER_ARG": "2"})
    assert (t.endpoint, t.ratio, t.service) == ("http://sig:1/x", 0.5, "mine")
    t.shutdown()


async def test_tracing_export_sends_the_collectors_headers_gzipped_as_the_otel_variables_say() -> None:
    env = {
        "OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer%20tok,x-team=a",
        "OTEL_EXPORTER_OTLP_COMPRESSION": "gzip",
    }
    async with otlp_collector() as collector:
        t = Tracing(TracingSettings(endpoint=collector.url, export_interval_ms=20), "iop-edge", env=env)
        root = t.server_span("POST /v1/chat/completions", NEW, {"iop.request_id": "req_1"})
        t.child(root, "iop.queue").end()
        root.end()
        await collector.wait_for(lambda c: len(c.spans) == 2)
        await asyncio.to_thread(t.shutdown)
    sent = collector.headers[0]
    assert sent["authorization"] == "Bearer tok" and sent["x-team"] == "a"
    assert sent["content-encoding"] == "gzip" and sent["content-type"] == "application/x-protobuf"
    queue = next(s for s in collector.spans if s.name == "iop.queue")
    assert queue.parent_id == next(s.span_id for s in collector.spans if s.kind == SERVER)
    assert t.exported == 2 and t.dropped == 0


@pytest.mark.parametrize(
    "framing", [b"content-length: 60000\r\n", b"connection: close\r\n"], ids=["kept-alive", "closing"]
)
async def test_tracing_export_to_a_collector_that_never_ends_its_answer_ends_within_its_timeout(framing: bytes) -> None:
    """A collector that says 200 and then sends its body a byte at a time, for ever (or a body of any
    size): each export still ends within `export_timeout_s`, holding at most a small part of the body."""
    dripping = asyncio.Event()
    stop = asyncio.Event()

    async def drip(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(x.split(b":")[1]) for x in head.split(b"\r\n") if x.lower().startswith(b"content-length"))
        await reader.readexactly(length)
        writer.write(b"HTTP/1.1 200 OK\r\n" + framing + b"content-type: application/x-protobuf\r\n\r\n")
        dripping.set()
        with contextlib.suppress(OSError):
            while not stop.is_set() and not writer.is_closing():
                writer.write(b"x")
                await writer.drain()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 0.05)  # one byte each 50 ms: never a read timeout
        writer.close()

    server = await asyncio.start_server(drip, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    settings = TracingSettings(
        endpoint=f"http://127.0.0.1:{port}/v1/traces", export_interval_ms=10, export_timeout_s=0.5
    )
    t = Tracing(settings, "iop-edge", env={})
    try:
        for n in (1, 2):
            t.server_span("POST /v1/chat/completions", NEW, {}).end()
            await eventually(lambda: _true(t.exported + t.dropped == n), timeout_s=15)  # noqa: B023 (awaited here)
        assert dripping.is_set()
    finally:
        stop.set()
        await asyncio.to_thread(t.shutdown)
        server.close()
        await server.wait_closed()


async def test_tracing_export_leaves_out_a_header_http_cannot_carry_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A value with a line break or beyond Latin-1 (after URL-decoding) cannot be sent: that header
    is left out with a warning, and the spans still go (before, the export thread died on it)."""
    env = {"OTEL_EXPORTER_OTLP_HEADERS": "x-ok=a,x-snowman=%E2%98%83,x-split=a%0D%0Ab,bad name=c"}
    async with otlp_collector() as collector:
        with caplog.at_level(logging.WARNING, "iop.tracing"):
            t = Tracing(TracingSettings(endpoint=collector.url, export_interval_ms=20), "iop-edge", env=env)
        t.server_span("POST /v1/chat/completions", NEW, {}).end()
        await collector.wait_for(lambda c: len(c.spans) == 1)
        await asyncio.to_thread(t.shutdown)
    sent = collector.headers[0]
    assert sent["x-ok"] == "a" and not {"x-snowman", "x-split", "bad name"} & set(sent)
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert all(name in warned for name in ("x-snowman", "x-split", "bad name")) and "\u2603" not in warned


async def test_tracing_unusual_attribute_values_reach_the_collector_as_they_are() -> None:
    """What OTLP's protobuf can hold is sent as such (non-ASCII text, negative and 64-bit ints, bools,
    nested lists, empty ones); an int past 64 bits, which no int64 holds, goes as its digits, not wrapped."""
    values: dict[str, Any] = {
        "text": "h\u00e9llo \u2603 \U0001f600",
        "empty": "",
        "long": "x" * 300,
        "negative": -5,
        "int64_min": -(2**63),
        "int64_max": 2**63 - 1,
        "uint64": 2**63,
        "huge": 2**70,
        "very_negative": -(2**70),
        "yes": True,
        "no": False,
        "real": -1.5,
        "nested": [1, "a", [True, 2.5]],
        "none_inside": [],
        "k\u00e9y": "v",
    }
    async with otlp_collector() as collector:
        t = Tracing(TracingSettings(endpoint=collector.url, export_interval_ms=20), "iop-edge", env={})
        t.server_span("POST /v1/chat/completions", NEW, dict(values)).end()
        await collector.wait_for(lambda c: len(c.spans) == 1)
        await asyncio.to_thread(t.shutdown)
    seen = collector.spans[0].attributes
    expected = {**values, "uint64": str(2**63), "huge": str(2**70), "very_negative": str(-(2**70))}
    assert seen == expected


async def test_tracing_a_batch_that_cannot_be_encoded_is_dropped_and_the_export_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Whatever fails in making a batch (here an attribute named by no string) loses that batch,
    counted and said once; the export thread lives on and sends the next one."""
    async with otlp_collector() as collector:
        t = Tracing(TracingSettings(endpoint=collector.url, export_interval_ms=20), "iop-edge", env={})
        with caplog.at_level(logging.ERROR, "iop.tracing"):
            bad = t.server_span("POST /v1/chat/completions", NEW, {})
            bad.attributes[7] = "x"  # type: ignore[index]
            bad.end()
            await eventually(lambda: _true(t.dropped == 1))
        t.server_span("POST /v1/chat/completions", NEW, {}).end()
        await collector.wait_for(lambda c: len(c.spans) == 1)
        await asyncio.to_thread(t.shutdown)
    assert t.exported == 1 and t.pending == 0
    assert sum("not exported" in r.getMessage() for r in caplog.records) == 1
