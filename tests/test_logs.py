"""The log lines of edge and node (iop/logs.py): the formats, and the access lines of a loop turn in one write."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from iop import logs
from tests.harness import iop_process

DEPLOYMENT = """
edge:
  listen: 127.0.0.1:0
  nats: {{listen: "127.0.0.1:0", store_dir: {store}}}
models: [{{alias: sim, pool: [sim-1]}}]
nodes:
  - id: n1
    adapters: [{{id: sim, type: mock, latency_ms: 0, tokens: 2, token_interval_ms: 0}}]
    providers: [{{id: sim-1, adapter: sim, capacity: 4}}]
"""


class Writes(io.StringIO):
    """A stream that remembers each write."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []

    def write(self, s: str) -> int:
        self.writes.append(s)
        return super().write(s)

    def lines(self) -> list[str]:
        return self.getvalue().splitlines()


@pytest.fixture
def access() -> Iterator[tuple[logging.Logger, Writes]]:
    """`iop.access` and `iop.edge` logging only into a handler `logs.setup("info", "text")` would install."""
    stream = Writes()
    handler = logs.handler("text", stream)
    loggers = [logging.getLogger("iop.access"), logging.getLogger("iop.edge")]
    saved = [(lg.level, lg.propagate) for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.setLevel(logging.INFO)
        lg.propagate = False
    try:
        yield loggers[0], stream
    finally:
        for lg, (level, propagate) in zip(loggers, saved, strict=True):
            lg.removeHandler(handler)
            lg.setLevel(level)
            lg.propagate = propagate
        handler.close()


async def turn_ends(stream: Writes) -> None:
    """Until the loop has run the handler's end of turn (bounded)."""
    for _ in range(100):
        await asyncio.sleep(0)
        if stream.writes:
            return
    raise AssertionError("the turn's lines were never written")


async def test_logs_many_access_lines_of_one_loop_turn_arrive_complete_in_order_in_one_write(
    access: tuple[logging.Logger, Writes],
) -> None:
    log, stream = access
    (handler,) = [h for h in log.handlers if isinstance(h, logs.TurnHandler)]
    for i in range(200):
        if i % 2:  # as the edge writes its access line (no record), between records of the same logger
            handler.line(logging.INFO, "iop.access", f"req_{i:03d} alias pool n1/p1 200 1.0ms tokens=1/2", {})
        else:
            log.info("req_%03d alias pool n1/p1 200 1.0ms tokens=1/2", i)
    assert stream.writes == []  # kept until the turn ends
    await turn_ends(stream)
    assert len(stream.writes) == 1
    assert [line.split(" ")[4] for line in stream.lines()] == [f"req_{i:03d}" for i in range(200)]
    assert all(" INFO iop.access: req_" in line and line.endswith(" tokens=1/2") for line in stream.lines())

    # More than a turn may keep: written as they fill up, the order the same.
    stream.writes.clear()
    n = 2 * logs.TURN_LINES + 10
    for i in range(n):
        log.info("req_%04d", i)
    assert len(stream.writes) == 2
    await turn_ends_again(stream, 3)
    assert [line.split(" ")[4] for line in stream.lines()[200:]] == [f"req_{i:04d}" for i in range(n)]


async def turn_ends_again(stream: Writes, writes: int) -> None:
    for _ in range(100):
        await asyncio.sleep(0)
        if len(stream.writes) >= writes:
            break
    assert len(stream.writes) == writes


async def test_logs_a_warning_between_access_lines_goes_out_at_once_and_keeps_its_order(
    access: tuple[logging.Logger, Writes],
) -> None:
    log, stream = access
    log.info("req_a")
    log.info("req_b")
    logging.getLogger("iop.edge").warning("something is wrong")
    # Written at once, and the lines kept before it with it.
    assert [line.split(" ", 3)[2:] for line in stream.lines()] == [
        ["INFO", "iop.access: req_a"],
        ["INFO", "iop.access: req_b"],
        ["WARNING", "iop.edge: something is wrong"],
    ]
    log.info("req_c")
    await turn_ends_again(stream, 2)
    assert [line.rsplit(" ", 1)[1] for line in stream.lines()] == ["req_a", "req_b", "wrong", "req_c"]


def test_logs_outside_a_loop_each_line_is_written_at_once(access: tuple[logging.Logger, Writes]) -> None:
    log, stream = access
    log.info("req_a")
    log.info("req_b")
    assert len(stream.writes) == 2 and [line.rsplit(" ", 1)[1] for line in stream.lines()] == ["req_a", "req_b"]


async def test_logs_flush_and_close_write_what_a_turn_kept(access: tuple[logging.Logger, Writes]) -> None:
    log, stream = access
    log.info("req_a")
    (handler,) = [h for h in log.handlers if isinstance(h, logs.TurnHandler)]
    handler.flush()  # as logging's shutdown does at exit
    assert stream.lines()[-1].endswith("req_a")
    log.info("req_b")
    handler.close()
    assert stream.lines()[-1].endswith("req_b")


def test_logs_text_and_json_times_are_the_logging_module_s_with_the_second_kept() -> None:
    plain = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    text, as_json = logs.TextFormatter(), logs.JsonFormatter()
    base = float(int(time.time()))
    # Within one second, across into the next, back to an earlier one (another thread's record).
    for t in (base + 0.001, base + 0.999, base + 1.0, base + 1.5, base - 3600.25, base + 86400.0005):
        record = logging.makeLogRecord({"name": "iop.access", "msg": "req_x %s", "args": ("y",), "levelno": 20})
        record.levelname, record.created = "INFO", t
        record.msecs = int((t - int(t)) * 1000) + 0.0
        assert text.format(record) == plain.format(record)
        ms = f"{int(record.msecs):03d}"
        want = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{ms}Z"
        assert json.loads(as_json.format(record)) == {
            "time": want,
            "level": "info",
            "logger": "iop.access",
            "message": "req_x y",
        }


@pytest.mark.parametrize("fmt", logs.FORMATS)
def test_logs_a_line_without_a_record_is_the_line_of_its_record(fmt: str) -> None:
    formatter = logs.handler(fmt).formatter
    assert isinstance(formatter, logs.TextFormatter | logs.JsonFormatter)
    plain: dict[str, object] = {
        "request_id": "req_1",
        "alias": 'a "quoted" \\ alias\t',
        "status": 200,
        "error": None,
        "duration_ms": 1234.567,
        "queue_ms": 0.001,
        "ttfb_ms": 0.0,
        "input_tokens": 120_000,
        "cancelled": False,
    }
    # json escapes what msgspec writes as it is: non-ASCII, DEL.
    for fields in (plain, {**plain, "alias": "caf\u00e9 \u2028"}, {**plain, "alias": "del\x7f"}):
        for level in (logging.INFO, logging.DEBUG):
            message = f"req_1 {fields['alias']} pool n/p 200"
            record = logging.Logger("iop.access").makeRecord(
                "iop.access", level, __file__, 0, message, (), None, "f", {"fields": fields}
            )
            assert formatter.line(record.created, level, "iop.access", message, fields) == formatter.format(record)


def test_logs_a_line_goes_without_a_record_only_where_nothing_else_would_see_the_record() -> None:
    top, access = logging.Logger("top"), logging.Logger("top.access")  # outside logging's tree (and pytest's)
    access.parent = top
    ours = logs.handler("text", Writes())
    top.addHandler(ours)
    assert logs.sole_handler(access, logging.INFO) is ours
    access.propagate = False
    assert logs.sole_handler(access, logging.INFO) is None  # nothing would: logging's last resort says so
    access.propagate = True
    ours.setLevel(logging.WARNING)
    assert logs.sole_handler(access, logging.INFO) is None
    ours.setLevel(logging.NOTSET)
    spoilers: list[Callable[[], object]] = [
        lambda: access.addFilter(lambda r: True),
        lambda: ours.addFilter(lambda r: True),
        lambda: top.addHandler(logging.NullHandler()),  # a second handler (pytest's capture, an operator's)
        lambda: ours.setFormatter(logging.Formatter("%(message)s")),
    ]
    for spoil in spoilers:
        spoil()
        assert logs.sole_handler(access, logging.INFO) is None
        access.filters.clear()
        ours.filters.clear()
        top.handlers[:] = [ours]
        ours.setFormatter(logs.TextFormatter())
        assert logs.sole_handler(access, logging.INFO) is ours
    access.disabled = True
    assert logs.sole_handler(access, logging.INFO) is None


@pytest.mark.parametrize("fmt", logs.FORMATS)
async def test_logs_every_access_line_of_an_edge_stopped_by_sigterm_is_in_its_output(tmp_path: Path, fmt: str) -> None:
    path = tmp_path / "deployment.yaml"
    path.write_text(DEPLOYMENT.format(store=tmp_path / "store"))
    ids: list[str] = []
    async with iop_process("edge", "--config", str(path), "--log-format", fmt, cwd=tmp_path) as edge:
        url = (await edge.wait_line(r"iop edge listening on (http://\S+)")).group(1)
        nats_url = (await edge.wait_line(r"nats=(\S+)")).group(1)
        async with (
            iop_process("node", "--config", str(path), "--node", "n1", "--nats", nats_url, cwd=tmp_path) as node,
            httpx.AsyncClient(base_url=url, timeout=20) as http,
        ):
            await node.wait_line("iop node n1 serving")

            async def ask(model: str) -> str:
                body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
                r = await http.post("/v1/chat/completions", json=body)
                assert r.status_code == (200 if model == "sim" else 404), r.text
                return r.headers["x-request-id"]

            # Many at once, so that several end in one loop turn of the edge; then SIGTERM at once.
            for _ in range(3):
                ids += await asyncio.gather(*(ask("sim" if i % 4 else "nope") for i in range(40)))
        await edge.stop(15)
        assert edge.proc.returncode == 0, edge.stderr[-20:]
    if fmt == "json":
        logged = [json.loads(line) for line in edge.stderr if line.startswith("{")]
        access_lines = [x for x in logged if x["logger"] == "iop.access"]
        assert all(x["message"].startswith(x["request_id"] + " ") for x in access_lines)
        assert {x["status"] for x in access_lines} == {200, 404}
        assert sorted(x["request_id"] for x in access_lines) == sorted(ids)
    else:
        texts = [line.split(" INFO iop.access: ", 1)[1] for line in edge.stderr if " INFO iop.access: " in line]
        # `req_… alias-or-asked route node/provider status duration queue=… tokens=…`
        assert {m.group(1) for t in texts if (m := re.search(r" (\d{3}) [\d.]+ms queue=", t))} == {"200", "404"}
        assert sorted(t.split(" ", 1)[0] for t in texts) == sorted(ids)
