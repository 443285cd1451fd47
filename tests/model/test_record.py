"""The on-disk record header."""

import pytest

from bsr_io.model.keys import chunk_keys
from bsr_io.model.layout import preset
from bsr_io.model.record import HEADER_BYTES, RecordFormatError, decode_header, make_header


@pytest.fixture
def header():
    lay = preset("deepseek-v4-flash")
    key = chunk_keys(range(512), lay, "deepseek/V4-Flash", rank=1, world_size=2)[1]
    return lay, key, make_header(key, lay, 0x1234_5678_9ABC_DEF0)


def test_round_trip(header):
    lay, key, h = header
    raw = h.encode()
    assert len(raw) == HEADER_BYTES
    back = decode_header(raw)
    assert back == h
    assert back.check(key, lay) is None
    assert back.record_bytes == HEADER_BYTES + lay.chunk_bytes


def test_every_flipped_byte_is_caught(header):
    raw = bytearray(header[2].encode())
    for pos in range(0, HEADER_BYTES, 7):
        bad = bytearray(raw)
        bad[pos] ^= 0x40
        with pytest.raises(RecordFormatError):
            decode_header(bad)


def test_truncated_and_foreign(header):
    raw = header[2].encode()
    with pytest.raises(RecordFormatError, match="truncated"):
        decode_header(raw[:100])
    with pytest.raises(RecordFormatError, match="magic"):
        decode_header(b"\0" * HEADER_BYTES)


def test_check_names_the_other_key(header):
    lay, key, h = header
    other = chunk_keys(range(512), lay, "deepseek/V4-Flash", rank=0, world_size=2)[1]
    assert "expected" in h.check(other)
    assert "layout" in h.check(key, preset("tiny"))


def test_key_for_another_layout_is_refused():
    key = chunk_keys(range(64), preset("tiny"), "m")[0]
    with pytest.raises(ValueError, match="another layout"):
        make_header(key, preset("llama-3.1-8b"), 0)


def _resealed(raw: bytes, pos: int, new: bytes) -> bytes:
    """`raw` with bytes at `pos` replaced and the header checksum recomputed (a header
    that is intact but says something else)."""
    from bsr_io.model.record import _header_sum

    body = bytearray(raw)
    body[pos : pos + len(new)] = new
    body[HEADER_BYTES - 8 :] = _header_sum(body)
    return bytes(body)


def test_identity_digest_is_stored_and_checked(header):
    lay, key, h = header
    raw = h.encode()
    at = 34 + len(key.to_bytes())
    assert raw[at : at + 32] == key.identity_digest() == decode_header(raw).identity
    forged = _resealed(raw, at, bytes(32))
    with pytest.raises(RecordFormatError, match="identity"):
        decode_header(forged)
    other = chunk_keys(range(512), lay, "deepseek/V4-Flash#other-lora", rank=1, world_size=2)[1]
    assert "key" in decode_header(raw).check(other)


def test_another_format_version_is_its_own_error(header):
    from bsr_io.model.record import OldRecordFormat

    raw = header[2].encode()
    old = _resealed(raw, 8, (1).to_bytes(2, "little"))
    with pytest.raises(OldRecordFormat):
        decode_header(old)
    with pytest.raises(RecordFormatError, match="checksum"):  # a flipped version field
        decode_header(raw[:8] + b"\x01" + raw[9:])
