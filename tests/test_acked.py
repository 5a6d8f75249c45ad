"""Publishes acked on the publisher's own inbox (iop/nats/acked.py) behave as nats-py's JetStream publish."""

from __future__ import annotations

import nats.errors
import nats.js.errors
import pytest
from nats.aio.msg import Msg
from nats.js import api as js_api

from iop.nats import connection
from iop.nats.acked import AckedPublishes
from iop.nats.server import EmbeddedNats


async def test_acked_publishes_give_the_revision_and_nats_py_s_errors(nats_server: EmbeddedNats) -> None:
    nc = await connection.connect(nats_server.url, "test-acked")
    try:
        kv = await nc.jetstream().create_key_value(js_api.KeyValueConfig(bucket="acked", history=1))
        acked = AckedPublishes(nc, timeout_s=2.0)
        await acked.start()
        first = await acked.publish("$KV.acked.k", b"one")
        assert (await kv.get("k")).revision == first and (await kv.get("k")).value == b"one"
        last = js_api.Header.EXPECTED_LAST_SUBJECT_SEQUENCE.value
        second = await acked.publish("$KV.acked.k", b"two", {last: str(first)})
        assert second > first and (await kv.get("k")).value == b"two"
        with pytest.raises(nats.js.errors.KeyWrongLastSequenceError):
            await acked.publish("$KV.acked.k", b"three", {last: str(first)})  # another writer came first
        assert (await kv.get("k")).value == b"two"
        with pytest.raises(nats.errors.NoRespondersError):
            await acked.publish("no.stream.stores.this", b"x")
        # Something listens but no stream answers: the wait ends at the timeout, as nats-py's.
        await nc.subscribe("silent.listener", cb=_ignore)
        slow = AckedPublishes(nc, timeout_s=0.2)
        await slow.start()
        with pytest.raises(nats.errors.TimeoutError):
            await slow.publish("silent.listener", b"x")
        assert acked.waiting == 0 and slow.waiting == 0  # every wait ended, none left behind
    finally:
        await nc.close()


async def _ignore(msg: Msg) -> None:
    pass
