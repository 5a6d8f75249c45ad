"""What a node says about itself, made safe once where it enters the edge: bounded and printable.

A node's credential can publish anything on its own hello and heartbeat subjects. Its instance,
version, device facts and provider reports then reach the log (forged lines, terminal escapes,
megabyte lines) and every `/status` frame (a 4 MiB cpu model made each frame 4 MiB). The registry
passes every hello and heartbeat through here first; nothing downstream escapes again.
"""

from __future__ import annotations

import re

import msgspec

from iop import wire

MAX_TEXT = 200
"""Characters kept of a node-reported string (a cpu model, a version, a refusal); the rest is cut."""
MAX_ACCELERATORS = 16
MAX_EDGES = 64
"""Edge entries kept per provider in `by_edge` (a deployment has a handful of edges)."""

_INSTANCE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
"""A node instance is `secrets.token_hex(6)`; it also becomes a NATS subject token (the verdict)."""


def printable(text: str, limit: int = MAX_TEXT) -> str:
    """`text` with every non-printable character escaped (`\\n` → `\\x0a`), cut to `limit` characters."""
    if len(text) > limit * 4:
        text = text[: limit * 4]  # escaping at most quadruples a character: no need to look further
    out = text if text.isprintable() else "".join(c if c.isprintable() else _escape(c) for c in text)
    return out if len(out) <= limit else out[: limit - 1] + "…"


def _escape(c: str) -> str:
    n = ord(c)
    return f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}"


def valid_instance(instance: str) -> bool:
    return bool(_INSTANCE.match(instance))


def device(d: wire.Device | None) -> wire.Device | None:
    if d is None:
        return None
    return msgspec.structs.replace(
        d,
        os=printable(d.os),
        arch=printable(d.arch),
        cpu_model=printable(d.cpu_model),
        python=printable(d.python),
        iop=printable(d.iop),
        accelerators=[msgspec.structs.replace(a, name=printable(a.name)) for a in d.accelerators[:MAX_ACCELERATORS]],
    )


def heartbeat(hb: wire.NodeHeartbeat, known: set[str]) -> wire.NodeHeartbeat:
    """`hb` bounded: only the providers the deployment gives this node (`known`), printable strings."""
    providers = []
    for p in hb.providers:
        if p.id not in known:
            continue  # not in the deployment: nothing reads it, and it must not grow /status
        by_edge = {k: v for k, v in list(p.by_edge.items())[:MAX_EDGES] if valid_instance(k)}
        providers.append(msgspec.structs.replace(p, by_edge=by_edge, refused=printable(p.refused)))
    return msgspec.structs.replace(hb, providers=providers, version=printable(hb.version, 64), device=device(hb.device))
