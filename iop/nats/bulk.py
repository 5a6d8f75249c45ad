"""Publishes of large payloads without nats-py's copies of them.

nats-py's `publish` joins a message's command line, payload and line end into one bytes object
(`pub_cmd`): two full copies of the payload before the socket sees it, 0.4-0.8 ms per 3 MB here.
`publish` below queues the pieces as they are on the connection's pending writes, which nats-py's
flusher hands to the transport as one list (`writelines`: the loop's transport writes them with
one `writev`, joining nothing). A view of a larger buffer (a body's part) goes out as that view.

It appends to nats-py's pending list and keeps the checks nats-py's `publish` makes, in its
order; nothing awaits between the pieces, so no other command can come between them. The pending
list is nats-py's private state: the version is pinned (build-requirements.txt) and
tests/test_nats_bulk.py fails on a nats-py without it. Payloads under `BULK_FROM` (and any with
headers) go through nats-py's own `publish`: for them the join costs less than the longer list.
"""

from __future__ import annotations

from collections.abc import Sequence

import nats.errors
from nats.aio.client import Client as NATS

Buffer = bytes | bytearray | memoryview

BULK_FROM = 64 * 1024
"""Bytes of payload from which the pieces are queued as they are."""
_CRLF = b"\r\n"


def supported(nc: NATS) -> bool:
    """Whether `nc` keeps its pending writes as the list this module appends to."""
    return isinstance(getattr(nc, "_pending", None), list) and hasattr(nc, "_pending_data_size")


async def publish(nc: NATS, subject: str, pieces: Sequence[Buffer], reply: str = "") -> None:
    """Publish the concatenation of `pieces` on `subject` (core NATS), copying none of them.

    Raises what nats-py's `publish` raises: ConnectionClosedError, ConnectionDrainingError,
    OutboundBufferLimitError (reconnecting with its buffer full), MaxPayloadError."""
    size = sum(len(p) for p in pieces)
    if size < BULK_FROM or not supported(nc):
        payload = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        await nc.publish(subject, payload, reply=reply)  # type: ignore[arg-type]  # any buffer
        return
    if nc.is_closed:
        raise nats.errors.ConnectionClosedError
    if nc.is_draining_pubs:
        raise nats.errors.ConnectionDrainingError
    limit = nc._max_pending_size
    if not nc.is_connected and (limit <= 0 or size + nc._pending_data_size > limit):
        raise nats.errors.OutboundBufferLimitError
    if size > nc._max_payload:
        raise nats.errors.MaxPayloadError
    head = (f"PUB {subject} {reply} {size}\r\n" if reply else f"PUB {subject} {size}\r\n").encode()
    pending = nc._pending
    pending.append(head)
    pending.extend(pieces)  # type: ignore[arg-type]  # the transport takes any buffer
    pending.append(_CRLF)
    nc._pending_data_size += len(head) + size + len(_CRLF)
    nc.stats["out_msgs"] += 1
    nc.stats["out_bytes"] += size
    if limit > 0 and nc._pending_data_size > limit:
        await nc._flush_pending(force_flush=True)
    elif nc._flush_queue is not None and nc._flush_queue.empty():
        await nc._flush_pending()
