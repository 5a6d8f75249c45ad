"""CLI resources on a node process (uvloop, as it really runs): commands that ignore stdin, failures, logs."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from iop.bus import EmbeddedNats
from tests.harness import deployment, node_process, running_edge

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
