"""Security, attacked for real: client keys, NATS credentials and TLS, the CLI adapter, duplicate node ids."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import nats
import nats.errors
import openai
import pytest
import yaml
from nats.aio.client import Client as NATS

from iop import config, wire
from iop.contracts.usage import parse_query
from iop.edge.app import build_app
from iop.edge.keys import EdgeKeys, parse_keys
from iop.edge.ledger import LEDGER_STREAM, RequestRecord
from iop.edge.usage_query import read_records
from iop.errors import BusError, ConfigError, Unauthorized
from iop.nats import connection
from iop.nats.access import SECRET_FILE, Credentials, NatsAccess
from iop.nats.server import EmbeddedNats
from iop.node import policy as node_policy
from iop.node.catalog import CatalogSource
from iop.node.runtime import NodeRuntime
from iop.responses.cache import GONE_ROOT, gone_subject
from tests.fakes import fake_upstream
from tests.harness import (
    deployment,
    deployment_running,
    eventually,
    iop_process,
    nats_server_of,
    running_edge,
    running_node,
    until,
)

ROOT = Path(__file__).resolve().parent.parent
KEY = "sk-iop-test-key-5d1e9a"
OTHER_KEY = "sk-iop-test-other-77b0c3"
NATS_SECRET = "nats-secret-2f4c8b"

MOCK_POOL = """
models:
  - alias: sim
    pool: [sim-1]
nodes:
  - id: n1
    adapters: [{id: sim, type: mock, latency_ms: 0, tokens: 3, token_interval_ms: 0}]
    providers: [{id: sim-1, adapter: sim, capacity: 2}]
"""


def _our_log_text(caplog: pytest.LogCaptureFixture) -> str:
    """Every record logged by iop and the servers it runs (not by the test's own HTTP clients)."""
    mine = ("iop", "uvicorn", "nats", "starlette")
    return "\n".join(f"{r.name} {r.getMessage()}" for r in caplog.records if r.name.split(".")[0] in mine)


# --- client keys -------------------------------------------------------------------------------


async def test_client_keys_guard_every_v1_path_and_status_but_not_healthz(
    nats_server: EmbeddedNats, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("IOP_TEST_KEYS", f"{OTHER_KEY}, {KEY}")
    dep = deployment("edge: {api_keys_env: IOP_TEST_KEYS}\n" + MOCK_POOL)
    chat = {"model": "sim", "messages": [{"role": "user", "content": "hi"}]}
    calls = [
        ("POST", "/v1/chat/completions", chat),
        ("POST", "/v1/responses", {"model": "sim", "input": "hi"}),
        ("GET", "/v1/models", None),
        ("GET", "/status", None),
        ("GET", "/status?view=summary", None),
        ("POST", "/v1/messages", {"model": "sim", "max_tokens": 8, "messages": chat["messages"]}),
        ("POST", "/v1/messages/count_tokens", {"model": "sim", "messages": chat["messages"]}),
    ]
    # Served only by upstreams that have them (the mock has not): refused for the key first all the same.
    refused_only = [
        ("POST", "/v1/embeddings", {"model": "sim", "input": "hi"}),
        ("POST", "/v1/completions", {"model": "sim", "prompt": "hi"}),
    ]
    wrong = [
        {},
        {"Authorization": "Bearer sk-iop-wrong"},
        {"Authorization": f"Bearer {KEY[:-1]}"},  # a prefix of a real key
        {"Authorization": f"Basic {KEY}"},
        {"Authorization": KEY},
        {"x-api-key": "sk-iop-wrong"},  # Anthropic's header: the same keys
        {"x-api-key": KEY[:-1]},
        {"x-api-key": f"Bearer {KEY}"},
    ]
    async with deployment_running(dep, nats_server.url) as h, h.http() as http:
        for method, path, body in calls + refused_only:
            for headers in wrong:
                r = await http.request(method, path, json=body, headers=headers)
                assert r.status_code == 401, (path, headers, r.text)
                error = r.json()["error"]
                if path.startswith("/v1/messages"):
                    assert error["type"] == "authentication_error"  # Anthropic's error shape
                else:
                    assert error["code"] == "invalid_api_key"
        assert (await http.get("/healthz")).status_code == 200
        r = await http.post("/v1/messages", json=calls[-2][2], headers={"x-api-key": KEY})
        assert r.status_code == 200 and r.json()["type"] == "message"

        for key in (KEY, OTHER_KEY):
            auth = {"Authorization": f"Bearer {key}"}
            for method, path, body in calls:
                r = await http.request(method, path, json=body, headers=auth)
                assert r.status_code == 200, (path, r.text)
            status = (await http.get("/status", headers=auth)).text
            assert KEY not in status and OTHER_KEY not in status
            assert "IOP_TEST_KEYS" not in status

        client = h.client(api_key=KEY)
        answer = await client.chat.completions.create(model="sim", messages=[{"role": "user", "content": "hi"}])
        assert answer.choices[0].message.content
        events = [e async for e in await client.responses.create(model="sim", input="hi", stream=True)]
        assert events[-1].type == "response.completed"
        refused = h.client(api_key="sk-iop-wrong")
        with pytest.raises(openai.AuthenticationError):
            await refused.chat.completions.create(model="sim", messages=[{"role": "user", "content": "hi"}])

    logged = _our_log_text(caplog)
    assert "sim-1" in logged or "n1" in logged  # the capture did see the edge and node at work
    assert KEY not in logged and OTHER_KEY not in logged


# --- administrators are not clients ------------------------------------------------------------------


async def test_admin_refresh_needs_an_admin_key_and_a_client_key_gets_403(
    nats_server: EmbeddedNats, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    monkeypatch.setenv("IOP_TEST_KEYS", KEY)
    monkeypatch.setenv("IOP_TEST_ADMIN_KEYS", f"ops-alice:{OTHER_KEY}")
    text = "edge: {api_keys_env: IOP_TEST_KEYS, admin_keys_env: IOP_TEST_ADMIN_KEYS}\n" + MOCK_POOL
    dep = deployment(text)
    bigger = text.replace("capacity: 2", "capacity: 3")
    async with deployment_running(dep, nats_server.url) as h, h.http() as http:
        client = {"Authorization": f"Bearer {KEY}"}
        r = await http.post("/admin/refresh", content=bigger, headers=client)
        assert r.status_code == 403, r.text
        assert r.json()["error"]["code"] == "not_admin"
        for headers in ({}, {"Authorization": "Bearer sk-iop-wrong"}):
            r = await http.post("/admin/refresh", content=bigger, headers=headers)
            assert r.status_code == 401, r.text
        assert h.edge.scheduler.providers["sim-1"].capacity == 2  # nothing was applied
        # An admin key is not a client key either.
        r = await http.get("/status", headers={"Authorization": f"Bearer {OTHER_KEY}"})
        assert r.status_code == 401

        r = await http.post("/admin/refresh", content=bigger, headers={"Authorization": f"Bearer {OTHER_KEY}"})
        assert r.status_code == 200, r.text
        assert r.json()["error"] is None and r.json()["changes"]
        assert h.edge.scheduler.providers["sim-1"].capacity == 3
    logged = _our_log_text(caplog)
    assert "admin refresh by ops-alice (127.0.0.1): 1 changes" in logged
    assert KEY not in logged and OTHER_KEY not in logged


async def test_without_admin_keys_admin_endpoints_answer_only_loopback_peers(
    nats_server: EmbeddedNats, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("IOP_TEST_KEYS", KEY)
    text = "edge: {api_keys_env: IOP_TEST_KEYS, allowed_hosts: [iop.test]}\n" + MOCK_POOL
    dep = deployment(text)
    async with deployment_running(dep, nats_server.url) as h:
        app = build_app(h.edge)
        auth = {"Authorization": f"Bearer {KEY}"}
        # The same app, reached from another machine's address (the ASGI scope's client).
        remote = httpx.AsyncClient(
            transport=httpx.ASGITransport(app, client=("192.0.2.7", 50000)), base_url="http://192.0.2.1"
        )
        async with remote:
            r = await remote.post("/admin/refresh?dry_run=1", content=text, headers=auth)
            assert r.status_code == 403, r.text
            assert r.json()["error"]["code"] == "admin_only_loopback"
            assert (await remote.get("/status", headers=auth)).status_code == 200  # the client key still works
        async with h.http() as local:
            # A loopback peer asking for another host: a reverse proxy passing on its clients' Host,
            # or a browser sent by a page on a re-pointed name (which the Host check stops first).
            for host, code in (("iop.test", "admin_only_loopback"), ("evil.test", "host_not_allowed")):
                r = await local.post("/admin/refresh?dry_run=1", content=text, headers={"host": host})
                assert r.status_code == 403 and r.json()["error"]["code"] == code, (host, r.text)
            r = await local.post("/admin/refresh?dry_run=1", content=text)
            assert r.status_code == 200, r.text


# --- the deployment file's NATS security rules ---------------------------------------------------


def _nats_problems(nats_settings: dict[str, object], edge_listen: str = "127.0.0.1:8080") -> list[str]:
    data = yaml.safe_load(MOCK_POOL)
    data["edge"] = {"listen": edge_listen, "nats": nats_settings}
    try:
        config.parse(yaml.safe_dump(data))
    except ConfigError as exc:
        return exc.problems
    return []


@pytest.mark.parametrize(
    ("nats_settings", "expected"),
    [
        (
            {"token_env": "T"},
            "edge.nats.token_env: the embedded server gives each node its own user, and one token cannot say "
            "which node: use user_env/password_env (each node's machine sets its own, see `iop nats-creds`)",
        ),
        ({"user_env": "U"}, "edge.nats.password_env: missing: user_env is set"),
        ({"password_env": "P"}, "edge.nats.user_env: missing: password_env is set"),
        (
            {"url": "nats://h:4222", "user_env": "U", "password_env": "P", "token_env": "T"},
            "edge.nats.token_env: use user_env/password_env or token_env, not both",
        ),
        ({"tls_ca": "ca.pem"}, "edge.nats.tls_ca: applies to an external NATS (url: tls://...)"),
        ({"url": "tls://h:4222", "tls_cert": "c.pem"}, "edge.nats.tls_key: missing: tls_cert is set"),
        ({"url": "tls://h:4222", "tls_key": "k.pem"}, "edge.nats.tls_cert: missing: tls_key is set"),
        (
            {"url": "nats://h:4222", "token_env": "has-dash"},
            "edge.nats.token_env: 'has-dash' is not an environment variable name",
        ),
    ],
)
def test_config_nats_security_rules(nats_settings: dict[str, object], expected: str) -> None:
    found = _nats_problems(nats_settings)
    assert len(found) == 1 and found[0].startswith(expected), found


@pytest.mark.parametrize(
    "nats_settings",
    [
        {"listen": "127.0.0.1:4222"},
        {"listen": "localhost:4222"},
        {"listen": "[::1]:4222"},
        {"listen": "0.0.0.0:4222"},  # the embedded server always requires each node's own credential
        {"listen": "10.0.0.5:4222", "user_env": "U", "password_env": "P"},
        {"url": "nats://nats.lan:4222", "token_env": "T"},
        {"url": "tls://nats.lan:4222", "listen": "0.0.0.0:4222", "tls_ca": "ca.pem"},  # listen unused
        {"url": "tls://nats.lan:4222", "tls_ca": "ca.pem", "tls_cert": "c.pem", "tls_key": "k.pem"},
    ],
)
def test_config_nats_security_accepts(nats_settings: dict[str, object]) -> None:
    assert _nats_problems(nats_settings) == []


def test_config_refuses_an_open_http_listen_without_keys_unless_anonymous_is_explicit() -> None:
    data = yaml.safe_load(MOCK_POOL)
    data["edge"] = {"listen": "0.0.0.0:8080"}
    with pytest.raises(ConfigError) as info:
        config.parse(yaml.safe_dump(data))
    assert info.value.problems == [
        "edge.listen: 0.0.0.0:8080 is not a loopback address and api_keys_env is not set: anyone who reaches "
        "it could use every model; set api_keys_env, or allow_anonymous: true if that is meant"
    ]
    data["edge"]["allow_anonymous"] = True
    assert config.parse(yaml.safe_dump(data)).warnings == [
        "edge.allow_anonymous: 0.0.0.0:8080 is not a loopback address and api_keys_env is not set: "
        "anyone who reaches it can use every model"
    ]
    data["edge"] = {"listen": "0.0.0.0:8080", "api_keys_env": "IOP_KEYS"}
    assert config.parse(yaml.safe_dump(data)).warnings == []


def test_keys_are_named_entries_and_a_named_variable_without_keys_fails_closed() -> None:
    keys = parse_keys(f" {KEY} , ops:{OTHER_KEY},, ", "admin")
    assert [(k.name, k.secret) for k in keys] == [("admin-1", KEY.encode()), ("ops", OTHER_KEY.encode())]
    assert KEY not in repr(keys)
    settings = config.EdgeSettings(api_keys_env="IOP_K", admin_keys_env="IOP_A")
    for env, line in [
        ({"IOP_A": KEY}, "edge.api_keys_env: environment variable IOP_K is not set"),
        ({"IOP_K": "", "IOP_A": KEY}, "edge.api_keys_env: environment variable IOP_K holds no key"),
        ({"IOP_K": " , ", "IOP_A": KEY}, "edge.api_keys_env: environment variable IOP_K holds no key"),
        ({"IOP_K": KEY, "IOP_A": ",,"}, "edge.admin_keys_env: environment variable IOP_A holds no key"),
    ]:
        with pytest.raises(ConfigError) as info:
            EdgeKeys.from_settings(settings, env)
        assert len(info.value.problems) == 1 and info.value.problems[0].startswith(line), info.value.problems
    both = EdgeKeys.from_settings(settings, {"IOP_K": KEY, "IOP_A": f"root:{OTHER_KEY}"})
    assert [k.name for k in both.clients] == ["client-1"] and [k.name for k in both.admins] == ["root"]


def test_a_thousand_client_keys_each_find_their_own_name_and_near_misses_are_refused() -> None:
    keys = parse_keys(",".join(f"t{i}:sk-{i:04d}-{'x' * 24}" for i in range(1000)) + ",again:sk-0007-" + "x" * 24, "c")
    edge = EdgeKeys(clients=keys, admins=[])

    def bearer(secret: str) -> dict[str, object]:
        return {"headers": [(b"authorization", f"Bearer {secret}".encode())]}

    for i in (0, 7, 999):
        key = edge.client(bearer(f"sk-{i:04d}-{'x' * 24}"))
        assert key is not None and key.name == f"t{i}"  # t7, not "again": the first of equal secrets
    for wrong in (f"sk-0007-{'x' * 23}y", f"sk-0007-{'x' * 23}", ""):
        with pytest.raises(Unauthorized):
            edge.client(bearer(wrong))


def test_nats_access_reads_secrets_from_the_named_variables_only() -> None:
    settings = config.NatsSettings(user_env="IOP_U", password_env="IOP_P")
    access = NatsAccess.from_settings(settings, {"IOP_U": "iop", "IOP_P": NATS_SECRET})
    assert (access.user, access.password, access.has_credentials) == ("iop", NATS_SECRET, True)
    assert NATS_SECRET not in repr(access)
    with pytest.raises(BusError, match=r"^edge\.nats\.password_env: environment variable IOP_P is not set"):
        NatsAccess.from_settings(settings, {"IOP_U": "iop"})
    with pytest.raises(BusError, match="control characters"):
        NatsAccess.from_settings(config.NatsSettings(token_env="T"), {"T": "a\nb"})
    assert not NatsAccess.from_settings(config.NatsSettings(), {}).has_credentials


# --- the embedded server's credentials -----------------------------------------------------------


async def test_embedded_nats_requires_credentials_on_loopback_too(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    server = EmbeddedNats("127.0.0.1:0", tmp_path / "nats", nodes=deployment(MOCK_POOL).nodes)
    await server.start()
    conf_dir = server._conf_dir
    secret_file = tmp_path / "nats" / SECRET_FILE
    edge_password = server.access.password
    assert edge_password is not None
    try:
        assert conf_dir is not None
        assert (conf_dir.stat().st_mode & 0o777, (conf_dir / "nats.conf").stat().st_mode & 0o777) == (0o700, 0o600)
        assert secret_file.stat().st_mode & 0o777 == 0o600

        # The real nats-server itself says no, to a plain nats-py client on loopback.
        for token, user, password in ((None, None, None), ("guess", None, None), (None, "iop-edge", "guess")):
            plain = NATS()
            try:
                with pytest.raises(nats.errors.Error, match="Authorization Violation"):
                    await plain.connect(
                        server.address,
                        allow_reconnect=False,
                        connect_timeout=2,
                        token=token,
                        user=user,
                        password=password,
                    )
            finally:
                await plain.close()  # a refused first connect leaves nats-py's socket open otherwise

        # iop's own connect fails at once with one line, rather than retrying forever.
        for who in (None, NatsAccess(user="iop-node-n1", password="guess")):
            with pytest.raises(BusError) as info:
                await connection.connect(server.address, "intruder", access=who, wait_s=10)
            assert "\n" not in str(info.value)
            assert ("refused our credentials" if who else "requires credentials") in str(info.value)

        for access in (server.access, server.node_access("n1")):
            nc = await connection.connect(server.address, "friend", access=access, wait_s=5)
            await nc.close()
    finally:
        await server.stop()
    assert not conf_dir.exists()  # the passwords do not outlive the server
    # A second start on the same store keeps the deployment's credentials.
    assert Credentials.load(tmp_path / "nats").edge().password == edge_password
    logged = _our_log_text(caplog)
    assert "authentication error" in logged  # the server's refusals were seen ...
    assert edge_password not in logged and secret_file.read_text().strip() not in logged  # ... and no secret


# --- `iop edge` / `iop node` as processes ---------------------------------------------------------


def _write_deployment(tmp_path: Path, edge: dict[str, object]) -> Path:
    data = yaml.safe_load(MOCK_POOL)
    data["edge"] = {"listen": "127.0.0.1:0", **edge}
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


async def test_iop_edge_refuses_an_unset_nats_secret_before_starting_anything(tmp_path: Path) -> None:
    store = tmp_path / "store"
    nats_settings = {"url": "nats://127.0.0.1:1", "token_env": "IOP_TEST_UNSET_TOKEN", "store_dir": str(store)}
    path = _write_deployment(tmp_path, {"nats": nats_settings})
    async with iop_process("edge", "--config", str(path), cwd=tmp_path) as edge:
        assert await edge.exit_code() == 1
    line = "iop: edge.nats.token_env: environment variable IOP_TEST_UNSET_TOKEN is not set (or empty)"
    assert len(edge.stderr) == 1 and edge.stderr[0].startswith(line), edge.stderr
    assert edge.stdout == []
    assert not store.exists()


@pytest.mark.parametrize(
    ("edge", "env", "line"),
    [
        (
            {"api_keys_env": "IOP_TEST_UNSET_KEYS"},
            {},
            "iop: edge.api_keys_env: environment variable IOP_TEST_UNSET_KEYS is not set",
        ),
        (
            {"api_keys_env": "IOP_TEST_KEYS"},
            {"IOP_TEST_KEYS": ""},
            "iop: edge.api_keys_env: environment variable IOP_TEST_KEYS holds no key",
        ),
        (
            {"api_keys_env": "IOP_TEST_KEYS"},
            {"IOP_TEST_KEYS": " , "},
            "iop: edge.api_keys_env: environment variable IOP_TEST_KEYS holds no key",
        ),
        (
            {"admin_keys_env": "IOP_TEST_ADMIN"},
            {"IOP_TEST_ADMIN": ","},
            "iop: edge.admin_keys_env: environment variable IOP_TEST_ADMIN holds no key",
        ),
    ],
    ids=["unset", "empty", "separators", "admin-separators"],
)
async def test_iop_edge_with_a_keys_variable_holding_no_key_exits_2_before_starting_anything(
    tmp_path: Path, edge: dict[str, object], env: dict[str, str], line: str
) -> None:
    store = tmp_path / "store"
    path = _write_deployment(tmp_path, {**edge, "nats": {"listen": "127.0.0.1:0", "store_dir": str(store)}})
    async with iop_process("edge", "--config", str(path), cwd=tmp_path, env=env) as proc:
        assert await proc.exit_code() == 2
    assert len(proc.stderr) == 1 and proc.stderr[0].startswith(line), proc.stderr
    assert not store.exists()


async def test_iop_edge_on_an_open_listen_override_without_client_keys_exits_2(tmp_path: Path) -> None:
    store = tmp_path / "store"
    path = _write_deployment(tmp_path, {"nats": {"listen": "127.0.0.1:0", "store_dir": str(store)}})
    async with iop_process("edge", "--config", str(path), "--listen", "0.0.0.0:0", cwd=tmp_path, env={}) as proc:
        assert await proc.exit_code() == 2
    assert len(proc.stderr) == 1 and "edge.listen: 0.0.0.0:0 is not a loopback address" in proc.stderr[0], proc.stderr
    assert not store.exists()


async def test_edge_and_nodes_as_processes_each_node_with_its_own_nats_credential(tmp_path: Path) -> None:
    path = _write_deployment(
        tmp_path,
        {
            "api_keys_env": "IOP_TEST_KEYS",
            "nats": {
                "listen": "127.0.0.1:0",
                "store_dir": str(tmp_path / "store"),
                "user_env": "IOP_TEST_NATS_USER",
                "password_env": "IOP_TEST_NATS_PASSWORD",
            },
        },
    )
    async with iop_process("edge", "--config", str(path), cwd=tmp_path, env={"IOP_TEST_KEYS": KEY}) as edge:
        m = await edge.wait_line(r"listening on (http://\S+) nats=(\S+)")
        http_url, nats_url = m.group(1), m.group(2)
        assert "@" not in nats_url  # printed without any credential
        # What the operator copies to the node's machine.
        async with iop_process("nats-creds", "--config", str(path), "--node", "n1", cwd=tmp_path) as printed:
            assert await printed.exit_code() == 0
        creds = dict(line.split("=", 1) for line in printed.stdout)
        assert (
            set(creds) == {"IOP_TEST_NATS_USER", "IOP_TEST_NATS_PASSWORD"}
            and creds["IOP_TEST_NATS_USER"] == "iop-node-n1"
        )
        node_args = ("node", "--config", str(path), "--node", "n1", "--nats", nats_url)

        wrong = {**creds, "IOP_TEST_NATS_PASSWORD": "not-the-password"}
        async with iop_process(*node_args, cwd=tmp_path, env=wrong) as intruder:
            assert await intruder.exit_code() != 0
        assert len(intruder.stderr) == 1, intruder.stderr  # one clear line, no traceback
        assert intruder.stderr[0].startswith(f"iop: NATS at {nats_url} refused our credentials")
        assert "$IOP_TEST_NATS_PASSWORD" in intruder.stderr[0] and "not-the-password" not in intruder.stderr[0]

        async with iop_process(*node_args, cwd=tmp_path, env=creds) as node:
            await node.wait_line("iop node n1 serving")
            async with openai.AsyncOpenAI(base_url=http_url + "/v1", api_key=KEY, max_retries=0) as client:
                answer = await client.chat.completions.create(model="sim", messages=[{"role": "user", "content": "hi"}])
            assert answer.choices[0].message.content
            async with httpx.AsyncClient(base_url=http_url) as http:
                assert (await http.get("/v1/models")).status_code == 401
                assert (await http.get("/healthz")).status_code == 200
    password = creds["IOP_TEST_NATS_PASSWORD"]
    for p in (edge, node, intruder):
        text = "\n".join(p.stdout + p.stderr)
        assert password not in text and KEY not in text


# --- TLS to an external NATS ----------------------------------------------------------------------


@asynccontextmanager
async def tls_nats_server(d: Path, *, verify_clients: bool) -> AsyncIterator[str]:
    """A real nats-server that speaks only TLS on a free loopback port; yields its tls:// URL."""
    client_ca = f', ca_file: "{d / "ca.pem"}", verify: true' if verify_clients else ""
    conf = d / f"nats-{int(verify_clients)}.conf"
    conf.write_text(
        f'host: "127.0.0.1"\nport: -1\n'
        f'tls {{ cert_file: "{d / "server.pem"}", key_file: "{d / "server.key"}"{client_ca} }}\n'
    )
    async with nats_server_of(conf) as port:
        yield f"tls://127.0.0.1:{port}"


async def _round_trip(nc: NATS) -> bytes:
    sub = await nc.subscribe("iop.test.tls")
    await nc.publish("iop.test.tls", b"over tls")
    return bytes((await sub.next_msg(timeout=5)).data)


async def _connect(url: str, tls: dict[str, str], wait_s: float = 5) -> NATS:
    """Through the deployment file, as edge and node read it."""
    data = yaml.safe_load(MOCK_POOL)
    data["edge"] = {"nats": {"url": url, **tls}}
    settings = config.parse(yaml.safe_dump(data)).deployment.edge.nats
    access = NatsAccess.from_settings(settings, {})
    return await connection.connect(settings.url, "tls-test", access=access, wait_s=wait_s)


async def test_tls_to_an_external_nats_with_a_ca_file(pki: Path) -> None:
    async with tls_nats_server(pki, verify_clients=False) as url:
        nc = await _connect(url, {"tls_ca": str(pki / "ca.pem")})
        try:
            assert nc.connected_url is not None and nc.connected_url.scheme == "tls"
            assert await _round_trip(nc) == b"over tls"
        finally:
            await nc.close()
        # Without our CA (the system's only) or with another CA, the certificate cannot be verified:
        # one line at once, not a retry loop.
        for tls in ({}, {"tls_ca": str(pki / "other-ca.pem")}):
            with pytest.raises(BusError, match="cannot verify the server's TLS certificate"):
                await _connect(url, tls, wait_s=10)


async def test_tls_client_certificate_for_a_nats_that_verifies_clients(pki: Path) -> None:
    async with tls_nats_server(pki, verify_clients=True) as url:
        ca, cert, key = (str(pki / name) for name in ("ca.pem", "client.pem", "client.key"))
        nc = await _connect(url, {"tls_ca": ca, "tls_cert": cert, "tls_key": key})
        try:
            assert await _round_trip(nc) == b"over tls"
        finally:
            await nc.close()
        with pytest.raises(BusError, match="refused the TLS handshake with no client certificate"):
            await _connect(url, {"tls_ca": ca}, wait_s=10)
    with pytest.raises(BusError, match=r"^edge\.nats\.tls_ca: cannot load"):
        NatsAccess(tls_ca=str(pki / "missing.pem")).ssl_context()


# --- the CLI adapter: argv only, prompt on stdin, explicit environment -----------------------------

_ECHO = (
    "import json, os, sys; "
    "json.dump({'argv': sys.argv[1:], 'stdin': sys.stdin.read(), 'env': dict(os.environ)}, sys.stdout)"
)


async def test_cli_prompt_cannot_inject_commands_or_arguments_and_env_is_explicit(
    nats_server: EmbeddedNats, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep").write_text("x")
    pwned = tmp_path / "pwned"
    prompt = (
        f'"; rm -rf {victim}; $(touch {pwned}) `touch {pwned}` && touch {pwned} || touch {pwned}\n'
        f"--help -c 'import os; os.system(\"touch {pwned}\")' $HOME ${{PATH}} %s \\x00 * ? ~ > {pwned}"
    )
    monkeypatch.setenv("IOP_TEST_KEYS", KEY)
    monkeypatch.setenv("IOP_TEST_PASSED", "passed-through")
    monkeypatch.setenv("IOP_TEST_WITHHELD", "withheld-secret")
    monkeypatch.setenv("IOP_TEST_NATS_TOKEN", NATS_SECRET)
    dep = deployment(
        f"""
edge: {{api_keys_env: IOP_TEST_KEYS}}
models: [{{alias: echo, route: n1/echo-cli}}]
nodes:
  - id: n1
    adapters: [{{id: echo, type: cli, command: {json.dumps([sys.executable, "-c", _ECHO])}, env: [IOP_TEST_PASSED]}}]
    providers: [{{id: echo-cli, adapter: echo}}]
"""
    )
    async with deployment_running(dep, nats_server.url) as h:
        client = h.client(api_key=KEY)
        answer = await client.chat.completions.create(model="echo", messages=[{"role": "user", "content": prompt}])
        content = answer.choices[0].message.content
        assert content is not None
        seen = json.loads(content)
    assert seen["stdin"] == prompt  # verbatim, on stdin
    assert seen["argv"] == []  # nothing of the prompt became an argument
    assert not pwned.exists() and (victim / "keep").exists()  # and nothing of it was executed

    env = seen["env"]
    assert env["IOP_TEST_PASSED"] == "passed-through"
    assert env["PATH"] == os.environ["PATH"]
    for secret in ("IOP_TEST_WITHHELD", "IOP_TEST_KEYS", "IOP_TEST_NATS_TOKEN"):
        assert secret not in env
    # Python itself may add LC_CTYPE (PEP 538 locale coercion); anything else came from the node.
    allowed = {"PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "USER", "IOP_TEST_PASSED", "LC_CTYPE"}
    assert set(env) <= allowed, set(env) - allowed


# --- one node id, one process -----------------------------------------------------------------------


async def test_a_second_node_process_with_a_connected_id_is_refused(
    nats_server: EmbeddedNats, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    path = tmp_path / "deploy.yaml"
    path.write_text(MOCK_POOL)
    dep = deployment(MOCK_POOL)
    async with running_edge(dep, nats_server.url) as h, running_node(dep, "n1", nats_server.url) as first:
        await h.edge.registry.wait_connected(["n1"], timeout_s=10)
        args = ("node", "--config", str(path), "--node", "n1", "--nats", nats_server.url)
        async with iop_process(*args, cwd=tmp_path, env={}) as impostor:
            assert await impostor.exit_code(timeout_s=20) != 0
        # One clear line, no traceback (the node's log may say it retried first).
        assert not any("Traceback" in line for line in impostor.stderr), impostor.stderr
        assert impostor.stderr[-1].startswith(f"iop: edge {h.edge.edge_id} refused node n1: "), impostor.stderr
        assert "already connected" in impostor.stderr[-1]
        state = h.edge.registry.nodes["n1"]
        assert state.connected and state.instance == first.instance  # the first one keeps its id
        answer = await h.client().chat.completions.create(model="sim", messages=[{"role": "user", "content": "hi"}])
        assert answer.choices[0].message.content
    refusals = [r.getMessage() for r in caplog.records if r.name == "iop.edge" and "refused node n1" in r.getMessage()]
    assert refusals and "already connected" in refusals[0]


# --- NATS least privilege: what one node's credential can do ------------------------------------------

TWO_NODES = """
models:
  - {alias: a-pool, pool: [a-prov]}
  - {alias: b-pool, pool: [b-prov]}
  - {alias: a-echo, route: a/a-cli}
nodes:
  - id: a
    adapters:
      - {id: sim, type: mock, latency_ms: 0, tokens: 3, token_interval_ms: 0}
      - {id: echo, type: cli, command: [cat]}
    providers: [{id: a-prov, adapter: sim, capacity: 2}, {id: a-cli, adapter: echo}]
  - id: b
    adapters: [{id: up, type: openai, base_url: "UPSTREAM"}]
    providers: [{id: b-prov, adapter: up, capacity: 1}]
"""


@dataclass
class Rogue:
    """A plain nats-py client holding one node's credential; collects the server's refusals."""

    nc: NATS
    errors: list[str] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    async def refused(self, what: str) -> None:
        """Until the server has said `permissions violation for <what>`."""
        await until(lambda: any(what in e for e in self.errors), self.changed, timeout_s=10)


@asynccontextmanager
async def rogue(server: EmbeddedNats, node_id: str) -> AsyncIterator[Rogue]:
    access = server.node_access(node_id)
    r: Rogue

    async def on_error(exc: Exception) -> None:
        r.errors.append(str(exc).lower())
        r.changed.set()

    nc = await nats.connect(
        server.address,
        user=access.user,
        password=access.password,
        inbox_prefix=f"_INBOX_{node_id}",
        error_cb=on_error,
        allow_reconnect=False,
    )
    r = Rogue(nc)
    try:
        yield r
    finally:
        await nc.close()


async def test_one_node_credential_opens_only_that_nodes_subjects(
    nats_server: EmbeddedNats, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    gate = asyncio.Event()
    async with fake_upstream(gate=gate) as up:
        dep = deployment(TWO_NODES.replace("UPSTREAM", up.url))
        await nats_server.authorize(dep.nodes)
        # Both nodes run with their own credential only, on the plain address.
        nodes = [NodeRuntime(dep, n, nats_server.address, access=nats_server.node_access(n)) for n in ("a", "b")]
        async with running_edge(dep, nats_server.url) as h, h.http() as http:
            for n in nodes:
                await n.start(connect_wait_s=5)
            try:
                await h.edge.registry.wait_connected(["a", "b"], timeout_s=10)
                chat = {"messages": [{"role": "user", "content": "hi"}]}
                # Least privilege is enough to serve: a pool, a CLI resource.
                assert (await http.post("/v1/chat/completions", json={**chat, "model": "a-pool"})).status_code == 200
                r = await http.post("/v1/chat/completions", json={**chat, "model": "a-echo"})
                assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "hi"
                # A request held on node b, which node a will try to answer.
                held = asyncio.create_task(http.post("/v1/chat/completions", json={**chat, "model": "b-pool"}))
                await up.wait_for(lambda u: u.in_flight == 1)
                rid = nodes[1].requests()[0].item.id
                edge_id = h.edge.edge_id

                async with rogue(nats_server, "a") as a:
                    for subject in (
                        "iop.work.>",
                        "iop.cli.b.*",
                        wire.cancel_subject("b"),
                        wire.received_subject("b"),
                        wire.body_subject("b"),  # the bodies of b's requests, sent ahead
                        "_INBOX_b.>",
                        "iop.reply.>",
                        wire.EDGE_SLOTS_SUBJECT,  # what each edge holds is the edges' business
                        "iop.responses.bg.>",  # a background response's events (iop/responses/live.py)
                        f"{GONE_ROOT}.>",  # which stored responses were deleted (iop/responses/cache.py)
                    ):
                        await a.nc.subscribe(subject)
                        await a.refused(f'permissions violation for subscription to "{subject.lower()}"')
                    forbidden = [
                        wire.work_subject("a-prov"),  # publish work, even to its own provider
                        wire.reply_subject(edge_id, "b", rid),  # answer b's request
                        wire.cancel_subject("b"),  # cancel b's work
                        wire.body_subject("b", rid, 0),  # put words in the prompt of b's request
                        wire.body_subject("a", "x", 0),  # or of its own: only edges send bodies
                        wire.resend_subject("b"),  # make b send an answer again
                        wire.received_subject("b"),  # make b forget answers an edge may still lack
                        wire.control_subject("b"),  # restart b's model servers
                        wire.control_subject("a"),  # or its own: an administrator's action, through an edge
                        wire.EDGE_SLOTS_SUBJECT,  # speak as an edge about the slots it holds
                        wire.heartbeat_subject("b"),  # speak as b
                        "$KV.iop_catalog.a",  # rewrite its own catalog
                        "$JS.API.DIRECT.GET.KV_iop_catalog.$KV.iop_catalog.b",  # read b's
                        # Stored responses are the edges' alone: no read, no listing, no write.
                        "$JS.API.DIRECT.GET.KV_iop_responses.$KV.iop_responses.r.anonymous.resp_1",
                        "$JS.API.STREAM.MSG.GET.KV_iop_responses",
                        "$JS.API.CONSUMER.CREATE.KV_iop_responses",
                        "$KV.iop_responses.r.anonymous.resp_1",
                        "iop.responses.bg.resp_1.cancel",  # cancel a background response
                        "iop.responses.bg.resp_1.since",  # or ask for its events
                        gone_subject("anonymous", "resp_1"),  # make the edges forget a stored response
                        "$JS.API.STREAM.CREATE.EVIL",
                        f"$JS.API.STREAM.INFO.{wire.WORK_STREAM}",  # nor read what the edge's streams hold
                        f"$JS.API.CONSUMER.MSG.NEXT.{wire.WORK_STREAM}.{wire.consumer_name('b-prov')}",
                    ]
                    for subject in forbidden:
                        await a.nc.publish(subject, b"x")
                        await a.refused(f'permissions violation for publish to "{subject.lower()}"')
                    # Under its own id the server lets it publish, and the edge drops it: the request
                    # was sent to b.
                    forged = wire.encode(wire.Done(rid, 0))
                    await a.nc.publish(wire.reply_subject(edge_id, "a", rid), forged)
                    # Each piece of a Replies is checked on its own: two pieces, two drops.
                    bundle = wire.Replies([wire.Started(rid, "b", "i"), wire.Done(rid, 0)])
                    await a.nc.publish(wire.reply_subject(edge_id, "a", rid), wire.encode(bundle))
                    await connection.flush(a.nc)

                    async def dropped() -> bool:
                        return h.edge.relay.forged == 3

                    await eventually(dropped)
                    own = await CatalogSource(a.nc, "a").get()  # its own key it may read
                    assert own is not None and "a-prov" in [p.id for p in own[1].providers]
                # The deployment kept serving: b's request ends with b's own answer.
                gate.set()
                answer = await held
                assert answer.status_code == 200, answer.text
                assert (await http.post("/v1/chat/completions", json={**chat, "model": "a-pool"})).status_code == 200
                assert h.edge.registry.connected("a") and h.edge.registry.connected("b")
            finally:
                gate.set()
                for n in nodes:
                    await n.stop(grace_s=2)
    assert "Publish Violation" in _our_log_text(caplog)  # the server's own refusals reach the edge's log


# --- nodes run only what their own operator allowed ------------------------------------------------


def test_node_policy_allows_prefixes_exact_commands_hosts_and_env(tmp_path: Path) -> None:
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(
        "node_policy:\n"
        "  commands: [[codex, exec]]\n"
        "  exact_commands: [[cat]]\n"
        "  upstream_hosts: [gpu-a.lan]\n"
        "  env: [OPENAI_API_KEY]\n"
    )
    policy = node_policy.load(policy_file)

    def cli(command: list[str], env: list[str] | None = None) -> config.CliAdapter:
        return config.CliAdapter(id="x", command=command, env=env or [])

    assert policy.refusal(cli(["codex", "exec", "--json"], ["OPENAI_API_KEY"])) is None
    assert policy.refusal(cli(["cat"])) is None
    assert policy.refusal(cli(["cat", "/etc/shadow"])) == "command not allowed"  # exact means exact
    assert policy.refusal(cli(["codex"])) == "command not allowed"  # shorter than the prefix
    assert policy.refusal(cli(["sh", "-c", "codex exec"])) == "command not allowed"
    assert policy.refusal(cli(["cat"], ["AWS_SECRET_ACCESS_KEY"])) == "env not allowed: AWS_SECRET_ACCESS_KEY"
    assert policy.refusal(config.OpenAIAdapter(id="u", base_url="http://gpu-a.lan:8000/v1")) is None
    assert (
        policy.refusal(config.OpenAIAdapter(id="u", base_url="http://evil.example/v1")) == "upstream host not allowed"
    )
    assert policy.refusal(config.MockAdapter(id="m")) is None
    # The upstream key variable is handed over too: to an allowed host, only a listed variable.
    ok = config.OpenAIAdapter(id="u", base_url="http://gpu-a.lan/v1", api_key_env="OPENAI_API_KEY")
    leak = config.OpenAIAdapter(id="u", base_url="http://gpu-a.lan/v1", api_key_env="AWS_SECRET_ACCESS_KEY")
    assert policy.refusal(ok) is None
    assert policy.refusal(leak) == "env not allowed: AWS_SECRET_ACCESS_KEY"
    policy_file.write_text("node_policy: {commands: [sh]}\n")
    with pytest.raises(ConfigError, match="node_policy: Expected `array`"):
        node_policy.load(policy_file)


async def test_a_catalog_command_outside_the_nodes_policy_is_not_run_and_shows_in_status(
    nats_server: EmbeddedNats, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    pwned = tmp_path / "pwned"
    text = """
models: [{alias: echo, route: n1/echo-cli}]
nodes:
  - id: n1
    adapters: [{id: echo, type: cli, command: [cat]}]
    providers: [{id: echo-cli, adapter: echo}]
"""
    dep = deployment(text)
    chat = {"model": "echo", "messages": [{"role": "user", "content": "hi"}]}
    async with running_edge(dep, nats_server.url) as h, running_node(dep, "n1", nats_server.url), h.http() as http:
        await h.edge.registry.wait_connected(["n1"], timeout_s=10)
        assert (await http.post("/v1/chat/completions", json=chat)).status_code == 200
        # An administrator (or whoever took an admin key) publishes a command the node's operator
        # never allowed: the node, started from its own file, runs exactly the commands there.
        evil = text.replace("command: [cat]", f"command: [sh, -c, 'touch {pwned}; cat']")
        result = await h.edge.refresher.apply(deployment(evil))
        assert result.error is None, result

        def refused() -> bool:
            live = h.edge.registry.nodes["n1"].live.get("echo-cli")
            return live is not None and live.refused == "command not allowed"

        await until(refused, h.edge.registry.changed)
        status = (await http.get("/status")).json()
        (provider,) = [p for n in status["nodes"] for p in n["providers"] if p["id"] == "echo-cli"]
        assert provider["refused"] == "command not allowed"
        r = await http.post("/v1/chat/completions", json=chat)
        assert r.status_code == 503, r.text
    assert not pwned.exists()
    lines = [r.getMessage() for r in caplog.records if "refused echo-cli" in r.getMessage()]
    assert lines == ["node n1: refused echo-cli (adapter echo): command not allowed by this node's policy"]


async def test_a_refresh_gives_new_nodes_their_nats_user_and_takes_it_from_removed_ones(tmp_path: Path) -> None:
    one = deployment(MOCK_POOL).nodes
    two = deployment(MOCK_POOL.replace("  - id: n1", "  - id: n2\n  - id: n1")).nodes
    server = EmbeddedNats("127.0.0.1:0", tmp_path / "nats", nodes=one)
    await server.start()
    try:
        with pytest.raises(BusError, match="refused our credentials"):
            await connection.connect(server.address, "n2", access=server.node_access("n2"), wait_s=10)
        await server.authorize(two)  # what Refresher.apply does before it publishes the catalog
        dropped = asyncio.Event()

        async def on_disconnect() -> None:
            dropped.set()

        n2 = await connection.connect(
            server.address, "n2", access=server.node_access("n2"), on_disconnect=on_disconnect
        )
        await server.authorize(one)
        # The server drops the connection of a user it no longer has ...
        async with asyncio.timeout(10):
            await dropped.wait()
        # (nats-py, retrying a refused reconnect, may cancel its own writer while closing)
        with contextlib.suppress(asyncio.CancelledError, nats.errors.Error):
            await n2.close()
        # ... and refuses a new one.
        with pytest.raises(BusError, match="refused our credentials"):
            await connection.connect(server.address, "n2", access=server.node_access("n2"), wait_s=10)
        bad = tmp_path / "other"
        bad.mkdir()
        (bad / SECRET_FILE).write_text("x" * 64)
        (bad / SECRET_FILE).chmod(0o644)
        with pytest.raises(BusError, match="readable by others"):
            Credentials.load(bad)
    finally:
        await server.stop()


async def test_nats_creds_server_config_gives_an_external_nats_the_same_least_privilege(tmp_path: Path) -> None:
    path = _write_deployment(tmp_path, {"nats": {"url": "nats://127.0.0.1:1", "store_dir": str(tmp_path / "store")}})
    async with iop_process("nats-creds", "--config", str(path), "--server-config", cwd=tmp_path) as printed:
        assert await printed.exit_code() == 0
    conf = tmp_path / "external.conf"
    # The operator's own settings (JetStream on a store of theirs), then the printed block.
    js = f'jetstream {{ store_dir: "{tmp_path / "external-store"}" }}\n'
    conf.write_text('host: "127.0.0.1"\nport: -1\n' + js + "\n".join(printed.stdout) + "\n")
    async with nats_server_of(conf) as port:
        url = f"nats://127.0.0.1:{port}"
        async with iop_process("nats-creds", "--config", str(path), "--node", "n1", cwd=tmp_path) as lines:
            assert await lines.exit_code() == 0
        node = dict(line.split("=", 1) for line in lines.stdout)
        errors: list[str] = []
        seen = asyncio.Event()

        async def on_error(exc: Exception) -> None:
            errors.append(str(exc).lower())
            seen.set()

        nc = await nats.connect(url, user=node["IOP_NATS_USER"], password=node["IOP_NATS_PASSWORD"], error_cb=on_error)
        try:
            await nc.subscribe("iop.work.>")
            await until(lambda: any('subscription to "iop.work.>"' in e for e in errors), seen)
        finally:
            await nc.close()
        with pytest.raises(BusError, match="requires credentials"):
            await connection.connect(url, "intruder", wait_s=10)
        # An edge and the node, each with the lines printed for it, serve through that server: the
        # node in its own account, its pulls and acks crossing into the edge's.
        async with iop_process("nats-creds", "--config", str(path), "--edge", cwd=tmp_path) as lines:
            assert await lines.exit_code() == 0
        edge = dict(line.split("=", 1) for line in lines.stdout)
        edge_url = f"nats://{edge['IOP_NATS_USER']}:{edge['IOP_NATS_PASSWORD']}@127.0.0.1:{port}"
        dep = deployment(MOCK_POOL)
        own = NatsAccess(user=node["IOP_NATS_USER"], password=node["IOP_NATS_PASSWORD"])
        async with running_edge(dep, edge_url) as h, running_node(dep, "n1", url, access=own), h.http() as http:
            await h.edge.registry.wait_connected(["n1"], timeout_s=10)
            chat = {"model": "sim", "messages": [{"role": "user", "content": "hi"}]}
            r = await http.post("/v1/chat/completions", json=chat)
            assert r.status_code == 200, r.text


async def test_node_reported_strings_reach_log_and_status_bounded_and_escaped(
    nats_server: EmbeddedNats, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    dep = deployment(TWO_NODES.replace("UPSTREAM", "http://127.0.0.1:9"))
    await nats_server.authorize(dep.nodes)
    forged_line = "\n2026-01-01 00:00:00,000 ERROR iop.edge: admin key leaked \x1b[2J"
    async with running_edge(dep, nats_server.url) as h, rogue(nats_server, "a") as a:
        # A malformed instance (it would be a subject token of the edge's verdict) is dropped.
        bad = wire.NodeHeartbeat(node="a", instance="x" + forged_line, started_at=0, seq=1, providers=[])
        await a.nc.publish(wire.heartbeat_subject("a"), wire.encode(bad))
        device = wire.Device(
            os="linux" + forged_line,
            cpu_model="c" * (4 * 1024 * 1024),
            accelerators=[wire.Accelerator(name=f"gpu{i}\r\n") for i in range(1000)],
        )
        junk = [wire.ProviderLive(id=f"junk{i}", kind="pool") for i in range(1000)]
        live = wire.ProviderLive(id="a-prov", kind="pool", capacity=2, refused="no" + forged_line * 1000)
        hb = wire.NodeHeartbeat(
            node="a",
            instance="i1",
            started_at=0,
            seq=2,
            providers=[live, *junk],
            version="v" + forged_line,
            device=device,
        )
        await a.nc.publish(wire.heartbeat_subject("a"), wire.encode(hb))
        await connection.flush(a.nc)
        await h.edge.registry.wait_connected(["a"], timeout_s=10)
        st = h.edge.registry.nodes["a"]
        assert st.instance == "i1"
        async with h.http() as http:
            raw = (await http.get("/status")).content
        # Before: the 4 MiB cpu model made every /status frame 4 MiB, and the forged line reached the log.
        assert len(raw) < 64 * 1024, len(raw)
        assert st.device is not None and len(st.device.cpu_model) <= 200 and len(st.device.accelerators) <= 16
        assert "\n" not in st.device.os and "\x1b" not in st.version and "\\x0a" in st.device.os
        assert set(st.live) == {"a-prov"} and len(st.live["a-prov"].refused) <= 200
    text = _our_log_text(caplog)
    assert "malformed instance" in text
    assert "admin key leaked" not in "\n".join(line for line in text.splitlines() if line.startswith("20")), (
        "a node's string began a log line of its own"
    )
    assert all(
        "\x1b" not in r.getMessage() and "\n" not in r.getMessage() for r in caplog.records if r.name.startswith("iop")
    )


async def test_a_node_credential_cannot_fill_the_ledger_and_junk_costs_one_log_line(
    nats_server: EmbeddedNats, caplog: pytest.LogCaptureFixture
) -> None:
    dep = deployment(TWO_NODES.replace("UPSTREAM", "http://127.0.0.1:9"))
    await nats_server.authorize(dep.nodes)
    async with running_edge(dep, nats_server.url) as h, rogue(nats_server, "a") as a:
        js = h.edge.js
        before = (await js.stream_info(LEDGER_STREAM)).state.messages
        # The node must make JetStream requests to pull its work, and may name any reply subject
        # in them: the server's answers land there. Before, `iop.ledger.<alias>` stored each one.
        pull = f"$JS.API.CONSUMER.MSG.NEXT.{wire.WORK_STREAM}.{wire.consumer_name('a-prov')}"
        own = "$JS.API.DIRECT.GET.KV_iop_catalog.$KV.iop_catalog.a"
        for i in range(200):
            await a.nc.publish(pull, b'{"batch": 1, "no_wait": true}', reply=f"iop.ledger.junk{i}")
            await a.nc.publish(own, b"", reply="iop.ledger.m")
        # It cannot learn the stream's secret subject either.
        await a.nc.publish(f"$JS.API.STREAM.INFO.{LEDGER_STREAM}", b"", reply="_INBOX_a.x")
        await a.refused(f'permissions violation for publish to "$js.api.stream.info.{LEDGER_STREAM.lower()}"')
        await connection.flush(a.nc)
        # Everything the node sent has been answered: a request after it comes back after it.
        assert await CatalogSource(a.nc, "a").get() is not None
        assert (await js.stream_info(LEDGER_STREAM)).state.messages == before

        # Junk that does get in (an old ledger's, an edge credential's) costs one line per read.
        ledger = h.edge.ledger
        assert ledger is not None and len(ledger.token) == 32
        for _ in range(300):
            await js.publish(f"iop.ledger.{ledger.token}.m", b"junk")
        caplog.clear()
        got: list[RequestRecord] = []
        assert await read_records(js, parse_query("1h", None, None), got.extend) == 300
        skipped = [r for r in caplog.records if "not batches of records" in r.getMessage()]
        assert len(skipped) == 1 and "300 of 300" in skipped[0].getMessage(), [r.getMessage() for r in skipped]
