"""The edge's UTF-8 check of a body, piece by piece: the same verdict and position as one decode."""

from __future__ import annotations

import pytest

from iop.edge.heads import UTF8_PIECE, check_utf8
from iop.errors import BadRequest

EURO = "€".encode()  # three bytes


@pytest.mark.parametrize("shift", [0, 1, 2, 3])
def test_utf8_check_accepts_characters_split_across_pieces(shift: int) -> None:
    body = b"x" * (UTF8_PIECE - shift) + EURO * 4 + b"y" * 10
    check_utf8(body)


@pytest.mark.parametrize(
    "body",
    [
        b"a" * (UTF8_PIECE - 1) + b"\xff" + b"b" * 5,  # a byte no UTF-8 has, at a piece's end
        b"a" * (UTF8_PIECE - 1) + EURO[:2] + b"b",  # a character cut short across two pieces
        b"a" * (2 * UTF8_PIECE + 7) + EURO[:1],  # cut short at the very end
    ],
)
def test_utf8_check_names_the_first_bad_byte(body: bytes) -> None:
    with pytest.raises(UnicodeDecodeError) as whole:
        body.decode("utf-8")
    with pytest.raises(BadRequest) as err:
        check_utf8(body)
    assert err.value.code == "invalid_json"
    assert f"(byte {whole.value.start})" in err.value.message
