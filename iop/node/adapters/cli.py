"""The cli adapter: runs a command (never through a shell), prompt on stdin, stdout as the answer."""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import os
import signal
from collections.abc import Mapping
from typing import Any

import msgspec

from iop import config, wire
from iop.errors import BadRequest, UpstreamError
from iop.node.adapters.base import Send, note_exit_code, writes
from iop.openai.answer import Usage, answer_writer

_decode = msgspec.json.Decoder().decode
_BASE_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "USER")
_READ_SIZE = 64 * 1024
_STDERR_TAIL = 2000
_REAP_TIMEOUT_S = 5.0
"""How long a killed command's pipes may take to close (a child that left its process group keeps them)."""


class CliAdapter:
    """Each request runs `command` in its own process group; there is no limit on how many at once."""

    def __init__(self, cfg: config.CliAdapter) -> None:
        self.cfg = cfg
        names = (*_BASE_ENV, *cfg.env)
        self.env = {k: os.environ[k] for k in names if k in os.environ}

    async def run(self, item: wire.WorkItem, model: str | None, send: Send) -> wire.Usage | None:
        request: dict[str, Any] = _decode(item.body)
        prompt = prompt_of(writes(item.api), request)
        writer = answer_writer(writes(item.api), item.stream, model or item.alias, request)
        try:
            proc = await asyncio.create_subprocess_exec(
                *self.cfg.command,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=self.env,
                start_new_session=True,  # its own process group: a kill reaches every child
            )
        except FileNotFoundError as exc:
            raise UpstreamError(f"command not found: {self.cfg.command[0]}", code="cli_not_found") from exc
        except PermissionError as exc:
            raise UpstreamError(f"command not executable: {self.cfg.command[0]}", code="cli_not_found") from exc
        try:
            async with asyncio.timeout(self.cfg.timeout_s):
                return await self._talk(proc, prompt, item.stream, writer, send)
        except TimeoutError as exc:
            raise UpstreamError(
                f"command timed out after {self.cfg.timeout_s:g}s and was killed", code="cli_timeout"
            ) from exc
        finally:
            # Covers timeout, cancellation (client gone) and errors alike: no orphans survive a
            # request. The whole group, even when the command itself has exited: a child it left
            # behind (holding stdout open, or just lingering) is part of the request too.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                await asyncio.shield(asyncio.wait_for(_reap(proc), _REAP_TIMEOUT_S))

    async def _talk(
        self, proc: asyncio.subprocess.Process, prompt: str, stream: bool, writer: Any, send: Send
    ) -> wire.Usage | None:
        assert proc.stdin and proc.stdout and proc.stderr
        stderr_task = asyncio.create_task(_tail(proc.stderr))
        feed = asyncio.create_task(_feed(proc.stdin, prompt.encode()))
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        out_chars = 0
        try:
            if stream:
                await send(writer.start())
            while data := await proc.stdout.read(_READ_SIZE):
                text = decoder.decode(data)
                if text:
                    out_chars += len(text)
                    piece = writer.delta(text)
                    if stream:
                        await send(piece)
            text = decoder.decode(b"", final=True)
            if text:
                out_chars += len(text)
                piece = writer.delta(text)
                if stream:
                    await send(piece)
            rc = await proc.wait()
            note_exit_code(rc)
            await feed
            err = await stderr_task
        finally:
            for t in (stderr_task, feed):
                t.cancel()
            # Let them unwind before anyone else reads those pipes (a stream allows one reader).
            await asyncio.gather(stderr_task, feed, return_exceptions=True)
        if rc != 0:
            tail = err.decode(errors="replace").strip()
            detail = f": {tail}" if tail else ""
            how = f"was killed by signal {-rc}" if rc < 0 else f"exited with status {rc}"
            raise UpstreamError(f"command {how}{detail}", code="cli_failed")
        # The answer's usage object must hold numbers, so it carries an estimate; the ledger is told
        # none: a command reports no tokens, and the ledger never records a guess.
        usage = Usage(input_tokens=max(1, len(prompt) // 4), output_tokens=max(0, out_chars // 4))
        await send(writer.finish(usage))
        return None

    async def close(self) -> None:
        return None


async def _reap(proc: asyncio.subprocess.Process) -> None:
    """Wait for a killed process. asyncio's wait() also waits for its pipes to close, and a pipe
    whose reader paused (the answer was held back by a slow client) sees its end only if read."""

    async def discard(stream: asyncio.StreamReader | None) -> None:
        while stream is not None and await stream.read(_READ_SIZE):
            pass

    await asyncio.gather(proc.wait(), discard(proc.stdout), discard(proc.stderr))


async def _feed(stdin: asyncio.StreamWriter, data: bytes) -> None:
    # A command that never reads its stdin must not fail the request: a pipe it closed is fine.
    # asyncio says so with BrokenPipeError; uvloop, once it has seen the pipe close, with
    # RuntimeError ("unable to perform operation on <WriteUnixTransport closed=True>").
    try:
        if not stdin.is_closing():
            stdin.write(data)
            await stdin.drain()
        stdin.close()
        await stdin.wait_closed()
    except (BrokenPipeError, ConnectionResetError):
        pass
    except RuntimeError:
        if not stdin.is_closing():
            raise


async def _tail(stream: asyncio.StreamReader) -> bytes:
    tail = b""
    while data := await stream.read(_READ_SIZE):
        tail = (tail + data)[-_STDERR_TAIL:]
    return tail


def prompt_of(api: str, request: Mapping[str, Any]) -> str:
    """The text a CLI reads on stdin: the conversation, flattened.

    A single user message is passed as it is; a longer conversation becomes a transcript with
    one `[role]` header per message, so the command sees who said what.
    """
    turns: list[tuple[str, str]] = []
    if api == "chat":
        messages = request.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty list", param="messages")
        for m in messages:
            if isinstance(m, Mapping):
                turns.append((str(m.get("role", "user")), _text(m.get("content"))))
    else:
        instructions = request.get("instructions")
        if isinstance(instructions, str) and instructions:
            turns.append(("system", instructions))
        inp = request.get("input")
        if isinstance(inp, str):
            turns.append(("user", inp))
        elif isinstance(inp, list):
            for it in inp:
                if isinstance(it, Mapping) and it.get("type", "message") == "message":
                    turns.append((str(it.get("role", "user")), _text(it.get("content"))))
                elif isinstance(it, Mapping) and it.get("type") == "function_call_output":
                    turns.append(("tool", _text(it.get("output"))))
        else:
            raise BadRequest("'input' must be a string or a list of items", param="input")
    if len(turns) == 1 and turns[0][0] == "user":
        return turns[0][1]
    return "\n\n".join(f"[{role}]\n{text}" for role, text in turns)


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p.get("text", "") for p in content if isinstance(p, Mapping)]
        return "".join(p for p in parts if isinstance(p, str))
    return ""
