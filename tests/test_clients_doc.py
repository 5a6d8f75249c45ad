"""docs/clients.md, run as written: each of its blocks against a real edge and node (issue 25).

The blocks are read from the page itself, with only the edge's address replaced by the test
edge's, so a change to the page that stops working fails here.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import re
import shutil
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from iop.edge.keys import EdgeKeys, Key
from iop.nats.server import EmbeddedNats
from tests.codex_upstream import Call, ScriptedChat, Turn, scripted_chat
from tests.fakes import fake_upstream
from tests.harness import CODEX_OFFLINE_TABLES, CODEX_OFFLINE_TOP, REPO, EdgeHandle, deployment, deployment_running

PAGE = REPO / "docs" / "clients.md"
NPM_MODULES = REPO / ".ci" / "npm" / "node_modules"
CODEX_BIN = NPM_MODULES / ".bin"
DOC_EDGE = "http://127.0.0.1:8080"
DOC_KEY = b"sk-iop-example"
ANSWER = "hi from iop"
POOL = """
models: [{{alias: coder, pool: [p]}}]
nodes:
  - id: n
    adapters: [{{id: up, type: openai, base_url: "{url}", api: chat}}]
    providers: [{{id: p, adapter: up, model: served-model, capacity: 2}}]
"""


def block(tag: str, lang: str) -> str:
    """The page's one fenced block of `lang` tagged `tag`."""
    found = re.findall(rf"```{lang} {re.escape(tag)}\n(.*?)```", PAGE.read_text(), re.S)
    assert len(found) == 1, f"docs/clients.md has {len(found)} ```{lang} {tag} blocks"
    return str(found[0])


@asynccontextmanager
async def doc_edge(nats_server: EmbeddedNats) -> AsyncIterator[EdgeHandle]:
    def answer(body: dict[str, Any]) -> Turn:
        return Turn(text=ANSWER)

    keys = EdgeKeys(clients=[Key("doc", DOC_KEY)], admins=[])
    async with scripted_chat(answer) as up:
        dep = deployment(POOL.format(url=up.url))
        async with deployment_running(dep, nats_server.url, keys) as h:
            yield h


async def run(command: list[str], env: dict[str, str], cwd: Path, timeout_s: float = 90.0) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        *command,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env=env,
        cwd=cwd,
        start_new_session=True,
    )
    try:
        async with asyncio.timeout(timeout_s):
            out, _ = await proc.communicate()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode is not None
    return proc.returncode, out.decode(errors="replace")


@pytest.mark.parametrize("way", ["codex-default", "codex-custom"])
async def test_clients_doc_codex_config_and_command_answer(nats_server: EmbeddedNats, tmp_path: Path, way: str) -> None:
    if not (CODEX_BIN / "codex").exists() or shutil.which("node") is None:
        pytest.skip("Codex CLI is not installed (.ci/run installs it into .ci/npm when npm exists)")
    async with doc_edge(nats_server) as h:
        home = tmp_path / "codex-home"
        home.mkdir()
        config = block(way, "toml").replace(DOC_EDGE, h.url)
        (home / "config.toml").write_text(CODEX_OFFLINE_TOP + config + CODEX_OFFLINE_TABLES)
        work = tmp_path / "project"
        work.mkdir()
        env = {"PATH": f"{CODEX_BIN}:{os.environ.get('PATH', '')}", "HOME": str(tmp_path), "CODEX_HOME": str(home)}
        assert (await run(["git", "init", "-q", str(work)], env, tmp_path))[0] == 0  # Codex works in a repository
        rc, out = await run(["/bin/sh", "-c", block(way, "sh")], env, work)
        upgraded = h.edge.http_limits.upgraded
    assert rc == 0, out[-3000:]
    assert ANSWER in out
    assert "failed to connect" not in out and "Falling back" not in out
    # The default provider speaks WebSocket mode; the custom one plain HTTP.
    assert (upgraded > 0) == (way == "codex-default")


@pytest.mark.parametrize("way", ["openai-sdk", "openai-sdk-env"])
async def test_clients_doc_openai_sdk_snippet_answers(nats_server: EmbeddedNats, tmp_path: Path, way: str) -> None:
    async with doc_edge(nats_server) as h:
        env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path)}
        if way == "openai-sdk-env":
            env |= {"OPENAI_BASE_URL": h.url + "/v1", "OPENAI_API_KEY": DOC_KEY.decode()}
        script = block(way, "python").replace(DOC_EDGE, h.url)
        rc, out = await run([sys.executable, "-c", script], env, tmp_path)
    assert rc == 0, out
    assert out.splitlines() == [ANSWER] * out.count(ANSWER) and out.count(ANSWER) >= 1


async def test_clients_doc_langchain_chat_and_a_second_responses_turn(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    if importlib.util.find_spec("langchain_openai") is None:
        pytest.skip("LangChain is not installed (the [test] extra installs langchain-openai)")
    seen: list[dict[str, Any]] = []

    def answer(body: dict[str, Any]) -> Turn:
        seen.append(body)
        return Turn(text=ANSWER)

    keys = EdgeKeys(clients=[Key("doc", DOC_KEY)], admins=[])
    async with (
        scripted_chat(answer) as up,
        deployment_running(deployment(POOL.format(url=up.url)), nats_server.url, keys) as h,
    ):
        env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path)}
        rc, out = await run(
            [sys.executable, "-c", block("langchain", "python").replace(DOC_EDGE, h.url)], env, tmp_path
        )
        store = h.edge.responses.store
        assert store is not None
        kept = [await store.response(owner, rid) for owner, rid in (await store.listing(10))[0]]
    assert rc == 0, out
    assert out.splitlines() == [ANSWER] * 3
    # The second Responses turn sent only its new message and the first answer's id: the model
    # still read the whole conversation, put back from the store.
    conversation = [(m["role"], m.get("content")) for m in seen[2]["messages"]]
    assert conversation == [("user", "say hi"), ("assistant", ANSWER), ("user", "and again")]
    second = [k for k in kept if k is not None and k.previous is not None]
    assert len(second) == 1 and [i.get("content") for i in second[0].input] == ["and again"]


async def test_clients_doc_opencode_config_and_command_answer(nats_server: EmbeddedNats, tmp_path: Path) -> None:
    if not (CODEX_BIN / "opencode").exists():
        pytest.skip("opencode is not installed (.ci/run installs opencode-ai into .ci/npm when npm exists)")
    async with doc_edge(nats_server) as h:
        (tmp_path / "opencode.json").write_text(block("opencode", "json").replace(DOC_EDGE, h.url))
        # Nothing but the edge: no model list, update, plugin or language server fetched from elsewhere.
        offline = ("MODELS_FETCH", "AUTOUPDATE", "DEFAULT_PLUGINS", "LSP_DOWNLOAD", "SHARE")
        env = {"PATH": f"{CODEX_BIN}:{os.environ.get('PATH', '')}", "HOME": str(tmp_path)}
        env |= {f"OPENCODE_DISABLE_{what}": "1" for what in offline}
        rc, out = await run(["/bin/sh", "-c", block("opencode", "sh")], env, tmp_path, timeout_s=120)
    assert rc == 0, out[-3000:]
    assert ANSWER in out


async def test_clients_doc_claude_code_command_answers(nats_server: EmbeddedNats, tmp_path: Path) -> None:
    if not (CODEX_BIN / "claude").exists():
        pytest.skip("Claude Code is not installed (.ci/run installs it into .ci/npm when npm exists)")
    async with doc_edge(nats_server) as h:
        env = {"PATH": f"{CODEX_BIN}:{os.environ.get('PATH', '')}", "HOME": str(tmp_path)}
        rc, out = await run(["/bin/sh", "-c", block("claude-code", "sh").replace(DOC_EDGE, h.url)], env, tmp_path)
    assert rc == 0, out[-3000:]
    assert ANSWER in out


async def test_clients_doc_anthropic_sdk_snippet_answers(nats_server: EmbeddedNats, tmp_path: Path) -> None:
    async with doc_edge(nats_server) as h:
        env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path)}
        script = block("anthropic-sdk", "python").replace(DOC_EDGE, h.url)
        rc, out = await run([sys.executable, "-c", script], env, tmp_path)
    assert rc == 0, out
    assert out.splitlines() == [ANSWER]


async def test_clients_doc_embeddings_and_completions_snippet_answers(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    keys = EdgeKeys(clients=[Key("doc", DOC_KEY)], admins=[])
    async with fake_upstream(api="chat,embeddings,completions") as up:
        pool = POOL.format(url=up.url).replace("api: chat", "api: [chat, embeddings, completions]")
        async with deployment_running(deployment(pool), nats_server.url, keys) as h:
            env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path)}
            script = block("openai-embeddings", "python").replace(DOC_EDGE, h.url)
            rc, out = await run([sys.executable, "-c", script], env, tmp_path)
    assert rc == 0, out
    # The fake: a token per word of every input; its completion ends with the suffix it was given.
    assert out.splitlines() == ["2 4", "w0 w1 w2 <fim ", ">"]
    assert set(up.by_path) == {"/v1/embeddings", "/v1/completions"}


@asynccontextmanager
async def tool_edge(nats_server: EmbeddedNats) -> AsyncIterator[tuple[ScriptedChat, EdgeHandle]]:
    """A model that calls `get_weather` for Paris when it has tools and no result yet, then answers with the result."""

    def answer(body: dict[str, Any]) -> Turn:
        last = body["messages"][-1]
        if last["role"] == "tool":
            return Turn(text=f"{ANSWER}: {last['content']}")
        if body.get("tools"):
            return Turn(calls=[Call("get_weather", {"city": "Paris"}, "call_weather")])
        return Turn(text=ANSWER)

    keys = EdgeKeys(clients=[Key("doc", DOC_KEY)], admins=[])
    async with (
        scripted_chat(answer) as up,
        deployment_running(deployment(POOL.format(url=up.url)), nats_server.url, keys) as h,
    ):
        yield up, h


async def test_clients_doc_openai_agents_runs_an_agent_with_a_function_tool(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    if importlib.util.find_spec("agents") is None:
        pytest.skip("the OpenAI Agents SDK is not installed (the [test] extra installs openai-agents)")
    async with tool_edge(nats_server) as (_, h):
        env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path)}
        script = block("openai-agents", "python").replace(DOC_EDGE, h.url)
        rc, out = await run([sys.executable, "-c", script], env, tmp_path)
    assert rc == 0, out
    # The tool ran in the client and its result came back through the edge to the model.
    assert out.splitlines() == [f"{ANSWER}: sunny in Paris"]


async def test_clients_doc_ai_sdk_runs_a_tool_step_and_a_second_turn(nats_server: EmbeddedNats, tmp_path: Path) -> None:
    if not (NPM_MODULES / "@ai-sdk" / "openai").exists() or shutil.which("node") is None:
        pytest.skip("the AI SDK is not installed (.ci/run installs ai and @ai-sdk/openai into .ci/npm when npm exists)")
    async with tool_edge(nats_server) as (up, h):
        (tmp_path / "node_modules").symlink_to(NPM_MODULES)  # the page's `import`s resolve from the script's folder
        script = tmp_path / "doc.mjs"
        script.write_text(block("ai-sdk", "js").replace(DOC_EDGE, h.url))
        env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path)}
        rc, out = await run(["node", str(script)], env, tmp_path)
        store = h.edge.responses.store
        assert store is not None
        kept = [await store.response(owner, rid) for owner, rid in (await store.listing(10))[0]]
    assert rc == 0, out
    assert out.splitlines() == [f"{ANSWER}: sunny in Paris", ANSWER]
    # The second turn named the earlier answer by reference: the edge put back the very item it
    # kept (the SDK itself sends no `logprobs` or `status`), and the model read the whole story.
    answered, second = [k for k in kept if k is not None][-2:]
    assert answered.response["output"][0] in second.input
    assert [m["role"] for m in up.bodies[-1]["messages"]] == ["user", "assistant", "tool", "assistant", "user"]
