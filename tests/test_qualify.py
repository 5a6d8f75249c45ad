"""`iop qualify` against a real edge, node and NATS, with fake upstreams of known parallel compute.

The fake (tests/qualify_upstream.py) decodes `parallel` = K requests at full speed and shares its
compute beyond that, so its aggregate tokens/s plateau past K: the recommendation must find K.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from xml.etree import ElementTree

import httpx
import msgspec
import nats.errors
import pytest

from iop import wire
from iop.client import EdgeClient
from iop.contracts.status import PoolProviderStatus, QualificationSummary
from iop.edge.keys import EdgeKeys, Key
from iop.edge.scheduler import Scheduler
from iop.nats import connection
from iop.nats.server import EmbeddedNats
from iop.qualify import runner
from iop.qualify.probes import Target, run_checks
from iop.qualify.schema import Check, Recommendation, Report, decode_report, encode_report
from tests.fakes import serve_asgi
from tests.harness import EdgeHandle, deployment, deployment_running, eventually, iop_process, until
from tests.qualify_upstream import Flaw, LimitedUpstream

ONE = """
edge:
  queue: {{timeout_s: 30, max_waiting: 100}}
models:
  - {{alias: m, pool: [q]}}
nodes:
  - id: n1
    adapters:
      - {{id: up, type: openai, base_url: "{up}/v1", api: chat}}
    providers:
      - {{id: q, adapter: up, model: fake-7b, capacity: {cap}}}
"""


@asynccontextmanager
async def limited(**knobs: object) -> AsyncIterator[tuple[LimitedUpstream, str]]:
    up = LimitedUpstream(**knobs)  # type: ignore[arg-type]
    async with serve_asgi(up.app()) as url:
        yield up, url


def _check(checks: list[Check], cid: str) -> Check:
    return next(c for c in checks if c.id == cid)


async def test_qualify_finds_the_plateau_of_a_server_with_parallel_slots(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    # K=3 behind a configured capacity of 4, swept to 8 through a real edge and node. Which level is
    # the knee is pinned exactly on a modelled server (tests/test_qualify_sweep.py); here, where a
    # loaded machine moves rates (each gap between a worker's requests idles a slot at K, which a
    # level above K hides), the knee must be near K and well short of the ceiling: a sweep that did
    # not see the plateau would recommend 7 or 8.
    k, cap = 3, 4
    async with limited(parallel=k, token_s=0.01, tokens_per_chunk=4) as (up, url):
        dep = deployment(ONE.format(up=url, cap=cap))
        async with deployment_running(dep, nats_server.url) as h:
            opts = runner.Options(edge=h.url, exclusive=True, quick=True, output_tokens=32, out=tmp_path)
            lines: list[str] = []
            (report,) = await runner.run(opts, lines.append)
            rec = report.recommendation
            assert rec.swept_to == 2 * cap
            assert rec.recommended_capacity is not None
            assert k - 1 <= rec.recommended_capacity <= k + 3, (rec, report.sweep)
            # Past K the rate is flat: the peak is 1.5x the rate of 2 at once for this server, 4x for
            # one without a plateau.
            at_2 = next(lv for lv in report.sweep if lv.concurrency == 2)
            assert rec.peak_throughput_tok_s is not None and rec.peak_throughput_tok_s < 2.5 * at_2.throughput_tok_s
            # Every probe a good server passes, passed; reasoning is a fact, not a verdict.
            failed = [c for c in report.checks if c.status not in ("pass", "info")]
            assert not failed, failed
            # The cap held: never more at once upstream than the ceiling of the exclusive sweep.
            assert up.peak_active <= 2 * cap
            # Put back: capacity and pools as configured, and the result kept at the edge.
            st = (await h.status()).providers()["q"][1]
            assert isinstance(st, PoolProviderStatus)
            assert not st.qualifying and st.capacity == cap
            assert st.qualification is not None and st.qualification.recommended_capacity == rec.recommended_capacity
            info = await h.edge.js.consumer_info(wire.WORK_STREAM, wire.consumer_name("q"))
            assert info.config.max_ack_pending == cap
            shown = await runner.show(runner.Options(edge=h.url))
            assert [r.provider for r in shown] == ["q"] and shown[0].recommendation == rec
        written = decode_report((tmp_path / f"{report.key()}.json").read_bytes())
        assert written.sweep == report.sweep
        assert report.key().startswith("q--") and report.key().endswith("--fake-7b")


@pytest.mark.parametrize(
    ("flaw", "check", "reason"),
    [
        ("bad_tool_call", "tool_call", "the arguments are not JSON"),
        ("no_stream_usage", "usage_stream", "the stream reported no usage"),
        ("ignores_max_tokens", "max_tokens", "asked for at most 8 tokens, got 40"),
    ],
)
async def test_qualify_checks_fail_with_their_reason(
    nats_server: EmbeddedNats, flaw: Flaw, check: str, reason: str
) -> None:
    async with limited(parallel=4, token_s=0.001, flaw=flaw) as (_, url):
        dep = deployment(ONE.format(up=url, cap=2))
        async with deployment_running(dep, nats_server.url) as h, EdgeClient(h.url) as client:
            checks = await run_checks(Target(client, "q", "m", 30.0), 60.0)
    found = _check(checks, check)
    assert found.status == "fail" and reason in found.reason, found
    others = [c for c in checks if c.status == "fail" and c.id != check]
    assert not others, others


async def test_a_client_key_cannot_pin_drain_or_keep(nats_server: EmbeddedNats) -> None:
    async with limited(parallel=2) as (_, url):
        dep = deployment(ONE.format(up=url, cap=2))
        keys = EdgeKeys(clients=[Key("c", b"client-key")], admins=[Key("a", b"admin-key")])
        async with deployment_running(dep, nats_server.url) as h:
            h.edge.keys = keys
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
            async with httpx.AsyncClient(base_url=h.url, headers={"Authorization": "Bearer client-key"}) as c:
                assert (await c.post("/v1/chat/completions", json=body)).status_code == 200
                for method, path, payload in [
                    ("POST", "/admin/qualify/providers/q/v1/chat/completions", body),
                    ("POST", "/admin/qualify/leases", {"providers": ["q"], "exclusive": True}),
                    ("GET", "/admin/qualify/status", None),
                    ("GET", "/admin/qualify/results", None),
                ]:
                    r = await c.request(method, path, json=payload)
                    assert r.status_code == 403, (path, r.text)
                    assert r.json()["error"]["code"] == "not_admin"
            async with EdgeClient(h.url, api_key="admin-key") as admin:
                r = await admin.pinned("q", "chat", msgspec.json.encode(body), 10.0)
                assert r.status_code == 200 and r.headers["x-iop-provider"] == "q"


TWO = """
edge:
  queue: {{timeout_s: 30, max_waiting: 100}}
models:
  - {{alias: m, pool: [q, o]}}
nodes:
  - id: n1
    adapters:
      - {{id: uq, type: openai, base_url: "{uq}/v1"}}
      - {{id: uo, type: openai, base_url: "{uo}/v1"}}
    providers:
      - {{id: q, adapter: uq, capacity: 2}}
      - {{id: o, adapter: uo, capacity: 2}}
"""


async def _user_requests(h: EdgeHandle, n: int, tag: str) -> list[str]:
    """`n` user requests on pool m at once; the providers that answered them."""
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": f"{tag} hello"}]}
    async with httpx.AsyncClient(base_url=h.url, timeout=30) as c:
        rs = await asyncio.gather(*(c.post("/v1/chat/completions", json=body) for _ in range(n)))
    assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
    return [r.headers["x-iop-provider"] for r in rs]


async def test_exclusive_drains_and_the_edge_restores_when_the_qualifier_is_killed(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    async with (
        limited(parallel=2, token_s=0.01, tag="USER") as (uq, url_q),
        limited(parallel=2, token_s=0.002, tag="USER") as (uo, url_o),
    ):
        dep = deployment(TWO.format(uq=url_q, uo=url_o))
        async with deployment_running(dep, nats_server.url) as h:
            args = ("qualify", "--edge", h.url, "--provider", "q", "--exclusive", "--tokens", "400", "--lease-ttl", "5")
            async with iop_process(*args, stop_grace_s=0) as qualifier:
                await qualifier.wait_line(r"q: sweep", timeout_s=60)
                slots = h.edge.scheduler.providers["q"]
                assert slots.drained and slots.capacity == 4
                # User traffic meanwhile: answered, and only by the other provider.
                await h.edge.registry.wait_connected(["n1"], timeout_s=5)
                assert set(await _user_requests(h, 6, "USER")) == {"o"}
                assert uq.tagged == 0
                await eventually(lambda: _true(uq.active > 0), timeout_s=20)
                os.kill(qualifier.pid, signal.SIGKILL)
                await qualifier.exit_code(timeout_s=10)
            # The lease is no longer renewed: the edge puts q back by itself.
            await eventually(lambda: _true(not slots.drained and slots.capacity == 2), timeout_s=15)
            info = await h.edge.js.consumer_info(wire.WORK_STREAM, wire.consumer_name("q"))
            assert info.config.max_ack_pending == 2
            await eventually(lambda: _true(uq.active == 0), timeout_s=20)
            assert uq.tagged == 0
            assert "q" in await _user_requests(h, 8, "USER")
        assert uq.peak_active <= 4 and uo.peak_active <= 2


async def test_ctrl_c_puts_the_provider_back_at_once(nats_server: EmbeddedNats) -> None:
    """SIGINT mid-sweep: the qualifier ends its lease itself (long before the 60 s ttl) and exits 130."""
    async with limited(parallel=2, token_s=0.01) as (_, url):
        dep = deployment(ONE.format(up=url, cap=2))
        async with deployment_running(dep, nats_server.url) as h:
            args = ("qualify", "--edge", h.url, "--exclusive", "--tokens", "400", "--lease-ttl", "60")
            async with iop_process(*args, stop_grace_s=0) as qualifier:
                await qualifier.wait_line(r"q: sweep", timeout_s=60)
                slots = h.edge.scheduler.providers["q"]
                assert slots.drained and slots.capacity == 4
                os.kill(qualifier.pid, signal.SIGINT)
                assert await qualifier.exit_code(timeout_s=20) == 130
                assert not slots.drained and slots.capacity == 2
            assert any("interrupted: the providers were put back" in line for line in qualifier.stderr)
            assert not h.edge.qualify.leases


async def _true(value: bool) -> bool:
    return value


async def test_qualify_cli_shows_and_prints_the_capacity_change(nats_server: EmbeddedNats, tmp_path: Path) -> None:
    async with limited(parallel=3, token_s=0.005, tokens_per_chunk=4) as (_, url):
        dep = deployment(ONE.format(up=url, cap=1))
        async with deployment_running(dep, nats_server.url) as h:
            args = ("qualify", "--edge", h.url, "--quick", "--tokens", "12", "--out", str(tmp_path))
            async with iop_process(*args) as run:
                assert await run.exit_code(timeout_s=90) == 0, run.lines
            assert "| chat_whole | protocol | pass |" in "\n".join(run.stdout), run.lines
            async with iop_process("qualify", "--edge", h.url, "--show", "--apply-capacity") as show:
                assert await show.exit_code(timeout_s=30) == 0, show.lines
            text = "\n".join(show.stdout)
            assert "## q — fake-7b on" in text
            assert "capacity 1 is at the knee or below it" in text
            assert "# every qualified provider's capacity matches" in text
            async with iop_process("status", "--edge", h.url) as status:
                assert await status.exit_code(timeout_s=30) == 0, status.lines
            assert any(line.startswith("q ") and "capacity 1 is at the knee" in line for line in status.stdout), (
                status.lines
            )
    assert sorted(p.name for p in tmp_path.iterdir())[-2:] == ["qualification.html", "qualification.md"]  # noqa: ASYNC240


def test_capacity_change_names_node_provider_and_new_capacity() -> None:
    rec = Recommendation(configured_capacity=4, swept_to=8, recommended_capacity=6, verdict="capacity 4, recommended 6")
    summary = QualificationSummary(date="2026-12-01T05:00:00Z", verdict=rec.verdict)
    report = Report(
        provider="gpu-a-vllm",
        node="gpu-a-node",
        alias="qwen-coder",
        model="Qwen/Qwen2.5-Coder-7B-Instruct",
        adapter_type="openai",
        configured_capacity=4,
        exclusive=True,
        quick=False,
        started=summary.date,
        finished=summary.date,
        duration_s=1.0,
        iop_version="0",
        recommendation=rec,
        summary=summary,
    )
    text = runner.capacity_change([report])
    assert "  - id: gpu-a-node\n    providers:\n      - id: gpu-a-vllm\n        capacity: 6  # was 4" in text
    assert decode_report(encode_report(report)) == report


# --- the HTML report ----------------------------------------------------------------------------

THROUGHPUT = "aggregate output tokens/s"


def _svg_points(page: str, title: str) -> list[tuple[int, float, float, float]]:
    """(concurrency, value, cx, cy) of each point of the chart `title`, read from the inline SVG as XML."""
    start = page.index(f'data-title="{title}"')
    svg = page[page.rindex("<svg", 0, start) : page.index("</svg>", start) + len("</svg>")]
    root = ElementTree.fromstring(svg)
    return [
        (
            int(c.get("data-concurrency", "")),
            float(c.get("data-value", "")),
            float(c.get("cx", "")),
            float(c.get("cy", "")),
        )
        for c in root.iter("{http://www.w3.org/2000/svg}circle")
    ]


def _check_curve(points: list[tuple[int, float, float, float]], report: Report) -> None:
    """The chart holds every measured level once, left to right, higher throughput drawn higher."""
    assert [(c, v) for c, v, _, _ in points] == [(lv.concurrency, lv.throughput_tok_s) for lv in report.sweep]
    xs = [x for _, _, x, _ in points]
    assert xs == sorted(xs) and len(set(xs)) == len(xs)
    by_value = sorted(points, key=lambda p: p[1])
    assert [p[3] for p in by_value] == sorted((p[3] for p in by_value), reverse=True)


async def _one_report(nats_url: str, out: Path) -> Report:
    async with (
        limited(parallel=2, token_s=0.005, tokens_per_chunk=4) as (_, url),
        deployment_running(deployment(ONE.format(up=url, cap=2)), nats_url) as h,
    ):
        opts = runner.Options(edge=h.url, exclusive=True, quick=True, output_tokens=12, out=out)
        (report,) = await runner.run(opts, lambda line: None)
    return report


async def test_html_report_svg_holds_the_measured_points(nats_server: EmbeddedNats, tmp_path: Path) -> None:
    """Parsed as XML: no browser needed (the browser test below opens the same file in chromium)."""
    report = await _one_report(nats_server.url, tmp_path)
    page = (tmp_path / "qualification.html").read_text()
    assert "<script" not in page and "http://" not in page.replace("http://www.w3.org/2000/svg", "")
    _check_curve(_svg_points(page, THROUGHPUT), report)
    ttft = _svg_points(page, "TTFT p50")
    assert [(c, v) for c, v, _, _ in ttft] == [(lv.concurrency, lv.ttft_ms_p50) for lv in report.sweep]


CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
HAVE_BROWSER = os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)


async def test_html_report_renders_its_points_in_a_headless_browser(nats_server: EmbeddedNats, tmp_path: Path) -> None:
    """Debian's chromium through its chromedriver (never a downloaded browser); skips, saying so, without them."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
        from selenium.webdriver.common.by import By
    except ImportError:
        pytest.skip("selenium is not installed: the SVG is checked by parsing only (test above)")
    if not HAVE_BROWSER:
        pytest.skip("chromium or chromedriver missing (apt: chromium chromium-driver): SVG checked by parsing only")
    report = await _one_report(nats_server.url, tmp_path)
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking"):
        options.add_argument(flag)

    def look() -> list[tuple[int, float, float, float]]:
        driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
        try:
            driver.get((tmp_path / "qualification.html").as_uri())
            chart = driver.find_element(By.CSS_SELECTOR, f'svg.chart[data-title="{THROUGHPUT}"]')
            assert chart.is_displayed() and chart.size["width"] > 100
            driver.save_screenshot(str(tmp_path / "report.png"))
            points = []
            for c in chart.find_elements(By.CSS_SELECTOR, "circle.point"):
                assert c.is_displayed()
                r = c.rect  # where the browser laid the point out, in page pixels
                points.append(
                    (
                        int(c.get_attribute("data-concurrency") or 0),
                        float(c.get_attribute("data-value") or 0),
                        r["x"] + r["width"] / 2,
                        r["y"] + r["height"] / 2,
                    )
                )
            return points
        finally:
            driver.quit()

    _check_curve(await asyncio.to_thread(look), report)


async def test_a_node_credential_cannot_write_qualification_results(nats_server: EmbeddedNats) -> None:
    """Results are the edge's to write: a node's NATS user has no right on the iop_qualify bucket."""
    async with limited(parallel=2) as (_, url):
        dep = deployment(ONE.format(up=url, cap=2))
        await nats_server.authorize(dep.nodes)
        async with deployment_running(dep, nats_server.url) as h:
            summary = QualificationSummary(date="2026-12-01T05:00:00Z", verdict="edge's own")
            await h.edge.qualify._kv.put("q", msgspec.json.encode({"provider": "q", "summary": summary}))
            nc = await connection.connect(
                nats_server.address, "rogue", access=nats_server.node_access("n1"), wait_s=5, inbox_prefix="_INBOX_n1"
            )
            try:
                with pytest.raises((nats.errors.Error, TimeoutError)):
                    await nc.jetstream().publish("$KV.iop_qualify.q", b'{"provider": "q"}', timeout=1.0)
            finally:
                await nc.close()
            entry = await h.edge.qualify._kv.get("q")
            assert b"edge's own" in (entry.value or b"")


async def test_pinned_slots_ignore_drain_and_breaker_and_are_never_a_breaker_trial() -> None:
    s = Scheduler(100)
    for pid in ("q", "o"):
        s.add_provider(pid, "n1", 1)
        s.set_connected(pid, True)
    s.add_pool("m", ["q", "o"])
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 5
    s.set_drained("q", True)
    # Users get the other provider, then wait: the drained one takes no pool work.
    held = await s.acquire_grant("m", deadline)
    assert held.slot.id == "o"
    user = asyncio.create_task(s.acquire_grant("m", deadline))
    await until(lambda: s.waiting("m") == 1, s.changed)
    # A pinned request takes q's slot although q is drained, and its breaker is open.
    q = s.providers["q"]
    for _ in range(3):
        s.failed(q)
    assert q.open_until
    pinned = await s.acquire_pinned("q", deadline)
    assert pinned is q and q.in_flight == 1 and not q.trial
    # Its slot is capacity like any other: a second pinned request waits for the first.
    second = asyncio.create_task(s.acquire_pinned("q", deadline))
    await until(lambda: any(len(p.waiters) for p in q.pools), s.changed)
    s.release(q)
    assert await second is q and not user.done()
    s.release(q)
    s.set_drained("q", False)
    s.release(held.slot, held)
    assert (await user).slot.id == "o"
