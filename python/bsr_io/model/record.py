"""The on-disk chunk record: a 4096-byte header, then the payload.

Header (little-endian), all of it covered by a header checksum:

    0   8  magic b"BSRCHNK1"
    8   2  format version (2; a record of another version is a miss: OldRecordFormat)
    10  2  group count G
    12  4  header bytes (4096): the payload starts here, aligned for O_DIRECT
    16  8  payload length
    24  8  payload xxh3-64 (computed by the engine)
    32  2  encoded key length K
    34  K  the full key (ChunkKey.to_bytes: model identity, world size, rank, layout
           fingerprint, 128-bit prefix hash)
    34+K  32  identity digest (ChunkKey.identity_digest: blake2b-256 of the key)
    66+K   G x (offset u64, length u64): each allocator group's bytes in the payload
    4088 8  blake2b-64 of bytes [0, 4088)

The layout fingerprint is part of the key. A read checks the stored key and identity
digest against the key it asked for, so a record stands only for the exact prefix
(128-bit chained hash) and identity it was written for. A record file is the header
followed by exactly `payload length` bytes; anything shorter is torn or truncated.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

from bsr_io.errors import BsrValueError
from bsr_io.errors import OldRecordFormat as OldRecordFormat  # re-exported
from bsr_io.errors import RecordFormatError as RecordFormatError  # re-exported
from bsr_io.model.keys import ChunkKey
from bsr_io.model.layout import KVLayout, shape_of

MAGIC = b"BSRCHNK1"
VERSION = 2
_IDENTITY = 32
HEADER_BYTES = 4096
_FIXED = struct.Struct("<8sHHIQQH")  # magic, version, groups, header bytes, len, xxh3, key len
_GROUP = struct.Struct("<QQ")
_SUM_AT = HEADER_BYTES - 8


@dataclass(frozen=True, slots=True)
class RecordHeader:
    key: ChunkKey
    payload_len: int
    payload_xxh3: int
    groups: tuple[tuple[int, int], ...]
    identity: bytes = b""  # the key's identity digest as stored (b"": the key's own)

    def __post_init__(self) -> None:
        if not self.identity:
            object.__setattr__(self, "identity", self.key.identity_digest())

    @property
    def record_bytes(self) -> int:
        return HEADER_BYTES + self.payload_len

    def encode(self) -> bytes:
        key = self.key.to_bytes()
        body = bytearray(HEADER_BYTES)
        _FIXED.pack_into(
            body,
            0,
            MAGIC,
            VERSION,
            len(self.groups),
            HEADER_BYTES,
            self.payload_len,
            self.payload_xxh3,
            len(key),
        )
        pos = _FIXED.size
        body[pos : pos + len(key)] = key
        pos += len(key)
        body[pos : pos + _IDENTITY] = self.identity
        pos += _IDENTITY
        if pos + _GROUP.size * len(self.groups) > _SUM_AT:
            raise RecordFormatError(f"{len(self.groups)} groups and the key do not fit a header")
        for off, n in self.groups:
            _GROUP.pack_into(body, pos, off, n)
            pos += _GROUP.size
        body[_SUM_AT:] = _header_sum(body)
        return bytes(body)

    def check(self, key: ChunkKey, layout: KVLayout | None = None) -> str | None:
        """Why this header does not belong to `key` (and `layout`), or None if it does.
        Without `layout`, the layout this process knows by the key's fingerprint (if
        any) still decides the payload's length and group offsets."""
        if self.key != key:
            return f"record holds key {self.key.short()}, expected {key.short()}"
        if self.identity != key.identity_digest():
            return "record's identity digest differs from the key's"
        if layout is None:
            shape = shape_of(key.layout_fingerprint)
            if shape is not None:
                nbytes, offsets = shape
                if self.payload_len != nbytes:
                    return f"payload is {self.payload_len} bytes, its layout needs {nbytes}"
                if self.groups != offsets:
                    return f"group offsets {list(self.groups)} differ from its layout's"
        else:
            if key.layout_fingerprint != layout.fingerprint():
                return f"key's layout fingerprint is not layout {layout.name}'s"
            if self.payload_len != layout.chunk_bytes:
                return (
                    f"payload is {self.payload_len} bytes, "
                    f"layout {layout.name} needs {layout.chunk_bytes}"
                )
            if list(self.groups) != layout.group_offsets():
                return f"group offsets {list(self.groups)} differ from layout {layout.name}'s"
        return None


def _header_sum(body: bytes | bytearray | memoryview) -> bytes:
    return hashlib.blake2b(bytes(body[:_SUM_AT]), digest_size=8, person=b"bsr-header").digest()


def make_header(key: ChunkKey, layout: KVLayout, payload_xxh3: int) -> RecordHeader:
    if key.layout_fingerprint != layout.fingerprint():
        raise BsrValueError(
            f"key {key.short()} was made for another layout than {layout.name} "
            f"(fingerprint {key.layout_fingerprint} != {layout.fingerprint()})"
        )
    return RecordHeader(key, layout.chunk_bytes, payload_xxh3, tuple(layout.group_offsets()))


def decode_header(data: bytes | bytearray | memoryview) -> RecordHeader:
    """Parse and check a header; RecordFormatError names the first failed check."""
    data = memoryview(data)
    if len(data) < HEADER_BYTES:
        raise RecordFormatError(f"header truncated: {len(data)} of {HEADER_BYTES} bytes")
    data = data[:HEADER_BYTES]
    magic, version, ngroups, hdr_bytes, payload_len, xxh, key_len = _FIXED.unpack_from(data, 0)
    if magic != MAGIC:
        raise RecordFormatError(f"bad magic {bytes(magic)!r}: not a bsr-io chunk record")
    if _header_sum(data) != bytes(data[_SUM_AT:]):
        raise RecordFormatError("header checksum mismatch")
    if version != VERSION:
        # Checked after the checksum: only an intact header of another version is a miss.
        raise OldRecordFormat(f"record format version {version}, this bsr-io reads {VERSION}")
    if hdr_bytes != HEADER_BYTES:
        raise RecordFormatError(f"header size {hdr_bytes}, expected {HEADER_BYTES}")
    pos = _FIXED.size
    end = pos + key_len + _IDENTITY + ngroups * _GROUP.size
    if end > _SUM_AT:
        raise RecordFormatError("key and group table overrun the header")
    try:
        key = ChunkKey.from_bytes(bytes(data[pos : pos + key_len]))
    except ValueError as exc:
        raise RecordFormatError(f"bad key in header: {exc}") from None
    pos += key_len
    identity = bytes(data[pos : pos + _IDENTITY])
    if identity != key.identity_digest():
        raise RecordFormatError("identity digest does not match the header's key")
    pos += _IDENTITY
    groups = []
    expect = 0
    for _ in range(ngroups):
        off, n = _GROUP.unpack_from(data, pos)
        if off != expect:
            raise RecordFormatError("group table is not contiguous")
        groups.append((off, n))
        expect = off + n
        pos += _GROUP.size
    if expect != payload_len:
        raise RecordFormatError(f"groups cover {expect} bytes, payload is {payload_len}")
    return RecordHeader(key, payload_len, xxh, tuple(groups), identity)
