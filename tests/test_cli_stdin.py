"""A CLI command that ignores its input is normal: the request succeeds on the node as it really runs."""

from __future__ import annotations

from pathlib import Path

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
