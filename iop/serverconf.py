"""The `server:` block of an openai adapter: the model server process its node starts, stops and swaps.

Kept apart from iop/config.py (which imports it) so that one concept stays in one module.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

_ID = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"


class ServerSettings(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A model server the node runs itself: started on demand, stopped when idle, swapped in a group."""

    command: Annotated[
        list[Annotated[str, Meta(min_length=1)]],
        Meta(
            min_length=1,
            description="Program and arguments of the model server, run directly (no shell), in its own "
            "process group; the node's policy must allow it as it allows a CLI command.",
        ),
    ]
    env: Annotated[
        list[Annotated[str, Meta(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", extra={"format": "env"})]],
        Meta(
            description="Names of environment variables passed to the server, besides PATH, HOME, LANG, "
            "LC_ALL, TMPDIR and USER; no other variable reaches it."
        ),
    ] = msgspec.field(default_factory=list)
    ready_url: Annotated[
        str | None,
        Meta(
            extra={"format": "http_url"},
            description="Ready when this URL answers 200 (a server still loading answers 503), e.g. "
            "http://127.0.0.1:8081/health. One of ready_url and ready_log is required.",
        ),
    ] = None
    ready_log: Annotated[
        Annotated[str, Meta(min_length=1, extra={"format": "regex"})] | None,
        Meta(description="Ready when a line of the server's stdout or stderr matches this regular expression."),
    ] = None
    start_timeout_s: Annotated[
        float, Meta(gt=0, description="A server not ready this long after its start is killed and counts as failed.")
    ] = 120.0
    idle_stop_s: Annotated[
        Annotated[float, Meta(gt=0)] | None,
        Meta(description="Stop the server after this many seconds without a request (unset: keep it running)."),
    ] = None
    stop_grace_s: Annotated[
        float, Meta(gt=0, description="After SIGTERM, how long the server has to exit before SIGKILL.")
    ] = 10.0
    restart_backoff_s: Annotated[
        float,
        Meta(
            gt=0,
            description="Wait before restarting a server that died; doubled after each crash in a row, up to "
            "60 s (a server that stayed ready for a minute starts again from this).",
        ),
    ] = 1.0
    group: Annotated[
        Annotated[str, Meta(min_length=1, pattern=_ID, extra={"format": "id"})] | None,
        Meta(
            description="Exclusive group on this node (servers sharing one GPU or its memory): at most "
            "group_size of its servers run at once; a request for another one drains and stops the least "
            "recently used."
        ),
    ] = None
    group_size: Annotated[
        int, Meta(ge=1, description="How many servers of `group` may run at once (the same on every member).")
    ] = 1
