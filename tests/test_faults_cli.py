"""CLI faults (hang, missing, failing, leftovers, huge output) and request bodies over max_payload."""

from __future__ import annotations

import asyncio
import hashlib
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from iop.nats.server import MAX_PAYLOAD, EmbeddedNats
from tests.fakes import FakeUpstream, fake_upstream
from tests.harness import EdgeHandle, deployment, pid_gone, running_edge, running_node, sse_events, wait_gone

TIMEOUT_S = 1.0
BIG_LINES = 400_000
"""Lines of the big output: 3.2 MiB, several NATS chunks and more than the flow-control window."""

# Each script learns a tag from its prompt (stdin) and writes pids to a file of that name.
HANG = """
import os, pathlib, subprocess, sys, time
tag = sys.stdin.read().strip()
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
(pathlib.Path(sys.argv[1]) / tag).write_text(f"{os.getpid()} {child.pid}")
print("working on it", flush=True)
time.sleep(600)
"""
LEFTOVER = """
import os, pathlib, subprocess, sys
tag = sys.stdin.read().strip()
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
(pathlib.Path(sys.argv[1]) / tag).write_text(f"{os.getpid()} {child.pid}")
print("done, a helper stays behind")
"""
FAIL = """
import sys
sys.stdin.read()
print("partial output")
sys.stderr.write("noise\\n" * 1000 + "fatal: the model file is missing\\n")
sys.exit(3)
"""
BIG = f"""
import sys
sys.stdin.read()
sys.stdout.write("".join("%07d\\n" % i for i in range({BIG_LINES})))
"""
DIGEST = """
import hashlib, sys
data = sys.stdin.buffer.read()
print(len(data), hashlib.sha256(data).hexdigest())
"""


def cli_yaml(tmp: Path, pool_url: str) -> str:
    scripts = {"hang": HANG, "leftover": LEFTOVER, "fail": FAIL, "big": BIG, "digest": DIGEST}
    adapters = []
    for name, code in scripts.items():
        (tmp / f"{name}.py").write_text(code)
        adapters.append(
            f'      - {{id: {name}, type: cli, command: ["{sys.executable}", "{tmp / name}.py", "{tmp}"], '
            f"timeout_s: {TIMEOUT_S if name == 'hang' else 30}}}"
        )
    adapters.append('      - {id: missing, type: cli, command: ["/nonexistent/iop-no-such-tool"]}')
    names = [*scripts, "missing"]
    return f"""
models:
  - {{alias: m, pool: [p]}}
{chr(10).join(f"  - {{alias: {n}, route: n/{n}-cli}}" for n in names)}
nodes:
  - id: n
    adapters:
      - {{id: up, type: openai, base_url: "{pool_url}", api: both}}
{chr(10).join(adapters)}
    providers:
      - {{id: p, adapter: up, capacity: 1}}
{chr(10).join(f"      - {{id: {n}-cli, adapter: {n}}}" for n in names)}
"""


@asynccontextmanager
async def cli_deployment(nats_url: str, tmp: Path) -> AsyncIterator[tuple[EdgeHandle, FakeUpstream]]:
    async with fake_upstream() as up:
        dep = deployment(cli_yaml(tmp, up.url))
        async with running_edge(dep, nats_url) as h, running_node(dep, "n", nats_url):
            await h.edge.registry.wait_connected(["n"], timeout_s=10)
            yield h, up


def ask(model: str, content: str, stream: bool = False) -> dict[str, object]:
    return {"model": model, "stream": stream, "messages": [{"role": "user", "content": content}]}


def pids_of(tmp: Path, tag: str) -> list[int]:
    return [int(p) for p in (tmp / tag).read_text().split()]


async def test_cli_hang_is_killed_at_timeout_with_its_whole_group(nats_server: EmbeddedNats, tmp_path: Path) -> None:
    async with cli_deployment(nats_server.url, tmp_path) as (h, _), h.http() as http:
        t0 = time.monotonic()
        whole, streamed = await asyncio.gather(
            http.post("/v1/chat/completions", json=ask("hang", "whole")),
            http.post("/v1/chat/completions", json=ask("hang", "streamed", stream=True)),
        )
        took = time.monotonic() - t0
        assert whole.status_code == 502
        err = whole.json()["error"]
        assert err["code"] == "cli_timeout" and f"{TIMEOUT_S:g}s" in err["message"]
        # The stream had started: its end is an error event, after what the command printed.
        assert streamed.status_code == 200
        events = sse_events(streamed.text)
        assert "working on it" in "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1])
        assert events[-1]["error"]["code"] == "cli_timeout"
        for tag in ("whole", "streamed"):
            for pid in pids_of(tmp_path, tag):  # the command and the child it started
                await wait_gone(pid, timeout_s=2)
                assert pid_gone(pid)
    print(f"\nCLI hang: both requests failed after {took:.2f}s (timeout_s {TIMEOUT_S:g}), process groups gone")
    assert TIMEOUT_S <= took < TIMEOUT_S + 2


async def test_cli_leaves_no_orphans_even_when_it_succeeds(nats_server: EmbeddedNats, tmp_path: Path) -> None:
    async with cli_deployment(nats_server.url, tmp_path) as (h, _), h.http() as http:
        r = await http.post("/v1/chat/completions", json=ask("leftover", "ok"))
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == "done, a helper stays behind\n"
        _, helper = pids_of(tmp_path, "ok")
        await wait_gone(helper, timeout_s=2)


async def test_cli_missing_or_failing_command_gives_a_clear_error(nats_server: EmbeddedNats, tmp_path: Path) -> None:
    async with cli_deployment(nats_server.url, tmp_path) as (h, _), h.http() as http:
        r = await http.post("/v1/chat/completions", json=ask("missing", "x"))
        assert r.status_code == 502
        err = r.json()["error"]
        assert err["code"] == "cli_not_found" and "/nonexistent/iop-no-such-tool" in err["message"]

        r = await http.post("/v1/chat/completions", json=ask("fail", "x"))
        assert r.status_code == 502
        err = r.json()["error"]
        assert err["code"] == "cli_failed"
        assert err["message"].startswith("command exited with status 3: ")
        assert err["message"].endswith("fatal: the model file is missing")  # stderr's tail, not its start
        assert len(err["message"]) < 2100

        r = await http.post("/v1/chat/completions", json=ask("fail", "x", stream=True))
        events = sse_events(r.text)
        assert events[-1]["error"]["code"] == "cli_failed"


async def test_cli_output_larger_than_a_message_arrives_whole(nats_server: EmbeddedNats, tmp_path: Path) -> None:
    expected = "".join(f"{i:07d}\n" for i in range(BIG_LINES))
    assert len(expected) > 3 * 1024 * 1024
    async with cli_deployment(nats_server.url, tmp_path) as (h, _), h.http() as http:
        whole = await http.post("/v1/chat/completions", json=ask("big", "x"))
        assert whole.status_code == 200
        assert whole.json()["choices"][0]["message"]["content"] == expected
        streamed = await http.post("/v1/chat/completions", json=ask("big", "x", stream=True))
        events = sse_events(streamed.text)
        text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices"))
        assert text == expected


async def test_request_bodies_larger_than_max_payload_arrive_whole(nats_server: EmbeddedNats, tmp_path: Path) -> None:
    big = "y" * (MAX_PAYLOAD + 2 * 1024 * 1024)  # 10 MiB: larger than any NATS message here
    async with cli_deployment(nats_server.url, tmp_path) as (h, up), h.http() as http:
        h.edge.current.max_body_bytes = 32 * 1024 * 1024  # the edge's own HTTP limit is not what is tested
        relay = h.edge.relay
        small = await http.post("/v1/chat/completions", json=ask("m", "small"))
        assert small.status_code == 200 and relay.publish.bodies_by_reference == 0  # small bodies travel inline

        t0 = time.monotonic()
        pooled = await http.post("/v1/chat/completions", json=ask("m", big), timeout=60)
        pooled_s = time.monotonic() - t0
        assert pooled.status_code == 200, pooled.text
        assert up.bodies[-1]["messages"][0]["content"] == big

        direct = await http.post("/v1/chat/completions", json=ask("digest", big), timeout=60)
        assert direct.status_code == 200, direct.text
        size, digest = direct.json()["choices"][0]["message"]["content"].split()
        assert (int(size), digest) == (len(big), hashlib.sha256(big.encode()).hexdigest())
        assert relay.publish.bodies_by_reference == 2
    print(f"\n10 MiB request body through a pool: {pooled_s:.2f}s end to end")
