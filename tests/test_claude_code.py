"""Claude Code, the real client, through iop to a chat-only model server: a tool-calling session over
/v1/messages, and Claude Code as a node's CLI resource (its own model calls going back through the edge)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from iop.nats.server import EmbeddedNats
from tests.codex_upstream import Call, Turn, scripted_chat
from tests.harness import deployment, running_edge, running_node
from tests.test_ledger import ledger_records

CLAUDE_CODE_VERSION = "2.1.328"
"""The Claude Code release whose requests docs/anthropic-compat.md was written from."""
ROOT = Path(__file__).resolve().parent.parent
CLAUDE = ROOT / ".ci" / "npm" / "node_modules" / ".bin" / "claude"
RUN_TIMEOUT_S = 120.0
KEY = "sk-iop-claude-code-key"
MARK = "hello-from-iop"


def claude_path() -> Path:
    if not CLAUDE.exists():
        pytest.skip(
            "Claude Code is not installed: npm install --prefix .ci/npm "
            f"@anthropic-ai/claude-code@{CLAUDE_CODE_VERSION} "
            "(.ci/run does it when npm exists)"
        )
    return CLAUDE


def claude_env(home: Path, edge_url: str, model: str) -> dict[str, str]:
    """Claude Code sent to the edge with a client key, its home a temporary directory, nothing else online."""
    home.mkdir(parents=True, exist_ok=True)
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": edge_url,
        "ANTHROPIC_API_KEY": KEY,
        "ANTHROPIC_MODEL": model,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
    }


def model_turn(body: dict[str, Any]) -> Turn:
    """The chat model behind the alias: run the shell command first, then report what it printed."""
    results = [m for m in body["messages"] if m.get("role") == "tool"]
    if not results:
        if not any(t["function"]["name"] == "Bash" for t in body.get("tools") or []):
            return Turn(text="ok")  # a side request of Claude Code's own, without tools
        return Turn(calls=[Call("Bash", {"command": f"echo {MARK}", "description": "Print a greeting"})])
    return Turn(text=f"The command printed: {results[-1]['content'].strip()}")


def pool_yaml(url: str, cli: str = "") -> str:
    return f"""
edge: {{api_keys_env: IOP_TEST_KEYS}}
models:
  - {{alias: coder, pool: [p]}}
{"  - {alias: claude-agent, route: n/claude}" if cli else ""}
nodes:
  - id: n
    adapters:
      - {{id: up, type: openai, base_url: "{url}", api: chat}}
{cli}
    providers:
      - {{id: p, adapter: up, model: served-model, capacity: 2}}
{"      - {id: claude, adapter: claude}" if cli else ""}
"""


async def test_claude_code_runs_a_tool_session_over_a_chat_only_model(
    nats_server: EmbeddedNats, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    claude = claude_path()
    monkeypatch.setenv("IOP_TEST_KEYS", KEY)
    async with scripted_chat(model_turn) as up:
        dep = deployment(pool_yaml(up.url))
        async with running_edge(dep, nats_server.url) as h, running_node(dep, "n", nats_server.url):
            await h.edge.registry.wait_connected(["n"], timeout_s=10)
            proc = await asyncio.create_subprocess_exec(
                str(claude),
                "-p",
                f"Run `echo {MARK}` and tell me what it printed.",
                "--allowedTools",
                "Bash",
                "--output-format",
                "json",
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=claude_env(tmp_path / "home", h.url, "coder"),
                cwd=tmp_path,
            )
            out, err = await asyncio.wait_for(proc.communicate(), RUN_TIMEOUT_S)
            assert proc.returncode == 0, err.decode(errors="replace")[-2000:]
            result = json.loads(out)
            assert result["subtype"] == "success" and not result["is_error"]
            assert MARK in result["result"]
            records = await ledger_records(h, len(up.bodies))
    # The session's model turns reached the chat server as chat requests: the tool call, then its output.
    with_tools = [b for b in up.bodies if b.get("tools")]
    assert len(with_tools) >= 2
    answered = with_tools[-1]["messages"]
    call = next(m for m in answered if m.get("tool_calls"))
    assert call["tool_calls"][0]["function"]["name"] == "Bash"
    tool = next(m for m in answered if m["role"] == "tool")
    assert tool["tool_call_id"] == call["tool_calls"][0]["id"] and MARK in tool["content"]
    assert all(b["model"] == "served-model" and b["stream"] for b in with_tools)
    assert {(r.api, r.alias, r.status) for r in records} == {("messages", "coder", 200)}


@pytest.mark.skipif(shutil.which("bash") is None, reason="Claude Code's Bash tool needs bash")
async def test_claude_code_as_a_cli_resource_answers_chat_through_the_edge(
    nats_server: EmbeddedNats, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    claude = claude_path()
    monkeypatch.setenv("IOP_TEST_KEYS", KEY)
    home = tmp_path / "home"
    home.mkdir()
    async with scripted_chat(model_turn) as up:
        cli = (
            f"      - {{id: claude, type: cli, command: [{json.dumps(str(claude))}, -p, --allowedTools, Bash], "
            "env: [ANTHROPIC_BASE_URL, ANTHROPIC_API_KEY, ANTHROPIC_MODEL, CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC, "
            "DISABLE_TELEMETRY, DISABLE_AUTOUPDATER], timeout_s: 120}"
        )
        dep = deployment(pool_yaml(up.url, cli))
        async with running_edge(dep, nats_server.url) as h:
            # The node passes the command only the variables its adapter names: these, set before it starts.
            for name, value in claude_env(home, h.url, "coder").items():
                monkeypatch.setenv(name, value)
            async with running_node(dep, "n", nats_server.url):
                await h.edge.registry.wait_connected(["n"], timeout_s=10)
                client = h.client(KEY, timeout=RUN_TIMEOUT_S)
                answer = await client.chat.completions.create(
                    model="claude-agent",
                    messages=[{"role": "user", "content": f"Run `echo {MARK}` and tell me what it printed."}],
                )
                records = await ledger_records(h, 1 + len(up.bodies))
    assert MARK in (answer.choices[0].message.content or "")
    # Claude Code's own model calls went back through the edge, as Messages to the pool.
    by_alias = {(r.alias, r.api) for r in records}
    assert ("claude-agent", "chat") in by_alias and ("coder", "messages") in by_alias
    assert any(m["role"] == "tool" and MARK in m["content"] for b in up.bodies for m in b["messages"])
