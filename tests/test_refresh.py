"""`iop refresh`: change a running deployment without a restart, dropping nothing."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from pathlib import Path

import pytest

from iop import wire
from iop.client import EdgeClient
from iop.contracts.refresh import diff
from iop.nats.server import EmbeddedNats
from tests.fakes import fake_upstream
from tests.harness import deployment, deployment_running, iop_process, running_edge, running_node, until


def pool_yaml(url_a: str, url_b: str, cap_a: int, cap_b: int | None, extra_node: str = "") -> str:
    members = "[prov-a, prov-b]" if cap_b is not None else "[prov-a]"
    node_b = (
        f"""
  - id: node-b
    adapters: [{{id: up, type: openai, base_url: "{url_b}", api: both}}]
    providers: [{{id: prov-b, adapter: up, capacity: {cap_b}}}]
"""
        if cap_b is not None
        else ""
    )
    return f"""
models:
  - alias: m
    pool: {members}
nodes:
  - id: node-a
    adapters: [{{id: up, type: openai, base_url: "{url_a}", api: both}}]
    providers: [{{id: prov-a, adapter: up, capacity: {cap_a}}}]
{node_b}{extra_node}"""


BODY = {"model": "m", "messages": [{"role": "user", "content": "x"}]}


def test_diff_names_every_kind_of_change() -> None:
    old = deployment(pool_yaml("http://a/v1", "http://b/v1", 2, 4))
    new = deployment(pool_yaml("http://a2/v1", "http://b/v1", 3, None))
    lines = [c.line() for c in diff(old, new)]
    assert "node_removed node-b" in lines
    assert "provider_removed node-b/prov-b" in lines
    assert "capacity node-a/prov-a: 2 → 3" in lines
    assert "pool_members m: prov-a, prov-b → prov-a" in lines
    assert any(line.startswith("adapter_changed node-a/up:") for line in lines)
    assert diff(old, old) == []


def test_diff_reports_legacy_concurrency_as_metadata() -> None:
    plain = pool_yaml("http://a/v1", "", 2, None)
    four = plain.replace("  - id: node-a\n", "  - id: node-a\n    concurrency: 4\n")
    nested = plain.replace("  - id: node-a\n", "  - id: node-a\n    runtime: {concurrency: 8}\n")
    assert [c.line() for c in diff(deployment(plain), deployment(four))] == ["legacy_concurrency node-a: unset → 4"]
    assert [c.line() for c in diff(deployment(four), deployment(nested))] == ["legacy_concurrency node-a: 4 → 8"]
    assert [c.line() for c in diff(deployment(nested), deployment(plain))] == ["legacy_concurrency node-a: 8 → unset"]


async def test_refresh_carries_a_legacy_concurrency_change_to_status(nats_server: EmbeddedNats, tmp_path: Path) -> None:
    async with fake_upstream() as a:
        text = pool_yaml(a.url, "", 2, None).replace("  - id: node-a\n", "  - id: node-a\n    concurrency: 4\n")
        async with deployment_running(deployment(text), nats_server.url) as h:
            f = tmp_path / "new.yaml"
            f.write_text(text.replace("concurrency: 4", "concurrency: 8"))
            # Given as host:port, without http://.
            address = h.url.removeprefix("http://")
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "iop",
                "refresh",
                "--config",
                str(f),
                "--edge",
                address,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            out, err = await proc.communicate()
            assert proc.returncode == 0, err.decode()
            assert out.decode().splitlines() == ["legacy_concurrency node-a: 4 → 8", "applied."]
            assert (await h.status()).nodes[0].legacy_concurrency == 8
            # Metadata only: the broker's cap is the provider's capacity, untouched.
            info = await h.edge.js.consumer_info(wire.WORK_STREAM, wire.consumer_name("prov-a"))
            assert info.config.max_ack_pending == 2


async def test_dry_run_and_invalid_files_change_nothing(nats_server: EmbeddedNats) -> None:
    async with fake_upstream() as a, fake_upstream() as b:
        text = pool_yaml(a.url, b.url, 2, 4)
        async with deployment_running(deployment(text), nats_server.url) as h, h.http() as http:
            before = await h.status()
            r = await http.post("/admin/refresh?dry_run=1", content=pool_yaml(a.url, b.url, 1, 4))
            assert r.status_code == 200
            assert r.json()["changes"] == ["capacity node-a/prov-a: 2 → 1"] and r.json()["applied"] == []
            bad = await http.post("/admin/refresh", content=text.replace("capacity: 2", "capacity: zero"))
            assert bad.status_code == 400
            assert any("capacity" in p for p in bad.json()["error"]["problems"])
            after = await h.status()
            assert before.pools == after.pools
            info = await h.edge.js.consumer_info(wire.WORK_STREAM, wire.consumer_name("prov-a"))
            assert info.config.max_ack_pending == 2
            same = await http.post("/admin/refresh", content=text)
            assert same.json()["changes"] == []


async def test_lowering_capacity_under_load_takes_effect_at_the_upstream(nats_server: EmbeddedNats) -> None:
    gate = asyncio.Event()
    async with fake_upstream(gate=gate) as a:
        text = pool_yaml(a.url, "", 3, None)
        async with deployment_running(deployment(text), nats_server.url) as h, h.http() as http:
            running = [asyncio.create_task(http.post("/v1/chat/completions", json=BODY)) for _ in range(3)]
            await a.wait_for(lambda u: u.in_flight == 3)
            r = await http.post("/admin/refresh", content=pool_yaml(a.url, "", 1, None))
            assert r.json()["changes"] == ["capacity node-a/prov-a: 3 → 1"] and r.json()["error"] is None
            info = await h.edge.js.consumer_info(wire.WORK_STREAM, wire.consumer_name("prov-a"))
            assert info.config.max_ack_pending == 1
            more = [asyncio.create_task(http.post("/v1/chat/completions", json=BODY)) for _ in range(4)]
            await until(lambda: h.edge.scheduler.waiting("m") == 4, h.edge.scheduler.changed)
            gate.set()
            assert all(x.status_code == 200 for x in await asyncio.gather(*running))  # in flight: not dropped
            a.peak = a.in_flight
            assert all(x.status_code == 200 for x in await asyncio.gather(*more))
            assert a.peak == 1  # the new cap, seen where it happens


async def test_removing_a_provider_drains_it(nats_server: EmbeddedNats) -> None:
    gate = asyncio.Event()
    async with fake_upstream(gate=gate) as a, fake_upstream() as b:
        dep = deployment(pool_yaml(a.url, b.url, 1, 1))
        async with deployment_running(dep, nats_server.url) as h, h.http() as http:
            # Fill prov-a (the gate holds it), then take it out of the pool while it runs.
            first = [asyncio.create_task(http.post("/v1/chat/completions", json=BODY)) for _ in range(2)]
            await a.wait_for(lambda u: u.in_flight == 1)
            new = pool_yaml(a.url, b.url, 1, 1).replace("pool: [prov-a, prov-b]", "pool: [prov-b]")
            r = await http.post("/admin/refresh", content=new)
            assert r.json()["changes"] == ["pool_members m: prov-a, prov-b → prov-b"]
            for _ in range(4):
                resp = await http.post("/v1/chat/completions", json=BODY)
                assert resp.status_code == 200 and resp.headers["x-iop-provider"] == "prov-b"
            gate.set()
            assert [x.status_code for x in await asyncio.gather(*first)] == [200, 200]
            assert a.total == 1


async def test_adding_a_node_brings_its_provider_into_the_pool(nats_server: EmbeddedNats, tmp_path: Path) -> None:
    async with fake_upstream() as a, fake_upstream() as c:
        old = pool_yaml(a.url, "", 1, None)
        node_c = f"""
  - id: node-c
    adapters: [{{id: up, type: openai, base_url: "{c.url}", api: both}}]
    providers: [{{id: prov-c, adapter: up, capacity: 2}}]
"""
        new = pool_yaml(a.url, "", 1, None, extra_node=node_c).replace("pool: [prov-a]", "pool: [prov-a, prov-c]")
        async with deployment_running(deployment(old), nats_server.url) as h, h.http() as http:
            r = await http.post("/admin/refresh", content=new)
            assert "node_added node-c" in r.json()["changes"]
            async with running_node(deployment(new), "node-c", nats_server.url):
                await h.edge.registry.wait_connected(["node-c"], timeout_s=10)
                await until(lambda: h.edge.scheduler.providers["prov-c"].connected, h.edge.registry.changed)
                results = await asyncio.gather(*(http.post("/v1/chat/completions", json=BODY) for _ in range(9)))
                assert all(x.status_code == 200 for x in results)
                assert {x.headers["x-iop-provider"] for x in results} == {"prov-a", "prov-c"}
                st = await h.status()
                assert st.pools[0].total_capacity == 3
                assert [n.id for n in st.nodes] == ["node-a", "node-c"]


async def test_refresh_command_line(nats_server: EmbeddedNats, tmp_path: Path) -> None:
    async with fake_upstream() as a:
        text = pool_yaml(a.url, "", 2, None)
        async with deployment_running(deployment(text), nats_server.url) as h:
            f = tmp_path / "new.yaml"
            f.write_text(pool_yaml(a.url, "", 3, None))

            async def iop(*args: str) -> tuple[int, str, str]:
                return await iop_at(f, "--edge", h.url, *args)

            async def iop_at(file: Path, *args: str) -> tuple[int, str, str]:
                proc = await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-m",
                    "iop",
                    "refresh",
                    "--config",
                    str(file),
                    *args,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE,
                )
                out, err = await proc.communicate()
                assert proc.returncode is not None
                return proc.returncode, out.decode(), err.decode()

            code, out, _ = await iop("--dry-run")
            assert (code, out.strip()) == (0, "capacity node-a/prov-a: 2 → 3")
            # Without --edge, the address is the file's edge.listen.
            port = h.url.rsplit(":", 1)[1]
            other = tmp_path / "listen.yaml"
            other.write_text(f"edge: {{listen: '127.0.0.1:{port}'}}\n" + f.read_text())
            code, out, err = await iop_at(other, "--dry-run")
            assert code == 0, err
            assert "capacity node-a/prov-a: 2 → 3" in out.splitlines()
            assert h.edge.scheduler.providers["prov-a"].capacity == 2
            code, out, _ = await iop()
            assert code == 0 and "applied." in out
            assert h.edge.scheduler.providers["prov-a"].capacity == 3
            code, out, _ = await iop()
            assert (code, out.strip()) == (0, "no changes")
            f.write_text(text.replace("capacity: 2", "capacity: -1"))
            code, _, err = await iop()
            assert code == 2 and "nodes[0].providers[0].capacity" in err
            assert h.edge.scheduler.providers["prov-a"].capacity == 3


async def test_raising_capacity_reaches_the_node_and_the_upstream(nats_server: EmbeddedNats) -> None:
    gate = asyncio.Event()
    async with fake_upstream(gate=gate) as a:
        dep = deployment(pool_yaml(a.url, "", 1, None))
        async with deployment_running(dep, nats_server.url) as h, h.http() as http:
            running = [asyncio.create_task(http.post("/v1/chat/completions", json=BODY)) for _ in range(6)]
            await a.wait_for(lambda u: u.in_flight == 1)
            r = await http.post("/admin/refresh", content=pool_yaml(a.url, "", 4, None))
            assert r.json()["changes"] == ["capacity node-a/prov-a: 1 → 4"]
            # The node picks up its new catalog from the edge and runs 4 at once.
            await a.wait_for(lambda u: u.in_flight == 4)
            gate.set()
            assert all(x.status_code == 200 for x in await asyncio.gather(*running))
            assert a.peak == 4


async def test_a_provider_added_to_a_running_node_starts_serving(nats_server: EmbeddedNats) -> None:
    async with fake_upstream() as a, fake_upstream() as a2:
        old = pool_yaml(a.url, "", 1, None)
        new = (
            old.replace(
                "providers: [{id: prov-a, adapter: up, capacity: 1}]",
                "providers: [{id: prov-a, adapter: up, capacity: 1}, {id: prov-a2, adapter: up2, capacity: 2}]",
            )
            .replace(
                f'adapters: [{{id: up, type: openai, base_url: "{a.url}", api: both}}]',
                f'adapters: [{{id: up, type: openai, base_url: "{a.url}", api: both}}, '
                f'{{id: up2, type: openai, base_url: "{a2.url}", api: both}}]',
            )
            .replace("pool: [prov-a]", "pool: [prov-a, prov-a2]")
        )
        async with deployment_running(deployment(old), nats_server.url) as h, h.http() as http:
            r = await http.post("/admin/refresh", content=new)
            assert "provider_added node-a/prov-a2: capacity 2" in r.json()["changes"]
            await until(lambda: h.edge.scheduler.providers["prov-a2"].connected, h.edge.registry.changed)
            results = await asyncio.gather(*(http.post("/v1/chat/completions", json=BODY) for _ in range(9)))
            assert all(x.status_code == 200 for x in results)
            assert a2.total > 0


async def test_a_node_without_a_file_takes_its_catalog_from_the_edge(nats_server: EmbeddedNats, tmp_path: Path) -> None:
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text("node_policy: {upstream_hosts: [127.0.0.1]}\n")  # what this machine allows
    async with fake_upstream() as a:
        text = pool_yaml(a.url, "", 2, None)
        async with running_edge(deployment(text), nats_server.url) as h, h.http() as http:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "iop",
                "node",
                "--node",
                "node-a",
                "--nats",
                nats_server.url,
                "--allow-commands",
                str(policy_file),
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
            )
            try:
                await h.edge.registry.wait_connected(["node-a"], timeout_s=20)
                await until(lambda: h.edge.scheduler.providers["prov-a"].connected, h.edge.registry.changed)
                r = await http.post("/v1/chat/completions", json=BODY)
                assert r.status_code == 200 and a.total == 1
                # A refresh reaches it too: its upstream model name changes.
                await http.post("/admin/refresh", content=text.replace("capacity: 2}", "capacity: 2, model: renamed}"))
                await until(
                    lambda: h.edge.registry.nodes["node-a"].live.get("prov-a") is not None, h.edge.registry.changed
                )
                async with asyncio.timeout(20):
                    while not (a.bodies and a.bodies[-1]["model"] == "renamed"):
                        await http.post("/v1/chat/completions", json=BODY)
            finally:
                proc.terminate()
                out, _ = await proc.communicate()
            assert proc.returncode == 0, out.decode()


async def test_a_node_whose_file_differs_follows_the_edge(
    nats_server: EmbeddedNats, caplog: pytest.LogCaptureFixture
) -> None:
    async with fake_upstream() as a, running_edge(deployment(pool_yaml(a.url, "", 3, None)), nats_server.url) as h:
        caplog.set_level(logging.WARNING, logger="iop.node")
        async with running_node(deployment(pool_yaml(a.url, "", 1, None)), "node-a", nats_server.url) as node:
            assert node.node.providers[0].capacity == 3
            assert "differs from the local file (capacity node-a/prov-a: 1 → 3); following the edge" in caplog.text
            await h.edge.registry.wait_connected(["node-a"], timeout_s=10)


async def test_a_refresh_from_another_file_is_shown_as_drift_until_sighup_reads_the_edges_own(tmp_path: Path) -> None:
    own = tmp_path / "edge.yaml"
    own.write_text(
        f"edge: {{nats: {{listen: '127.0.0.1:0', store_dir: '{tmp_path / 'store'}'}}}}\n"
        + pool_yaml("http://127.0.0.1:9/v1", "", 2, None)
    )
    other = tmp_path / "other.yaml"
    other.write_text(own.read_text().replace("capacity: 2", "capacity: 3"))
    async with iop_process("edge", "--config", str(own), "--listen", "127.0.0.1:0", cwd=tmp_path) as edge:
        url = (await edge.wait_line(r"iop edge listening on (http://\S+)")).group(1)
        refresh = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "iop", "refresh", "--config", str(other), "--edge", url,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await refresh.communicate()
        assert refresh.returncode == 0, err
        assert "applied." in out.decode()
        assert "note: the edge now differs from the file it was started from (1 changes)" in err.decode()
        await edge.wait_line(r"the running deployment differs from .*edge\.yaml \(1 changes: capacity node-a/prov-a")
        async with EdgeClient(url) as client:
            assert (await client.status()).edge.drift == ["capacity node-a/prov-a: 2 → 3"]
            os.kill(edge.pid, signal.SIGHUP)
            await edge.wait_line(r"SIGHUP: capacity node-a/prov-a: 3 → 2")
            assert (await client.status()).edge.drift == []


async def test_a_new_capacity_starts_a_new_peak_on_the_node(nats_server: EmbeddedNats) -> None:
    # `iop smoke --edge` judges each provider's peak against its capacity: after a lowered
    # capacity, the peak the old one allowed must not count against the new one.
    gate = asyncio.Event()
    async with fake_upstream(gate=gate) as a:
        text = pool_yaml(a.url, "", 3, None)
        dep = deployment(text)
        async with running_edge(dep, nats_server.url) as h, running_node(dep, "node-a", nats_server.url) as node:
            await h.edge.registry.wait_connected(["node-a"], timeout_s=10)
            async with h.http() as http:
                running = [asyncio.create_task(http.post("/v1/chat/completions", json=BODY)) for _ in range(3)]
                await a.wait_for(lambda u: u.in_flight == 3)
                gate.set()
                assert all(x.status_code == 200 for x in await asyncio.gather(*running))
                prov = node.resources["prov-a"]
                assert prov.peak_in_flight == 3
                r = await http.post("/admin/refresh", content=pool_yaml(a.url, "", 1, None))
                assert r.json()["changes"] == ["capacity node-a/prov-a: 3 → 1"]
                await until(lambda: prov.cfg.capacity == 1, node.changed)
                assert prov.peak_in_flight == 0  # nothing runs now; the next requests set it again
                assert (await http.post("/v1/chat/completions", json=BODY)).status_code == 200
                assert prov.peak_in_flight == 1
