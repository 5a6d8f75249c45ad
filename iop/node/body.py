"""A request body that stayed at its edge, fetched by the node that runs the request.

A pool request's agent-sized body (256 KiB or more: the edge's `INLINE_BELOW`) and any body too
large for one NATS message stay in the edge's memory with the request; the work item says how many
bytes (`body_size`). The node asks for every part at once (`BodyPart` requests on the item's reply
subject, which only this node may use for it), so the body takes one round trip and its transfer,
not a round trip per part. An edge whose parts are smaller than the node's (another server's
`max_payload`) is asked again for the rest of each range.
"""

from __future__ import annotations

import asyncio

import nats.errors
from nats.aio.client import Client as NATS

from iop import wire
from iop.errors import BodyUnavailable

PART_TIMEOUT_S = 5.0
"""How long one part may take to arrive."""


async def fetch_body(nc: NATS, item: wire.WorkItem) -> bytes:
    """The item's `body_size` bytes from its edge; BodyUnavailable when the edge no longer has them."""
    step = wire.body_part_size(nc.max_payload)
    ranges = [(start, min(start + step, item.body_size)) for start in range(0, item.body_size, step)]
    got = await asyncio.gather(*(_body_range(nc, item, start, end) for start, end in ranges), return_exceptions=True)
    parts: list[bytes] = []
    for result in got:
        if isinstance(result, BaseException):
            raise result
        parts.append(result)
    return parts[0] if len(parts) == 1 else b"".join(parts)


async def _body_range(nc: NATS, item: wire.WorkItem, start: int, end: int) -> bytes:
    pieces: list[bytes] = []
    at = start
    while at < end:
        try:
            reply = await nc.request(item.reply_to, wire.encode(wire.BodyPart(item.id, at)), timeout=PART_TIMEOUT_S)
        except (nats.errors.Error, TimeoutError) as exc:
            raise BodyUnavailable(f"the request body could not be fetched from the edge: {type(exc).__name__}") from exc
        data = reply.data
        if not data:
            raise BodyUnavailable("the edge no longer has this request")
        if len(data) > end - at:
            data = data[: end - at]  # the edge's parts are larger than this node's: the next range has the rest
        pieces.append(data)
        at += len(data)
    return pieces[0] if len(pieces) == 1 else b"".join(pieces)
