"""CLI resources on a node process (uvloop, as it really runs): commands that ignore stdin, failures, logs."""

from __future__ import annotations

import secrets
import time
from pathlib import Path

import openai
import pytest

from iop import wire
from iop.nats import connection
from iop.nats.server import EmbeddedNats
from tests.harness import deployment, eventually, node_process, running_edge, running_node

DEPLOYMENT = """
models: [{alias: quick, route: n/quick-cli}]
nodes:
  - id: n
    adapters: [{id: quick, type: cli, command: ["/bin/sh", "-c", "echo did not read it"]}]
    providers: [{id: quick-cli, adapter: quick}]
"""


async def test_cli_command_that_exits_without_reading_stdin_succeeds(nats_server: EmbeddedNats, tmp_path: Path) -> None:
    # The node process runs on uvloop, whose closed pipes raise RuntimeError where asyncio's raise
    # BrokenPipeError: a command that exits before reading its prompt used to fail the request (502).
    path = tmp_path / "deployment.yaml"
    path.write_text(DEPLOYMENT)
    prompt = "x" * (1024 * 1024)  # far more than a pipe holds
    async with (
        running_edge(deployment(DEPLOYMENT), nats_server.url) as h,
        node_process(path, "n", nats_server.url),
    ):
        client = h.client()
        for _ in range(8):
            answer = await client.chat.completions.create(model="quick", messages=[{"role": "user", "content": prompt}])
            assert answer.choices[0].message.content == "did not read it\n"
            stream = await client.chat.completions.create(
                model="quick", messages=[{"role": "user", "content": prompt}], stream=True
            )
            text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
            assert text == "did not read it\n"


async def test_a_failing_command_s_stderr_reaches_the_client_but_not_the_log(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    # A command's stderr (and an upstream's error text) may repeat the prompt: the client is told,
    # the node's log says only which request failed, how (its code) and with what status.
    text = DEPLOYMENT.replace('"echo did not read it"', '"cat >&2; exit 3"')
    path = tmp_path / "deployment.yaml"
    path.write_text(text)
    secret = "the-prompt-" + "x" * 20
    async with (
        running_edge(deployment(text), nats_server.url) as h,
        node_process(path, "n", nats_server.url) as node,
    ):
        client = h.client()
        with pytest.raises(openai.APIStatusError) as failed:
            await client.chat.completions.create(model="quick", messages=[{"role": "user", "content": secret}])
        assert secret in str(failed.value)  # the client hears why
        await node.wait_line(r"request \S+ failed: cli_failed \(status 502\)")
    assert not [line for line in node.lines if secret in line]


async def test_a_cli_request_whose_cancel_overtook_it_is_accepted_but_never_run(nats_server: EmbeddedNats) -> None:
    # The Cancel and the request travel on different subjects, so a node may see the Cancel first
    # (a client that left at once). Accepted, so the edge is not left waiting, but never run.
    nc = await connection.connect(nats_server.url, "test-edge", wait_s=5)
    try:
        async with running_node(deployment(DEPLOYMENT), "n", nats_server.url) as node:
            assert node._running is not None
            running = node._running
            rid = secrets.token_hex(12)
            await nc.publish(wire.cancel_subject("n"), wire.encode(wire.Cancel(rid)))
            await connection.flush(nc)

            async def seen() -> bool:
                return running.was_cancelled(rid)

            await eventually(seen)
            item = wire.WorkItem(
                id=rid,
                api="chat",
                stream=False,
                alias="quick",
                body=b'{"model": "quick", "messages": [{"role": "user", "content": "hi"}]}',
                reply_to=wire.reply_subject("test-edge", "n", rid),
                deadline=time.time() + 30,
            )
            reply = await nc.request(wire.cli_subject("n", "quick-cli"), wire.encode(item), timeout=5)
            assert isinstance(wire.decode_reply(reply.data), wire.Accepted)
            # Started synchronously after the Accepted is queued, before it reaches the wire: by
            # now a run would be there.
            assert node.requests() == []
    finally:
        await nc.close()
