"""A stored record read as a conversation reads it (iop/responses/records.py): its items as the
JSON they were kept as, the same items whether the record is still its JSON or decoded already."""

from __future__ import annotations

import json

import msgspec
import pytest

from iop.responses.cache import Entry
from iop.responses.records import Stored, Written, items_of, joined, of_stored, stored_items

_INPUT = b'[ {"type": "message", "role": "user", "content": "a \\"compaction\\" b"} ,\n {"id": "fc_1"} ]'
_OUTPUT = [{"type": "message", "id": "msg_1", "content": [{"type": "output_text", "text": "x"}]}]


def _record(input_json: bytes, output: object) -> bytes:
    response = {"id": "resp_1", "object": "response", "status": "completed", "output": output}
    return msgspec.json.encode(Written(response, msgspec.Raw(input_json), "resp_0", ["resp_0"], 123))


def test_the_items_are_the_kept_bytes_in_order() -> None:
    data = _record(_INPUT, _OUTPUT)
    got = stored_items(data)
    assert (got.chain, got.size, got.status) == (["resp_0"], 123, "completed")
    assert json.loads(joined(got.parts)) == [*json.loads(_INPUT), *_OUTPUT]
    assert not got.compacted  # the word inside a string is escaped: not an item's type


@pytest.mark.parametrize("input_json", [b"[]", b"[ ]", b"[\n]"])
@pytest.mark.parametrize("output", [[], None])
def test_empty_lists_give_no_items(input_json: bytes, output: object) -> None:
    assert stored_items(_record(input_json, output)).parts == []
    assert joined(stored_items(_record(input_json, _OUTPUT)).parts) == msgspec.json.encode(_OUTPUT)


def test_a_decoded_record_gives_the_same_items() -> None:
    data = _record(_INPUT, _OUTPUT)
    decoded = msgspec.json.decode(data, type=Stored)
    assert json.loads(joined(of_stored(decoded).parts)) == json.loads(joined(stored_items(data).parts))
    lazy = Entry(data, len(data), 0.0, 1, msgspec.json.Decoder(Stored).decode)
    first = items_of(lazy)
    assert items_of(lazy) is first and isinstance(lazy.stored, bytes)  # read once, never decoded
    eager = Entry(decoded, len(data), 0.0, 1)
    assert json.loads(joined(items_of(eager).parts)) == json.loads(joined(first.parts))


def test_a_compaction_item_is_found() -> None:
    item = {"type": "compaction", "id": "cmp_1", "encrypted_content": "sealed"}
    assert stored_items(_record(b"[]", [item])).compacted
    assert stored_items(_record(b'[{"type" : "compaction"}]', [])).compacted
    assert of_stored(msgspec.json.decode(_record(b"[]", [item]), type=Stored)).compacted
