"""Junk on the subjects the edge listens to is counted and logged once a minute, not once per message."""

from __future__ import annotations

import logging

import pytest

from iop import wire
from iop.nats import connection
from iop.nats.server import EmbeddedNats
from tests.fakes import fake_upstream
from tests.harness import deployment, eventually, running_edge, running_node

DEP = """
models: [{alias: m, pool: [x]}]
nodes:
  - id: n
    adapters: [{id: ux, type: openai, base_url: "URL", api: both}]
    providers: [{id: x, adapter: ux, capacity: 1}]
"""

JUNK = 200


async def test_junk_hellos_heartbeats_and_replies_flood_neither_the_log_nor_the_edge(
    nats_server: EmbeddedNats, caplog: pytest.LogCaptureFixture
) -> None:
    """200 undecodable messages on each of a node's hello and heartbeat subjects and on a reply subject:
    one warning per kind, each counted in `iop_nats_undecodable_total`; the edge still answers."""
    url = nats_server.url
    async with fake_upstream() as up:
        dep = deployment(DEP.replace("URL", up.url))
        async with running_edge(dep, url) as e, running_node(dep, "n", url), e.http() as http:
            edge = e.edge
            await edge.registry.wait_connected(["n"], timeout_s=10)
            nc = await connection.connect(url, "test-junk")
            try:
                subjects = {
                    "hello": wire.hello_subject("n"),
                    "heartbeat": wire.heartbeat_subject("n"),
                    "reply": f"{wire.reply_prefix(edge.edge_id)}.n.{'0' * 24}",
                }
                with caplog.at_level(logging.WARNING, "iop.edge"):
                    for subject in subjects.values():
                        for i in range(JUNK):
                            await nc.publish(subject, b"\x00not msgpack" if i % 2 else b"{")
                    await nc.flush()
                    registry = edge.registry
                    junk = (registry.undecodable_hellos, registry.undecodable_heartbeats, edge.relay.undecodable)

                    async def all_counted() -> bool:
                        return all(j.count == JUNK for j in junk)

                    await eventually(all_counted)
                    answer = await http.post(
                        "/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}]}
                    )
                assert answer.status_code == 200, answer.text
                assert edge.registry.connected("n")
                warnings = [
                    r for r in caplog.records if r.levelno >= logging.WARNING and "undecodable" in r.getMessage()
                ]
                assert len(warnings) == len(subjects), [r.getMessage() for r in warnings]
                metrics = (await http.get("/metrics")).text
                for kind in subjects:
                    assert f'iop_nats_undecodable_total{{kind="{kind}"}} {JUNK}.0' in metrics
                assert 'iop_nats_undecodable_total{kind="edge_slots"} 0.0' in metrics
            finally:
                await nc.close()
