"""The embedded NATS store after a failed write (a full disk): reported at once, reloaded once space returns.

nats-server keeps a stream whose store failed a write failed, freed disk or not, until it loads
the stream again at its next start: every pool request was a 503 until the edge was restarted,
while `/healthz` said storage was fine. The edge now marks the work stream unusable the moment the
server logs the failure, watches the store's free space, and restarts its embedded server (same
port, same store, nothing queued lost) as soon as there is room again.
"""

from __future__ import annotations

import asyncio
import logging
import shutil

from iop.edge.storage import WorkStream
from iop.errors import BusError
from iop.nats.server import MAX_PAYLOAD, EmbeddedNats

log = logging.getLogger("iop.edge")

FREE_NEEDED_BYTES = 2 * MAX_PAYLOAD
"""Free space on the store's filesystem that counts as room again: two of the largest messages."""
CHECK_EVERY_S = 0.25


async def recover_store(embedded: EmbeddedNats, work_stream: WorkStream) -> None:
    """Run for the edge's life: on each store failure, wait for room, then reload the store."""
    while True:
        await embedded.store_failed_event.wait()
        work_stream.store_failed(f"the NATS store failed a write ({embedded.store_failed})")
        await _room(embedded)
        log.warning("the NATS store has room again: restarting the embedded nats-server to load its streams")
        try:
            await embedded.recycle()
        except BusError as exc:
            log.error("the embedded nats-server could not be restarted after its store failed: %s", exc)
            continue  # the supervisor sees it gone and restarts it, or stops the edge
        finally:
            work_stream.store_back()
        log.info("embedded nats-server restarted on its store")


async def _room(embedded: EmbeddedNats) -> None:
    """Until the store's filesystem has room again (polled: free space is the OS's to tell, nothing signals it)."""
    while True:
        if _free_bytes(embedded) >= FREE_NEEDED_BYTES:
            return
        await asyncio.sleep(CHECK_EVERY_S)


def _free_bytes(embedded: EmbeddedNats) -> int:
    try:
        return shutil.disk_usage(embedded.store_dir).free
    except OSError:
        return 0
