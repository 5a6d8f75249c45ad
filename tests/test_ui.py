"""The status page at /ui in a real headless browser (Debian's chromium, driven by selenium) against a real
deployment: edge, nodes, NATS and a fake upstream.

The browser is never downloaded: these tests use /usr/bin/chromium and /usr/bin/chromedriver (`.ci/run`
installs them) and skip, saying so, where they are missing. Each test saves a screenshot in its tmp dir.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from iop import wire
from iop.edge.keys import EdgeKeys, Key
from iop.edge.registry import LOST_AFTER_S
from iop.edge.ui import PERIOD_S
from iop.nats.server import EmbeddedNats
from tests.fakes import FakeUpstream, fake_upstream
from tests.harness import (
    EdgeHandle,
    deployment,
    edge_process,
    eventually,
    node_process,
    running_edge,
    running_node,
    until,
)

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"

try:
    from selenium import webdriver
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait
except ImportError:  # the test extra is not installed
    webdriver = None  # type: ignore[assignment]

FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

# The smoke deployment's topology (3 nodes, 3 providers with capacity 2 + 4 + 4 = 10, one CLI resource),
# its openai providers pointing at a fake upstream the test can hold.
SMOKE = """\
edge:
  queue: {{timeout_s: 30, max_waiting: 100}}
models:
  - alias: qwen-coder
    pool: [mac-mlx-vllm, gpu-a-vllm, gpu-b-vllm]
  - alias: codex
    route: mac-codex-node/codex-cli
nodes:
  - id: mac-codex-node
    adapters:
      - {{id: codex, type: cli, command: [cat], timeout_s: 30}}
      - {{id: mlx, type: openai, base_url: "{up}"}}
    providers:
      - {{id: codex-cli, adapter: codex}}
      - {{id: mac-mlx-vllm, adapter: mlx, model: mlx-community/Qwen2.5-Coder-7B-Instruct-4bit, capacity: 2}}
  - id: gpu-a-node
    adapters:
      - {{id: vllm, type: openai, base_url: "{up}"}}
    providers:
      - {{id: gpu-a-vllm, adapter: vllm, model: Qwen/Qwen2.5-Coder-7B-Instruct, capacity: 4}}
  - id: gpu-b-node
    adapters:
      - {{id: vllm, type: openai, base_url: "{up}"}}
    providers:
      - {{id: gpu-b-vllm, adapter: vllm, model: Qwen/Qwen2.5-Coder-7B-Instruct, capacity: 4}}
"""
NODES = ["mac-codex-node", "gpu-a-node", "gpu-b-node"]
PROVIDERS = ["codex-cli", "mac-mlx-vllm", "gpu-a-vllm", "gpu-b-vllm"]
POOL = "qwen-coder"


def _have_browser() -> str:
    if webdriver is None:
        return "selenium is not installed (pip install -e '.[test]')"
    for path, package in ((CHROMIUM, "chromium"), (CHROMEDRIVER, "chromium-driver")):
        if not os.access(path, os.X_OK):
            return f"{path} is missing: apt-get install -y {package} (.ci/run does)"
    return ""


class Page:
    """One browser tab on the edge's /ui; every selenium call runs in a thread so the edge, the nodes and
    the fake upstream keep running on the test's event loop meanwhile."""

    def __init__(self, driver: Any, shots: Path) -> None:
        self.driver = driver
        self.shots = shots
        self.console: list[dict[str, Any]] = []
        self.finished = False

    async def run(self, fn: Any, *args: Any) -> Any:
        return await asyncio.to_thread(fn, *args)

    async def open(self, url: str) -> None:
        await self.run(self.driver.get, url)

    async def js(self, script: str, *args: Any) -> Any:
        return await self.run(self.driver.execute_script, script, *args)

    async def until(self, script: str, timeout_s: float = 10.0, *args: Any) -> float:
        """Wait until `script` (a JS expression's body, `return …`) is truthy in the page; seconds it took."""
        t0 = time.monotonic()

        def wait() -> None:
            try:
                WebDriverWait(self.driver, timeout_s, poll_frequency=0.05).until(
                    lambda d: d.execute_script(script, *args)
                )
            except TimeoutException:
                body = self.driver.find_element(By.TAG_NAME, "body").text
                raise AssertionError(
                    f"page never satisfied {script!r} within {timeout_s}s; it shows:\n{body}"
                ) from None

        await self.run(wait)
        return time.monotonic() - t0

    async def field(self, scope: str, name: str) -> str:
        text = await self.js(
            "const s = document.querySelector(arguments[0]);"
            "const f = s && s.querySelector('[data-field=\"' + arguments[1] + '\"]');"
            "return f ? f.textContent : null;",
            scope,
            name,
        )
        assert text is not None, f"no {name} in {scope}"
        return str(text)

    async def type_into(self, element_id: str, text: str) -> None:
        def typing() -> None:
            self.driver.find_element(By.ID, element_id).send_keys(text)

        await self.run(typing)

    async def click(self, selector: str) -> None:
        await self.run(lambda: self.driver.find_element(By.CSS_SELECTOR, selector).click())

    async def screenshot(self, name: str) -> Path:
        path = self.shots / f"{name}.png"
        await self.run(self.driver.save_screenshot, str(path))
        return path

    async def finish(self) -> None:
        """Fail on any console error so far, then leave the page: a deployment torn down under an open
        page would make its own (expected) network errors."""
        self.console += await self.run(self.driver.get_log, "browser")
        errors = [e for e in self.console if e["level"] in ("SEVERE", "ERROR")]
        assert errors == [], f"browser console errors: {errors}"
        await self.open("about:blank")
        self.finished = True


@pytest.fixture
def page(tmp_path: Path) -> Iterator[Page]:
    """A fresh headless chromium (own profile under tmp_path); a test ends with `page.finish()`, which
    fails on any browser console error."""
    yield from _browser(tmp_path)


@pytest.fixture
def rebinding_page(tmp_path: Path) -> Iterator[Page]:
    """A chromium for which `evil.test` resolves to 127.0.0.1: what a page whose owner re-pointed
    its name at the visitor's loopback (DNS rebinding) sees, once the re-pointing has happened."""
    yield from _browser(tmp_path, ["--host-resolver-rules=MAP evil.test 127.0.0.1"])


def _browser(tmp_path: Path, extra: list[str] | None = None) -> Iterator[Page]:
    missing = _have_browser()
    if missing:
        pytest.skip(f"no headless browser for the status page tests: {missing}")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    flags = [*FLAGS, *(extra or []), f"--user-data-dir={tmp_path / 'chromium-profile'}", "--window-size=1280,900"]
    for flag in flags:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    p = Page(driver, tmp_path)
    try:
        yield p
        assert p.finished, "the test did not check the browser console (page.finish())"
    finally:
        driver.quit()


@asynccontextmanager
async def edge_on(dep_text: str, nats_url: str, keys: EdgeKeys | None = None) -> AsyncIterator[EdgeHandle]:
    async with running_edge(deployment(dep_text), nats_url, keys) as handle:
        yield handle


@asynccontextmanager
async def smoke_deployment(
    nats_url: str, up: FakeUpstream, *, keys: EdgeKeys | None = None, skip: tuple[str, ...] = ()
) -> AsyncIterator[EdgeHandle]:
    """The smoke topology on `up`: an edge and every node not in `skip`, in this event loop."""
    text = SMOKE.format(up=up.url)
    async with AsyncExitStack() as stack:
        handle = await stack.enter_async_context(edge_on(text, nats_url, keys))
        dep = deployment(text)
        for node in NODES:
            if node not in skip:
                await stack.enter_async_context(running_node(dep, node, nats_url))
        await handle.edge.registry.wait_connected([n for n in NODES if n not in skip], timeout_s=10)
        yield handle


WIDTHS = "return [...document.querySelectorAll('.prov .fill')].map(f => parseFloat(f.style.width))"
"""The in-flight bars of the page's providers, in percent of their capacity."""


def _count(selector: str) -> str:
    return f"return document.querySelectorAll({json.dumps(selector)}).length"


# --- the page and its files ------------------------------------------------------------------------


async def test_ui_files_are_served_with_a_strict_policy_and_no_key(nats_server: EmbeddedNats, tmp_path: Path) -> None:
    async with fake_upstream() as up:
        keys = EdgeKeys(clients=[Key("ops", b"k-1")], admins=[])
        async with smoke_deployment(nats_server.url, up, keys=keys) as handle, handle.http() as http:
            for path, media in [
                ("/ui", "text/html"),
                ("/ui/app.js", "text/javascript"),
                ("/ui/app.css", "text/css"),
                ("/ui/favicon.svg", "image/svg+xml"),
            ]:
                r = await http.get(path)
                assert r.status_code == 200, path
                assert r.headers["content-type"].startswith(media)
                csp = r.headers["content-security-policy"]
                assert "script-src 'self'" in csp and "default-src 'none'" in csp
                assert "frame-ancestors 'none'" in csp and "unsafe-inline" not in csp
                assert r.headers["x-content-type-options"] == "nosniff"
            page = (await http.get("/ui")).text
            # No data in the page itself, no inline script or style, nothing from another origin.
            assert "gpu-a-node" not in page and "qwen-coder" not in page
            assert '<meta name="iop-keys" content="required">' in page
            assert "<style" not in page and " style=" not in page and "<script>" not in page
            assert "http://" not in page and "https://" not in page
            assert (await http.get("/ui/nothing.js")).status_code == 404
            assert (await http.get("/ui/", follow_redirects=True)).url.path == "/ui"
            # The data itself asks for the key, as /status does.
            assert (await http.get("/status/events")).status_code == 401
            auth = {"Authorization": "Bearer k-1"}
            async with http.stream("GET", "/status/events", headers=auth) as stream:
                assert stream.headers["content-type"].startswith("text/event-stream")
                lines = stream.aiter_lines()
                assert await anext(lines) == "event: status"
                data = json.loads((await anext(lines)).removeprefix("data: "))
                assert [n["id"] for n in data["nodes"]] == NODES


async def test_status_reports_the_pools_queue_wait_p50_p95_and_its_tenants(nats_server: EmbeddedNats) -> None:
    gate = asyncio.Event()
    async with fake_upstream(gate=gate) as up, smoke_deployment(nats_server.url, up) as handle:
        before = (await handle.status()).pool(POOL)
        assert before is not None and before.queue_wait_p50_ms is None and before.queue_wait_p95_ms is None
        client = handle.client()
        t0 = time.monotonic()
        burst = [
            asyncio.create_task(client.chat.completions.create(model=POOL, messages=[{"role": "user", "content": "x"}]))
            for _ in range(12)
        ]
        await up.wait_for(lambda u: u.in_flight == 10)
        await until(lambda: handle.edge.scheduler.waiting(POOL) == 2, handle.edge.scheduler.changed)
        held = (await handle.status()).pool(POOL)
        assert held is not None  # without keys every request is the one tenant ""
        assert [(t.tenant, t.waiting, t.running) for t in held.tenants] == [("", 2, 10)]
        async with httpx.AsyncClient(base_url=handle.url) as http:
            metrics = (await http.get("/metrics")).text
        assert f'iop_tenant_waiting{{pool="{POOL}",tenant=""}} 2.0' in metrics
        assert f'iop_tenant_running{{pool="{POOL}",tenant=""}} 10.0' in metrics
        await asyncio.sleep(0.2)  # the held requests' wait: what the p95 must show
        gate.set()
        await asyncio.wait_for(asyncio.gather(*burst), 30)
        after = (await handle.status()).pool(POOL)
        assert after is not None and after.queue_wait_p50_ms is not None and after.queue_wait_p95_ms is not None
        # Ten of twelve took a slot at once; the last two waited at least the 0.2 s the gate stayed shut.
        assert after.queue_wait_p50_ms == 0.0
        assert 200 <= after.queue_wait_p95_ms <= (time.monotonic() - t0) * 1000
        assert after.tenants == []  # nothing waits or runs: no tenant listed


async def test_ui_lists_the_smoke_deployment(nats_server: EmbeddedNats, page: Page) -> None:
    async with fake_upstream() as up, smoke_deployment(nats_server.url, up) as handle:
        await page.open(handle.url + "/ui")
        await page.until(_count('[data-node][data-state="connected"]') + " === 3")
        assert await page.js("return [...document.querySelectorAll('[data-node]')].map(n => n.dataset.node)") == NODES
        shown = await page.js("return [...document.querySelectorAll('[data-provider]')].map(n => n.dataset.provider)")
        assert sorted(shown) == sorted(PROVIDERS)
        pool = f'[data-pool="{POOL}"]'
        assert await page.field(pool, "usable_capacity") == "10 / 10"
        assert await page.field(pool, "waiting") == "0"
        assert await page.field('[data-provider="codex-cli"]', "capacity") == "unlimited"
        assert await page.field('[data-provider="codex-cli"]', "in_flight") == "0 running"
        assert await page.field('[data-provider="gpu-a-vllm"]', "in_flight") == "0/4"
        assert await page.field('[data-provider="gpu-a-vllm"]', "breaker") == "closed"
        assert await page.js(_count('[data-route="codex"]')) == 1
        assert await page.js("return document.getElementById('banners').children.length") == 0
        if getattr(handle.edge, "ledger", None) is None:
            off = "const p = document.getElementById('ledger-off'); return p.checkVisibility() && p.textContent"
            assert "ledger not enabled" in await page.js(off)
        await page.screenshot("smoke-deployment")
        # A phone-width screen: everything still there, nothing wider than the screen.
        await page.run(page.driver.set_window_size, 390, 844)
        await page.until("return document.documentElement.scrollWidth <= window.innerWidth")
        await page.screenshot("smoke-deployment-phone")
        await page.finish()


async def test_ui_burst_fills_and_drains_the_pool(nats_server: EmbeddedNats, page: Page) -> None:
    gate = asyncio.Event()
    async with fake_upstream(gate=gate) as up, smoke_deployment(nats_server.url, up) as handle:
        await page.open(handle.url + "/ui")
        pool = f'[data-pool="{POOL}"]'
        await page.until(_count('[data-node][data-state="connected"]') + " === 3")
        client = handle.client()

        async def ask() -> None:
            await client.chat.completions.create(model=POOL, messages=[{"role": "user", "content": "hi"}])

        burst = [asyncio.create_task(ask()) for _ in range(14)]
        try:
            # Ten slots busy (2 + 4 + 4), four requests waiting: the bars are full and the count shows.
            # Three of the four stand by in the broker, one per provider (edge.queue.standby: 1).
            # A provider's in-flight figure is what its node last reported, so each is waited for.
            await up.wait_for(lambda u: u.in_flight == 10)
            await page.until(
                "const f = (s, n) => document.querySelector(s + ' [data-field=\"' + n + '\"]').textContent;"
                f"return f('{pool}', 'waiting') === '4' && f('{pool}', 'running') === '10'"
                " && f('[data-provider=\"gpu-a-vllm\"]', 'in_flight') === '4/4 +1 queued'"
                " && f('[data-provider=\"gpu-b-vllm\"]', 'in_flight') === '4/4 +1 queued'"
                " && f('[data-provider=\"mac-mlx-vllm\"]', 'in_flight') === '2/2 +1 queued'"
                f" && f('{pool} [data-tenant=\"\"]', 'tenant_load') === '4 waiting · 10 running'"
            )
            assert await page.js(WIDTHS) == [100, 100, 100]
            await page.screenshot("burst-full")
            gate.set()
            await asyncio.wait_for(asyncio.gather(*burst), 30)
        finally:
            gate.set()
            for t in burst:
                t.cancel()
        await page.until(
            "const f = (s, n) => document.querySelector(s + ' [data-field=\"' + n + '\"]').textContent;"
            f"return f('{pool}', 'waiting') === '0' && f('{pool}', 'running') === '0'"
            " && [...document.querySelectorAll('.prov [data-field=\"in_flight\"]')]"
            "    .every(e => e.textContent.startsWith('0'))"
            f" && document.querySelector('{pool} .tenants').hidden"
        )
        assert await page.js(WIDTHS) == [0, 0, 0]
        # The queue's wait was measured and the sparkline kept the burst's peak.
        assert await page.field(pool, "queue_wait_p95_ms") not in ("\u2013", "0 ms")
        assert "top 10" in await page.field(pool, "spark_max")
        await page.screenshot("burst-drained")
        await page.finish()


async def test_ui_shows_a_killed_node_disconnected_then_back(
    nats_server: EmbeddedNats, page: Page, tmp_path: Path
) -> None:
    async with fake_upstream() as up:
        config_file = tmp_path / "smoke.yaml"
        config_file.write_text(SMOKE.format(up=up.url))
        async with smoke_deployment(nats_server.url, up, skip=("gpu-b-node",)) as handle:
            node = '[data-node="gpu-b-node"]'
            await page.open(handle.url + "/ui")
            async with node_process(config_file, "gpu-b-node", nats_server.url) as proc:
                await page.until(f"return document.querySelector('{node}').dataset.state === 'connected'", 15)
                os.kill(proc.pid, signal.SIGKILL)
                took = await page.until(f"return document.querySelector('{node}').dataset.state === 'disconnected'", 15)
            # The edge's bound (no heartbeat for LOST_AFTER_S, checked 4 times a period) plus the feed's period.
            bound = LOST_AFTER_S + wire.HEARTBEAT_INTERVAL_S + PERIOD_S
            assert took <= bound + 1.0, f"disconnected shown after {took:.1f}s (bound {bound:.1f}s)"
            assert "disconnected" in await page.field(node, "state")
            assert await page.field(f'[data-pool="{POOL}"]', "usable_capacity") == "6 / 10"
            await page.screenshot("node-killed")
            async with node_process(config_file, "gpu-b-node", nats_server.url):
                await page.until(f"return document.querySelector('{node}').dataset.state === 'connected'", 15)
                assert await page.field(f'[data-pool="{POOL}"]', "usable_capacity") == "10 / 10"
                await page.screenshot("node-back")
                await page.finish()


async def test_ui_with_keys_shows_nothing_before_a_key(nats_server: EmbeddedNats, page: Page) -> None:
    keys = EdgeKeys(clients=[Key("ops", b"right-key")], admins=[])
    async with fake_upstream() as up, smoke_deployment(nats_server.url, up, keys=keys) as handle:
        await page.open(handle.url + "/ui")
        await page.until("return !document.getElementById('login').hidden")
        assert await page.js("return document.getElementById('main').hidden") is True
        text = await page.js("return document.body.innerText")
        assert not any(name in text for name in [*NODES, *PROVIDERS, POOL])
        assert await page.js(_count("[data-node], [data-provider], [data-pool]")) == 0
        await page.screenshot("key-asked")
        await page.type_into("key", "right-key")
        await page.click('#login button[type="submit"]')
        await page.until(_count('[data-node][data-state="connected"]') + " === 3")
        assert await page.js("return document.getElementById('login').hidden") is True
        # Kept for this tab only: sessionStorage, never localStorage or a cookie.
        assert await page.js("return sessionStorage.getItem('iop.key')") == "right-key"
        assert await page.js("return localStorage.length + document.cookie.length") == 0
        await page.screenshot("key-accepted")
        await page.open(handle.url + "/ui")  # a reload in the same tab keeps the key
        await page.until(_count('[data-node][data-state="connected"]') + " === 3")
        await page.click("#forget")
        await page.until("return !document.getElementById('login').hidden")
        assert await page.js(_count("[data-node], [data-provider], [data-pool]")) == 0
        assert await page.js("return sessionStorage.getItem('iop.key')") is None
        await page.finish()


FETCH = """
const [path, body] = arguments;
const r = await fetch(path, {method: 'POST', headers: {'content-type': 'application/json'}, body});
let code = null;
try { code = (await r.json()).error?.code ?? null; } catch (e) {}
return [r.status, code];
"""


async def test_ui_a_page_on_a_rebound_name_can_neither_run_a_route_nor_refresh_the_deployment(
    nats_server: EmbeddedNats, rebinding_page: Page
) -> None:
    page = rebinding_page
    async with fake_upstream() as up, smoke_deployment(nats_server.url, up) as handle:
        port = handle.url.rsplit(":", 1)[1]
        # A keyless edge on loopback: to the browser, a script of http://evil.test:PORT is now the
        # same origin as the edge (Origin and Host both say evil.test:PORT).
        await page.open(f"http://evil.test:{port}/healthz")
        assert await page.js("return location.host") == f"evil.test:{port}"
        chat = json.dumps({"model": "codex", "messages": [{"role": "user", "content": "cat ~/.ssh/id_rsa"}]})
        assert await page.js(FETCH, "/v1/chat/completions", chat) == [403, "host_not_allowed"]
        assert await page.js(FETCH, "/admin/refresh", "models: []") == [403, "host_not_allowed"]
        assert [m.alias for m in handle.edge.deployment.models] == [POOL, "codex"]
        assert handle.edge.observer.records == 0  # refused before any endpoint: nothing ran
        # The edge's own page under a loopback name still works in this browser.
        await page.open(f"http://localhost:{port}/ui")
        await page.until(_count('[data-node][data-state="connected"]') + " === 3")
        await page.run(page.driver.get_log, "browser")  # the 403s above are expected console errors
        await page.finish()


async def test_ui_shows_recent_requests_and_usage_per_alias(nats_server: EmbeddedNats, page: Page) -> None:
    async with fake_upstream() as up, smoke_deployment(nats_server.url, up) as handle:
        assert handle.edge.ledger is not None, "the ledger is on by default"
        client = handle.client()
        for _ in range(3):
            await client.chat.completions.create(model=POOL, messages=[{"role": "user", "content": "hi"}])
        await client.chat.completions.create(model="codex", messages=[{"role": "user", "content": "echo"}])
        async with handle.http() as http:

            async def recorded() -> bool:
                rows = (await http.get("/usage", params={"since": "1h"})).json()["rows"]
                return bool(sum(r["requests"] for r in rows) == 4)

            await eventually(recorded)
        await page.open(handle.url + "/ui")
        await page.until(_count("#recent tbody tr") + " === 4")
        cells = await page.js(
            "return [...document.querySelectorAll('#recent tbody tr')].map(r => [...r.cells].map(c => c.textContent))"
        )
        assert [c[1] for c in cells].count(POOL) == 3 and [c[1] for c in cells].count("codex") == 1
        assert all(c[3] == "200" for c in cells)
        pool_row = next(c for c in cells if c[1] == POOL)
        assert pool_row[5] == f"5 / {up.tokens}"  # what the upstream reported in `usage`
        assert next(c for c in cells if c[1] == "codex")[5] == "\u2013"  # a CLI reports no tokens: none shown
        await page.until(_count("[data-usage]") + " === 2")
        card = f'[data-usage="{POOL}"]'
        assert "3 requests" in await page.js(f"return document.querySelector('{card}').textContent")
        assert await page.field(card, "tokens") == f"tokens in 15 \u00b7 out {3 * up.tokens} \u00b7 cached 0 %"
        bars = await page.js(
            f"return [...document.querySelectorAll('{card} rect')].map(r => +r.getAttribute('height'))"
        )
        assert len(bars) == 24 and bars[-1] + bars[-2] > 0 and sum(bars[:-2]) == 0  # this hour (or the last)
        assert await page.js("return document.getElementById('ledger-off').checkVisibility()") is False
        await page.screenshot("recent-and-usage")
        await page.finish()


MARKUP = "<img/src=x/onerror=window.pwned=1><script>window.pwned=2</script>"
HOSTILE = f"""\
models:
  - alias: "{MARKUP}"
    pool: [p1]
nodes:
  - id: lonely-node
    adapters:
      - {{id: up, type: openai, base_url: "http://127.0.0.1:9/v1"}}
    providers:
      - {{id: p1, adapter: up, model: "{MARKUP}", capacity: 1}}
"""


async def test_ui_renders_markup_as_text_and_warns_of_lost_nats_and_unusable_pools(
    nats_server: EmbeddedNats, page: Page
) -> None:
    # Ids cannot hold markup (the deployment's id pattern refuses `<`); an alias and a model name can.
    async with edge_on(HOSTILE, nats_server.url) as handle:
        await page.open(handle.url + "/ui")
        await page.until(_count("[data-pool]") + " === 1")
        assert await page.js("return document.querySelector('[data-pool] .name').textContent") == MARKUP
        assert MARKUP in await page.field('[data-provider="p1"]', "adapter")
        assert await page.js("return window.pwned === undefined && document.querySelectorAll('main img').length") == 0
        # Its only provider's node never came: the pool has no usable provider, said in a banner.
        banners = await page.js("return document.getElementById('banners').textContent")
        assert f"Pool {MARKUP} has no usable provider" in banners
        await page.screenshot("markup-and-unusable-pool")
        await nats_server.stop()
        await page.until("return document.getElementById('banners').textContent.includes('lost NATS')", 15)
        await page.screenshot("nats-lost")
        assert await page.js("return window.pwned === undefined")
        await page.finish()


async def test_ui_at_300_providers_collapses_nodes_and_filters(nats_server: EmbeddedNats, page: Page) -> None:
    nodes = []
    for n in range(30):
        providers = ", ".join(f"{{id: n{n:02d}-p{p}, adapter: up, capacity: 4}}" for p in range(10))
        nodes.append(
            f"  - id: node-{n:02d}\n"
            '    adapters: [{id: up, type: openai, base_url: "http://127.0.0.1:9/v1"}]\n'
            f"    providers: [{providers}]\n"
        )
    pools = "".join(
        f"  - alias: pool-{n:02d}\n    pool: [{', '.join(f'n{n:02d}-p{p}' for p in range(10))}]\n" for n in range(30)
    )
    text = "models:\n" + pools + "nodes:\n" + "".join(nodes)
    async with edge_on(text, nats_server.url) as handle:
        await page.open(handle.url + "/ui")
        await page.until(_count("[data-provider]") + " === 300")
        assert await page.js(_count("details[data-node][open]")) == 0
        await page.type_into("filter", "n17-p3")
        await page.until(_count("details[data-node]:not([hidden])") + " === 1")
        assert await page.js(
            "return [...document.querySelectorAll('[data-provider]')].filter(r => !r.hidden && r.offsetParent)"
            ".map(r => r.dataset.provider)"
        ) == ["n17-p3"]
        await page.screenshot("300-providers-filtered")
        await page.finish()


async def test_open_status_streams_do_not_hold_the_edges_shutdown(nats_server: EmbeddedNats, tmp_path: Path) -> None:
    # A status page holds /status/events and /usage/tail open; SIGTERM must not wait out the 30 s grace for them.
    config_file = tmp_path / "d.yaml"
    config_file.write_text(HOSTILE)
    async with (
        edge_process(config_file, nats_server.url) as (proc, url),
        httpx.AsyncClient(base_url=url) as http,
        http.stream("GET", "/status/events") as events,
        http.stream("GET", "/usage/tail") as tail,
    ):
        assert events.status_code == 200 and tail.status_code == 200
        lines = events.aiter_lines()
        assert await anext(lines) == "event: status"
        t0 = time.monotonic()
        proc.proc.send_signal(signal.SIGTERM)
        assert await proc.exit_code(timeout_s=20) == 0
        assert time.monotonic() - t0 < 10, "the edge waited for its open streams"


# --- the archive serves the page --------------------------------------------------------------------


@pytest.mark.timeout(600)  # the shared archive fixture may have to build first
async def test_ui_is_served_from_the_built_archive(built_archive: Path, tmp_path: Path) -> None:
    config_file = tmp_path / "d.yaml"
    config_file.write_text(
        "edge:\n"
        f"  nats: {{listen: '127.0.0.1:0', store_dir: '{tmp_path / 'nats'}'}}\n"
        "models: [{alias: a, pool: [p]}]\n"
        "nodes: [{id: n, adapters: [{id: m, type: mock}], providers: [{id: p, adapter: m, capacity: 1}]}]\n"
    )
    python = getattr(sys, "_base_executable", sys.executable)
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path), "IOP_CACHE_DIR": str(tmp_path / "cache")}
    proc = await asyncio.create_subprocess_exec(
        python, "-S", str(built_archive), "edge", "--config", str(config_file), "--listen", "127.0.0.1:0",
        cwd=tmp_path, env=env, stdout=asyncio.subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        url = ""
        async with asyncio.timeout(60):
            while not url:
                line = (await proc.stdout.readline()).decode()
                assert line, "the archive's edge ended before it listened"
                if "iop edge listening on " in line:
                    url = line.split("listening on ", 1)[1].split()[0]
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            for path in ("/ui", "/ui/app.js", "/ui/app.css", "/ui/favicon.svg"):
                r = await http.get(path)
                assert r.status_code == 200 and r.content, path
            assert (await http.get("/ui/app.js")).content == (
                Path(__file__).parents[1] / "iop/edge/static/app.js"
            ).read_bytes()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            async with asyncio.timeout(15):
                await proc.wait()
        except TimeoutError:
            proc.kill()
            await proc.wait()
