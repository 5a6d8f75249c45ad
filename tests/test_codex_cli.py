"""The real Codex CLI through a real edge and node to a chat-only model server (issue 14).

Codex CLI comes from npm, pinned (`.ci/run` installs it into .ci/npm when npm exists). Every
Codex run is offline but for loopback: its home is a temporary folder whose config.toml points it
at the edge and turns off everything that would reach the internet.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from iop import config
from iop.edge.keys import EdgeKeys, Key
from iop.nats.server import EmbeddedNats
from iop.openai.compaction import COMPACTION_PROMPT, SUMMARY_PREFIX
from tests.codex_upstream import Call, ScriptedChat, Turn, scripted_chat
from tests.harness import CODEX_OFFLINE_TABLES, CODEX_OFFLINE_TOP, EdgeHandle, deployment, deployment_running

CODEX_VERSION = "0.169.0"
"""The Codex CLI release whose requests docs/openai-compat.md was written from (../shared spec)."""
ROOT = Path(__file__).resolve().parent.parent
CODEX = ROOT / ".ci" / "npm" / "node_modules" / ".bin" / "codex"
RUN_TIMEOUT_S = 90.0


def codex_path() -> Path:
    if not CODEX.exists():
        pytest.skip(
            f"Codex CLI is not installed: npm install --prefix .ci/npm @openai/codex@{CODEX_VERSION} "
            "(.ci/run does it when npm exists)"
        )
    if shutil.which("node") is None:
        pytest.skip("Codex CLI's npm launcher needs node on PATH")
    return CODEX


def codex_home(home: Path, edge_url: str) -> Path:
    """A CODEX_HOME whose config sends Codex to the edge, with no retries and nothing online."""
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text(
        'model_provider = "iop"\n'
        + CODEX_OFFLINE_TOP
        + CODEX_OFFLINE_TABLES
        + f"""
[model_providers.iop]
name = "iop"
base_url = "{edge_url}/v1"
wire_api = "responses"
request_max_retries = 0
stream_max_retries = 0
"""
    )
    return home


def codex_command(model: str, workdir: Path, sandbox: str = "read-only") -> list[str]:
    return [
        str(codex_path()),
        "exec",
        "--skip-git-repo-check",
        "-s",
        sandbox,
        "-C",
        str(workdir),
        "-m",
        model,
        "-",
    ]


async def run_codex(
    home: Path, command: list[str], prompt: str, env_extra: dict[str, str] | None = None
) -> tuple[int, str, str]:
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(home), "CODEX_HOME": str(home), "LANG": "C.UTF-8"}
    env.update(env_extra or {})
    proc = await asyncio.create_subprocess_exec(
        *command,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
        start_new_session=True,
    )
    try:
        async with asyncio.timeout(RUN_TIMEOUT_S):
            out, err = await proc.communicate(prompt.encode())
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode is not None
    return proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")


def pool_of(url: str, alias: str = "m") -> str:
    return f"""
models: [{{alias: {alias}, pool: [p]}}]
nodes:
  - id: n
    adapters: [{{id: up, type: openai, base_url: "{url}", api: chat}}]
    providers: [{{id: p, adapter: up, model: served-model, capacity: 2}}]
"""


@asynccontextmanager
async def codex_setup(
    nats_server: EmbeddedNats, tmp_path: Path, turns: list[Turn], alias: str = "m"
) -> AsyncIterator[tuple[ScriptedChat, EdgeHandle, Path, Path]]:
    async with scripted_chat(turns) as up, deployment_running(deployment(pool_of(up.url, alias)), nats_server.url) as h:
        work = tmp_path / "work"
        work.mkdir()
        yield up, h, codex_home(tmp_path / "codex-home", h.url), work


def tool_names(body: dict[str, Any]) -> list[str]:
    return [t["function"]["name"] for t in body.get("tools") or []]


def tool_message(body: dict[str, Any], call_id: str) -> dict[str, Any]:
    found = [m for m in body["messages"] if m.get("role") == "tool" and m.get("tool_call_id") == call_id]
    assert len(found) == 1, f"no single tool message for {call_id}: {[m.get('role') for m in body['messages']]}"
    message: dict[str, Any] = found[0]
    return message


def explain(rc: int, out: str, err: str) -> str:
    return f"codex exited {rc}\nstdout:\n{out}\nstderr (tail):\n{err[-3000:]}"


async def test_codex_runs_a_shell_command_through_a_chat_only_server(nats_server: EmbeddedNats, tmp_path: Path) -> None:
    turns = [
        Turn(
            reasoning="The user wants a command run.",
            calls=[Call("exec_command", {"cmd": "printf 'iop-%s' shell-ok"}, "call_sh1")],
        ),
        Turn(text="The command printed iop-shell-ok."),
    ]
    async with codex_setup(nats_server, tmp_path, turns) as (up, _, home, work):
        rc, out, err = await run_codex(home, codex_command("m", work), "run echo iop-shell-ok\n")
    assert rc == 0, explain(rc, out, err)
    assert "The command printed iop-shell-ok." in out
    assert len(up.bodies) == 2
    first, second = up.bodies
    # Codex's tools reached the chat server flattened: namespaces as functions, hosted tools gone.
    names = tool_names(first)
    assert "exec_command" in names and "multi_agent_v1__close_agent" in names
    assert all(t["type"] == "function" for t in first["tools"])
    assert first["model"] == "served-model" and first["stream"] is True
    assert first["stream_options"] == {"include_usage": True}
    assert first["messages"][0]["role"] == "system" and "Codex" in first["messages"][0]["content"]
    # The command ran, and its output came back as a tool message answering the call.
    call = [m for m in second["messages"] if m.get("tool_calls")][-1]["tool_calls"][0]
    assert call["id"] == "call_sh1" and call["function"]["name"] == "exec_command"
    assert json.loads(call["function"]["arguments"]) == {"cmd": "printf 'iop-%s' shell-ok"}
    assert "iop-shell-ok" in tool_message(second, "call_sh1")["content"]


async def test_codex_calls_a_namespaced_tool(nats_server: EmbeddedNats, tmp_path: Path) -> None:
    turns = [
        Turn(calls=[Call("multi_agent_v1__close_agent", {"target": "no-such-agent"}, "call_ns1")]),
        Turn(text="Closed."),
    ]
    async with codex_setup(nats_server, tmp_path, turns) as (up, _, home, work):
        rc, out, err = await run_codex(home, codex_command("m", work), "close the agent\n")
    assert rc == 0, explain(rc, out, err)
    assert "Closed." in out
    assert len(up.bodies) == 2
    # Codex took the call as multi_agent_v1's close_agent: its handler answered (an unknown agent),
    # not "unsupported call", which is what a joined or bare name gets.
    output = tool_message(up.bodies[1], "call_ns1")["content"]
    assert "unsupported call" not in output
    assert "no-such-agent" in output
    call = [m for m in up.bodies[1]["messages"] if m.get("tool_calls")][-1]["tool_calls"][0]
    assert call["function"]["name"] == "multi_agent_v1__close_agent"


PATCH = "*** Begin Patch\n*** Add File: hello.txt\n+hello from iop\n*** End Patch\n"


async def test_codex_apply_patch_through_the_custom_tool(nats_server: EmbeddedNats, tmp_path: Path) -> None:
    # A bundled model slug (the spec's mode B) makes Codex offer apply_patch as a freeform custom tool.
    turns = [
        Turn(calls=[Call("apply_patch", {"input": PATCH}, "call_ap1")]),
        Turn(text="Wrote hello.txt."),
    ]
    async with codex_setup(nats_server, tmp_path, turns, alias="gpt-5.5") as (up, _, home, work):
        rc, out, err = await run_codex(home, codex_command("gpt-5.5", work, "workspace-write"), "write hello.txt\n")
        assert rc == 0, explain(rc, out, err)
        assert (work / "hello.txt").read_text() == "hello from iop\n"
    assert "Wrote hello.txt." in out
    first, second = up.bodies
    patch_tool = next(t["function"] for t in first["tools"] if t["function"]["name"] == "apply_patch")
    assert patch_tool["parameters"]["required"] == ["input"]
    assert "grammar" in patch_tool["description"]
    assert "tool_search" in tool_names(first)
    # Codex replayed the call as a custom_tool_call; it reached the server as the same function call.
    call = [m for m in second["messages"] if m.get("tool_calls")][-1]["tool_calls"][0]
    assert (call["id"], call["function"]["name"]) == ("call_ap1", "apply_patch")
    assert json.loads(call["function"]["arguments"]) == {"input": PATCH}
    assert "hello.txt" in tool_message(second, "call_ap1")["content"]


async def test_codex_as_a_cli_resource_calls_back_into_the_pool(nats_server: EmbeddedNats, tmp_path: Path) -> None:
    turns = [
        Turn(calls=[Call("exec_command", {"cmd": "printf 'from-the-%s' agent"}, "call_cli1")]),
        Turn(text="The agent saw from-the-agent."),
    ]
    home = tmp_path / "codex-home"
    work = tmp_path / "work"
    work.mkdir()
    command = ["/usr/bin/env", f"CODEX_HOME={home}", *codex_command("m", work)]
    async with scripted_chat(turns) as up:
        text = (
            pool_of(up.url)
            + f"""
  - id: agents
    adapters: [{{id: codex, type: cli, command: {json.dumps(command)}, timeout_s: {RUN_TIMEOUT_S}}}]
    providers: [{{id: codex-cli, adapter: codex}}]
"""
        )
        text = text.replace(
            "models: [{alias: m, pool: [p]}]",
            "models: [{alias: m, pool: [p]}, {alias: agent, route: agents/codex-cli}]",
        )
        async with deployment_running(deployment(text), nats_server.url) as h:
            codex_home(home, h.url)  # the CLI resource's Codex talks to this same edge
            client = h.client(timeout=RUN_TIMEOUT_S)
            answer = await client.chat.completions.create(
                model="agent", messages=[{"role": "user", "content": "run echo from-the-agent"}]
            )
    assert "The agent saw from-the-agent." in (answer.choices[0].message.content or "")
    assert len(up.bodies) == 2
    assert "from-the-agent" in tool_message(up.bodies[1], "call_cli1")["content"]


async def test_codex_tool_search_finds_deferred_tools_that_join_the_chat_tools(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    # Mode B defers namespaced tools: only a tool search puts them in front of the model.
    turns = [
        Turn(calls=[Call("tool_search", {"query": "close agent", "limit": 5}, "call_ts1")]),
        Turn(calls=[Call("multi_agent_v1__close_agent", {"target": "no-such-agent"}, "call_ns2")]),
        Turn(text="Searched and closed."),
    ]
    async with codex_setup(nats_server, tmp_path, turns, alias="gpt-5.5") as (up, _, home, work):
        rc, out, err = await run_codex(home, codex_command("gpt-5.5", work), "find and close the agent\n")
    assert rc == 0, explain(rc, out, err)
    assert "Searched and closed." in out
    first, second, third = up.bodies
    assert "tool_search" in tool_names(first) and "multi_agent_v1__close_agent" not in tool_names(first)
    assert "multi_agent_v1__close_agent" in tool_names(second)
    assert "multi_agent_v1__close_agent" in tool_message(second, "call_ts1")["content"]
    assert "unsupported call" not in tool_message(third, "call_ns2")["content"]


async def test_codex_lite_mode_custom_tool_inside_a_namespace(nats_server: EmbeddedNats, tmp_path: Path) -> None:
    # Codex's default slugs use "responses-lite": no top-level tools, but an additional_tools item whose
    # namespace `functions` holds the code-mode custom tool `exec` (JavaScript that calls the tools).
    script = 'const r = await tools.exec_command({cmd: "printf lite-%s ok"});\ntext(JSON.stringify(r));\n'
    turns = [
        Turn(calls=[Call("functions__exec", {"input": script}, "call_lite1")]),
        Turn(text="Lite mode ran lite-ok."),
    ]
    async with codex_setup(nats_server, tmp_path, turns, alias="gpt-6.1-sol") as (up, _, home, work):
        rc, out, err = await run_codex(home, codex_command("gpt-6.1-sol", work), "run echo lite-ok\n")
    assert rc == 0, explain(rc, out, err)
    assert "Lite mode ran lite-ok." in out
    first, second = up.bodies
    assert "functions__exec" in tool_names(first)
    call = [m for m in second["messages"] if m.get("tool_calls")][-1]["tool_calls"][0]
    assert json.loads(call["function"]["arguments"]) == {"input": script}
    assert "lite-ok" in tool_message(second, "call_lite1")["content"]


# --- Codex at its default: the built-in provider pointed at iop with `openai_base_url` ---------------


def default_home(home: Path, edge_url: str, extra: str = "") -> Path:
    """A CODEX_HOME that leaves Codex on its built-in (OpenAI) provider, only its base URL moved to the edge."""
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text(
        f'openai_base_url = "{edge_url}/v1"\n' + CODEX_OFFLINE_TOP + f"{extra}\n" + CODEX_OFFLINE_TABLES
    )
    return home


def _pool(up: ScriptedChat) -> config.Deployment:
    return deployment(pool_of(up.url))


def socket_trouble(err: str) -> list[str]:
    """Codex's lines about a WebSocket that failed, or about falling back to HTTP."""
    return [line for line in err.splitlines() if re.search(r"websocket|falling back|reconnecting", line, re.I)]


class DefaultSession:
    """A session's model: a tool call, then answers; a summary whenever asked for one.

    The tool call reports a prompt past `model_auto_compact_token_limit`, so Codex compacts before
    it sends the call's result back.
    """

    def __init__(self) -> None:
        self.called = False

    def __call__(self, body: dict[str, Any]) -> Turn:
        messages = body["messages"]
        if messages[-1].get("content") == COMPACTION_PROMPT:
            return Turn(text="SUMMARY: the user ran printf and saw iop-ws-ok.")
        if not self.called:
            self.called = True
            return Turn(calls=[Call("exec_command", {"cmd": "printf 'iop-%s' ws-ok"}, "call_ws_sh")], usage=(9000, 7))
        if any("a second question" in str(m.get("content")) for m in messages):
            return Turn(text="Still here after compaction.")
        return Turn(text="The command printed iop-ws-ok.")


async def test_codex_default_provider_runs_a_compacting_session_over_the_websocket(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    keys = EdgeKeys(clients=[Key("codex", b"codex-key")], admins=[])
    async with scripted_chat(DefaultSession()) as up, deployment_running(_pool(up), nats_server.url, keys) as h:
        work = tmp_path / "work"
        work.mkdir()
        home = default_home(tmp_path / "codex-home", h.url, "model_auto_compact_token_limit = 2000")
        env = {"CODEX_API_KEY": "codex-key"}  # what `codex exec` sends as its bearer key
        rc, out, err = await run_codex(home, codex_command("m", work), "run echo iop-ws-ok\n", env)
        assert rc == 0, explain(rc, out, err)
        resume = [
            str(codex_path()),
            "exec",
            "--skip-git-repo-check",
            "-C",
            str(work),
            "-m",
            "m",
            "resume",
            "--last",
            "-",
        ]
        rc2, out2, err2 = await run_codex(home, resume, "a second question\n", env)
        assert rc2 == 0, explain(rc2, out2, err2)
        upgraded = h.edge.http_limits.upgraded
    assert "The command printed iop-ws-ok." in out
    assert "Still here after compaction." in out2
    # Every request went over a socket: none failed, none fell back to HTTP.
    assert upgraded >= 2 and socket_trouble(err + err2) == []
    prompts = [b["messages"][-1].get("content") for b in up.bodies]
    assert COMPACTION_PROMPT in prompts, prompts
    # After the compaction the model read iop's summary in place of the window it replaced.
    after = up.bodies[-1]["messages"]
    assert any(SUMMARY_PREFIX in str(m.get("content")) for m in after), after
