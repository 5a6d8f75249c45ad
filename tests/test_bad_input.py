"""Bad input gets an OpenAI-style error with the right status, and the edge serves on unharmed."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from iop import config, wire
from iop.errors import BadRequest
from iop.nats.server import EmbeddedNats
from iop.node.adapters.openai import OpenAIAdapter
from tests.harness import deployment, deployment_running

YAML = """
edge: {max_body_mb: 1}
models:
  - alias: sim
    pool: [sim-1]
nodes:
  - id: n1
    adapters: [{id: sim, type: mock, latency_ms: 0, tokens: 2, token_interval_ms: 0}]
    providers: [{id: sim-1, adapter: sim, capacity: 4}]
"""


@pytest.fixture(scope="module")
def edge_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real edge + node + nats-server, served from a background event loop for sync clients."""
    ready: dict[str, Any] = {}
    started = threading.Event()
    loop = asyncio.new_event_loop()

    async def main(stop: asyncio.Event) -> None:
        server = EmbeddedNats("127.0.0.1:0", Path(tmp_path_factory.mktemp("nats")))
        await server.start()
        try:
            async with deployment_running(deployment(YAML), server.url) as h:
                ready["url"] = h.url
                started.set()
                await stop.wait()
        finally:
            await server.stop()

    stop = asyncio.Event()
    thread = threading.Thread(target=lambda: loop.run_until_complete(main(stop)), daemon=True)
    thread.start()
    assert started.wait(30), "edge did not start"
    try:
        yield ready["url"]
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(30)
        loop.close()


GOOD = {"model": "sim", "messages": [{"role": "user", "content": "hi"}]}


def _error(r: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err: dict[str, Any] = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    if code is not None:
        assert err["code"] == code
    return err


CASES = [
    ("malformed json", b'{"model": "sim", "messages": [', 400, "invalid_json"),
    ("array body", b"[1, 2, 3]", 400, "invalid_request"),
    ("scalar body", b"42", 400, "invalid_request"),
    ("missing model", json.dumps({"messages": GOOD["messages"]}).encode(), 400, "invalid_request"),
    ("model not a string", json.dumps({**GOOD, "model": 7}).encode(), 400, "invalid_request"),
    ("stream not a boolean", json.dumps({**GOOD, "stream": "yes"}).encode(), 400, "invalid_request"),
    ("messages not a list", json.dumps({**GOOD, "messages": "hi"}).encode(), 400, "invalid_request"),
    ("message without role", json.dumps({**GOOD, "messages": [{"content": "x"}]}).encode(), 400, "invalid_request"),
    ("empty messages", json.dumps({**GOOD, "messages": []}).encode(), 400, "invalid_request"),
    ("invalid utf-8", b'{"model": "sim", "messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, "invalid_json"),
    ("unknown model", json.dumps({**GOOD, "model": "nope"}).encode(), 404, "model_not_found"),
    (
        "content nested 5000 deep",
        b'{"model": "sim", "messages": [{"role": "user", "content": ' + b"[" * 5000 + b"]" * 5000 + b"}]}",
        400,
        "invalid_json",
    ),
    ("messages nested 5000 deep", b'{"model": "sim", "messages": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, None),
]


@pytest.mark.parametrize(("name", "body", "status", "code"), CASES, ids=[c[0] for c in CASES])
def test_bad_chat_bodies_get_openai_errors(
    edge_url: str, name: str, body: bytes, status: int, code: str | None
) -> None:
    with httpx.Client(base_url=edge_url) as http:
        r = http.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
        _error(r, status, code)
        assert http.post("/v1/chat/completions", json=GOOD).status_code == 200  # still serving


@pytest.mark.parametrize(
    "body",
    [
        {"model": "sim"},
        {"model": "sim", "input": 5},
        {"model": "sim", "input": [1, 2]},
        {"model": "sim", "input": None},
    ],
)
def test_bad_responses_bodies_get_openai_errors(edge_url: str, body: dict[str, Any]) -> None:
    with httpx.Client(base_url=edge_url) as http:
        err = _error(http.post("/v1/responses", json=body), 400, "invalid_request")
        assert err["param"].startswith("input")


WRONG_TYPES = [
    ("/v1/chat/completions", {**GOOD, "tools": 1}, "tools"),
    ("/v1/chat/completions", {**GOOD, "tools": "f"}, "tools"),
    ("/v1/chat/completions", {**GOOD, "messages": [{"role": "assistant", "tool_calls": 1}]}, "messages[0].tool_calls"),
    (
        "/v1/chat/completions",
        {**GOOD, "messages": [{"role": "assistant", "tool_calls": [{"function": 1}]}]},
        "messages[0].tool_calls[0].function",
    ),
    ("/v1/responses", {"model": "sim", "input": "hi", "tools": 1}, "tools"),
    ("/v1/responses", {"model": "sim", "input": "hi", "tools": [1]}, "tools[0]"),
    ("/v1/responses", {"model": "sim", "input": "hi", "include": 1}, "include"),
    ("/v1/responses", {"model": "sim", "input": "hi", "include": [1]}, "include[0]"),
    ("/v1/responses", {"model": "sim", "input": [{"type": 1}]}, "input[0].type"),
]


def test_wrongly_typed_fields_are_400_naming_the_param_and_never_count_against_the_provider(edge_url: str) -> None:
    # Before: 502 node_error from the node's translation or the mock's writer, each counted as the
    # provider's failure: three of them opened the breaker of every provider they reached.
    with httpx.Client(base_url=edge_url) as http:
        for _ in range(3):
            for path, body, param in WRONG_TYPES:
                err = _error(http.post(path, json=body), 400, "invalid_request")
                assert err["param"] == param, (path, body, err)
        sim = next(p for n in http.get("/status").json()["nodes"] for p in n["providers"] if p["id"] == "sim-1")
        assert (sim["breaker"], sim["consecutive_failures"], sim["failed"]) == ("closed", 0, 0)
        assert http.post("/v1/chat/completions", json=GOOD).status_code == 200
        ok = {
            "model": "sim",
            "input": [{"type": "message", "role": "user", "content": "hi"}],
            "tools": [],
            "include": [],
        }
        assert http.post("/v1/responses", json=ok).status_code == 200


@pytest.mark.parametrize(
    ("api", "body"),
    [
        ("responses", {"model": "m", "input": "hi", "include": 1}),
        ("chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": 1}),
    ],
)
async def test_a_body_the_translation_cannot_read_is_a_400_on_the_node(api: wire.Api, body: dict[str, Any]) -> None:
    # Past the edge's checks (an older edge, a field it does not know): the node must still say it
    # is the request's fault. Before: TypeError, 502 node_error, counted against the provider.
    # An upstream of the other API: the request is translated (nothing listens at port 9).
    upstream_api: Literal["chat", "responses"] = "responses" if api == "chat" else "chat"
    adapter = OpenAIAdapter(config.OpenAIAdapter(id="up", base_url="http://127.0.0.1:9/v1", api=upstream_api))
    item = wire.WorkItem(
        id="r1", api=api, stream=False, alias="m", body=json.dumps(body).encode(), reply_to="", deadline=0
    )
    with pytest.raises(BadRequest) as refused:
        await adapter.run(item, None, _never_sent)
    assert refused.value.status == 400 and "TypeError" in refused.value.message
    await adapter.close()


async def _never_sent(data: bytes, headers: Mapping[str, str] | None = None) -> None:
    raise AssertionError("nothing may be sent for a refused request")


def test_wrong_content_type_is_415(edge_url: str) -> None:
    with httpx.Client(base_url=edge_url) as http:
        r = http.post("/v1/chat/completions", content=json.dumps(GOOD), headers={"content-type": "text/plain"})
        _error(r, 415, "unsupported_media_type")
        ok = http.post(
            "/v1/chat/completions",
            content=json.dumps(GOOD),
            headers={"content-type": "application/json; charset=utf-8"},
        )
        assert ok.status_code == 200


def test_body_over_the_limit_is_413(edge_url: str) -> None:
    with httpx.Client(base_url=edge_url) as http:
        big = {**GOOD, "messages": [{"role": "user", "content": "x" * (1024 * 1024)}]}
        _error(http.post("/v1/chat/completions", json=big), 413, "request_too_large")
        fits = {**GOOD, "messages": [{"role": "user", "content": "x" * (1000 * 1024)}]}
        assert http.post("/v1/chat/completions", json=fits).status_code == 200


def test_unknown_path_and_wrong_method_are_json(edge_url: str) -> None:
    with httpx.Client(base_url=edge_url) as http:
        _error(http.get("/v1/nothing"), 404, "not_found")
        _error(http.get("/v1/chat/completions"), 405, "method_not_allowed")
        _error(http.post("/v1/models"), 405, "method_not_allowed")


def test_http_a_405_names_the_allowed_methods_and_its_access_line_what_was_asked(
    edge_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="iop.access")
    asked_logged = threading.Event()  # the edge writes its access line after the answer has gone out

    class _Asked(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.name == "iop.access" and record.getMessage().startswith("asked-1 "):
                asked_logged.set()

    # On the root logger after caplog's handler: a record reaches it once caplog holds it too (on
    # iop.access itself it ran first, and the edge's thread could still be on the way to caplog).
    watcher = _Asked()
    logging.getLogger().addHandler(watcher)
    try:
        _ask_405s(edge_url)
        assert asked_logged.wait(10), "no access line for the request asked-1"
    finally:
        logging.getLogger().removeHandler(watcher)
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "iop.access"]
    assert any(line.startswith("asked-1 GET /v1/chat/completions - -/- 405 ") for line in lines), lines


def _ask_405s(edge_url: str) -> None:
    with httpx.Client(base_url=edge_url) as http:
        for method, path, allowed in (
            ("GET", "/v1/chat/completions", {"POST"}),
            ("DELETE", "/v1/responses", {"POST"}),
            ("POST", "/v1/models", {"GET", "HEAD"}),
            ("GET", "/admin/refresh", {"POST"}),
        ):
            r = http.request(method, path)
            _error(r, 405, "method_not_allowed")
            assert {m.strip() for m in r.headers["allow"].split(",")} == allowed, (method, path, r.headers)
        r = http.get("/v1/chat/completions", headers={"x-request-id": "asked-1"})
        _error(r, 405, "method_not_allowed")


def _nested(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    _nested,
    max_leaves=12,
)
request_like = st.fixed_dictionaries(
    {},
    optional={
        "model": st.sampled_from(["sim", "nope"]) | json_values,
        "stream": st.booleans() | json_values,
        "messages": st.lists(
            st.fixed_dictionaries({"role": st.text(max_size=8)}, optional={"content": json_values}), max_size=3
        )
        | json_values,
        "input": st.text(max_size=20) | json_values,
    },
)
raw_bodies = (
    st.binary(max_size=200)
    | request_like.map(lambda d: json.dumps(d).encode())
    | json_values.map(lambda v: json.dumps(v).encode())
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=raw_bodies, path=st.sampled_from(["/v1/chat/completions", "/v1/responses"]))
def test_fuzzed_bodies_get_only_2xx_or_4xx_json(edge_url: str, body: bytes, path: str) -> None:
    with httpx.Client(base_url=edge_url, timeout=10) as http:
        r = http.post(path, content=body, headers={"content-type": "application/json"})
        assert r.status_code < 500, r.text
        if r.status_code >= 400:
            _error(r, r.status_code)
        elif r.headers["content-type"].startswith("application/json"):
            r.json()


def test_models_retrieve_answers_each_alias_and_404s_an_unknown_one(edge_url: str) -> None:
    client = openai.OpenAI(base_url=edge_url + "/v1", api_key="test", max_retries=0)
    try:
        model = client.models.retrieve("sim")
        assert (model.id, model.object, model.owned_by) == ("sim", "model", "iop")
        with pytest.raises(openai.NotFoundError) as caught:
            client.models.retrieve("nope")
        assert caught.value.code == "model_not_found"
    finally:
        client.close()
