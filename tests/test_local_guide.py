"""docs/edge-local-dev-guide.md, section 0b, run as written: the edge and every node of configs/smoke.yaml
as real processes, then each command the section gives to check them (iop status, curl, the openai SDK,
iop smoke --edge), then Ctrl-C of a node. Only the ports change (free ones instead of 8080 and 4222)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path

import httpx
import pytest

from iop.contracts.status import decode_status
from tests.harness import REPO, IopProcess, eventually, free_port, iop_process

GUIDE = REPO / "docs" / "edge-local-dev-guide.md"


def section_blocks() -> list[tuple[str, str]]:
    """The fenced blocks of section 0b, in order, as (language, text)."""
    text = GUIDE.read_text()
    start = text.index("## 0b.")
    section = text[start : text.index("\n## ", start + 1)]
    return re.findall(r"```(\w+)\n(.*?)```", section, re.S)


def commands(block: str) -> list[str]:
    return [line for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]


async def run(argv: list[str], cwd: Path, timeout_s: float = 60) -> str:
    proc = await asyncio.create_subprocess_exec(
        *argv,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(timeout_s):
        out, err = await proc.communicate()
    assert proc.returncode == 0, f"{argv}: exit {proc.returncode}\n{out.decode()}\n{err.decode()}"
    return out.decode()


@contextlib.asynccontextmanager
async def started(args: list[str], cwd: Path, ready: str) -> AsyncIterator[IopProcess]:
    async with iop_process(*args, cwd=cwd, stop_grace_s=10) as p:
        await p.wait_line(ready, timeout_s=30)
        yield p


@pytest.mark.skipif(shutil.which("curl") is None, reason="the guide's checks use curl")
async def test_the_local_guide_runs_as_written(tmp_path: Path) -> None:
    http_port, nats_port = free_port(), free_port()

    def ported(text: str) -> str:
        return text.replace("127.0.0.1:8080", f"127.0.0.1:{http_port}").replace(
            "127.0.0.1:4222", f"127.0.0.1:{nats_port}"
        )

    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "smoke.yaml").write_text(ported((REPO / "configs" / "smoke.yaml").read_text()))
    blocks = section_blocks()
    langs = [lang for lang, _ in blocks]
    assert langs == ["sh", "sh", "python", "sh"], langs
    start, check, sdk, smoke = (text for _, text in blocks)

    async with AsyncExitStack() as stack:
        nodes: dict[str, IopProcess] = {}
        for line in commands(start):
            argv = shlex.split(line)
            assert argv[:3] == ["python", "-m", "iop"], line
            if argv[3] == "edge":
                await stack.enter_async_context(started(argv[3:], tmp_path, r"iop edge listening on"))
            else:
                node_id = argv[argv.index("--node") + 1]
                nodes[node_id] = await stack.enter_async_context(started(argv[3:], tmp_path, "serving"))
        assert set(nodes) == {"mac-codex-node", "gpu-a-node", "gpu-b-node"}

        outputs = []
        for line in commands(check):
            argv = shlex.split(ported(line))
            if argv[:3] == ["python", "-m", "iop"]:
                argv = [sys.executable, *argv[1:]]
            outputs.append(await run(argv, tmp_path))
        status, whole, streamed, echoed = outputs
        for node_id in nodes:
            assert re.search(rf"^{node_id}\s+yes", status, re.M), status
        assert re.search(r"^qwen-coder\s+3\s+3\s+10/10", status, re.M), status
        assert json.loads(whole)["choices"][0]["message"]["content"]
        assert streamed.rstrip().endswith("data: [DONE]"), streamed
        assert "echo me" in json.loads(echoed)["choices"][0]["message"]["content"]

        said = (await run([sys.executable, "-c", ported(sdk)], tmp_path)).splitlines()
        assert "qwen-coder" in said[0] and "codex" in said[0], said
        assert said[1] and said[2], said
        assert "echo me" in said[3], said

        (line,) = commands(smoke)
        argv = shlex.split(ported(line))
        report = await run([sys.executable, *argv[1:]], tmp_path, timeout_s=120)
        assert "iop smoke: PASS" in report, report

        # Ctrl-C a node: it stops at once, the edge marks it disconnected at once.
        node = nodes["gpu-b-node"]
        os.kill(node.pid, signal.SIGINT)
        assert await node.exit_code(timeout_s=5) == 0, node.lines
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{http_port}") as http:

            async def only_b_gone() -> bool:
                state = {n.id: n.connected for n in decode_status((await http.get("/status")).content).nodes}
                return state == {"mac-codex-node": True, "gpu-a-node": True, "gpu-b-node": False}

            # Its last heartbeat says it leaves: well before the 3 s after which a silent node is lost.
            gone_s = await eventually(only_b_gone, timeout_s=2.5)
    print(f"\nthe guide's one-machine path passed; a node stopped with Ctrl-C was shown disconnected in {gone_s:.2f}s")
