"""The keys of a KV bucket that match a pattern, read to the end: an administrator's listing and lookup."""

from __future__ import annotations

from nats.aio.client import Client as NATS
from nats.js import api as js_api


async def bucket_keys(nc: NATS, bucket: str, pattern: str, limit: int, timeout_s: float) -> tuple[list[str], bool]:
    """Up to `limit` keys of `bucket` matching `pattern` that are there, oldest first, and whether there are more.

    An ephemeral pull consumer of the keys' last messages, headers only. Its count at creation is
    exact (nothing is delivered before the first pull), and every message says how many are left
    after it: the read stops at the end, never at a guess. (nats-py's `KeyValue.watch` signals
    "nothing pending" when the server's count is 0 before its callback has counted a message
    already on its way: a key just written could be left out.) Deleted keys' markers are skipped.
    """
    js = nc.jetstream()
    stream, prefix = f"KV_{bucket}", f"$KV.{bucket}."
    cfg = js_api.ConsumerConfig(
        filter_subject=prefix + pattern,
        deliver_policy=js_api.DeliverPolicy.LAST_PER_SUBJECT,
        ack_policy=js_api.AckPolicy.NONE,
        headers_only=True,
        inactive_threshold=timeout_s * 6,  # gone by itself if this edge dies before deleting it
        mem_storage=True,
        num_replicas=1,
    )
    info = await js.add_consumer(stream, cfg)
    keys: list[str] = []
    left = info.num_pending or 0
    try:
        if left:
            sub = await js.pull_subscribe_bind(info.name, stream)
            try:
                while left and len(keys) <= limit:
                    for msg in await sub.fetch(min(left, limit + 1 - len(keys), 256), timeout=timeout_s):
                        left = msg.metadata.num_pending
                        if (msg.headers or {}).get("KV-Operation") is None:  # not a DEL or PURGE marker
                            keys.append(msg.subject[len(prefix) :])
            finally:
                await sub.unsubscribe()
    finally:
        await js.delete_consumer(stream, info.name)
    return keys[:limit], len(keys) > limit
