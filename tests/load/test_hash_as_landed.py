"""Direct reads hashed as their requests land (`DirectRead.wait_xxh3`): the hash is the
whole payload's, a damaged byte in its first or its last request is caught, and a read
that fails part way gives its error, never a hash."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from layouts import ALIGNED

from bsr_io import Engine
from bsr_io._core import ShortReadError, xxh3_64
from bsr_io.cli.synthetic import fill_state, synthetic_chunk
from bsr_io.load import window
from bsr_io.load.kvcache import PagedKVCache
from bsr_io.model.record import HEADER_BYTES
from bsr_io.restore import Restorer
from bsr_io.store import Store
from bsr_io.tiers import LowerTier, SSDTier

PIECE = 4096  # the engine's request size here: a chunk lands in several requests
LAYOUT = ALIGNED  # 4 KiB blocks, every run suits O_DIRECT; a chunk is 8 requests
CHUNKS = 8
TOKENS = CHUNKS * LAYOUT.chunk_tokens


def _ok(dest: PagedKVCache) -> bool:
    return all(
        dest.chunk_bytes(i) == synthetic_chunk(LAYOUT, 5, i).tobytes() for i in range(CHUNKS)
    )


def _buffer(n: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """`n` bytes of page-aligned host memory (O_DIRECT's)."""
    raw = np.zeros(n + 4096, dtype=np.uint8)
    off = -raw.ctypes.data % 4096
    return raw[off : off + n]


@pytest.mark.parametrize("backend", ["io_uring", "pread"])
def test_the_hash_as_landed_is_the_payloads_in_run_order(tmp_path: Path, backend: str) -> None:
    engine = Engine(2, 8 * PIECE, backend=backend, request_bytes=PIECE)
    data = os.urandom(9 * PIECE)
    path = tmp_path / "f"
    path.write_bytes(data)
    f = engine.open(path)
    buf = _buffer(16 * PIECE)
    # Two runs, the second before the first in memory: the hash follows the payload.
    runs = [(0, 10 * PIECE, 0, 3 * PIECE), (0, 0, 3 * PIECE, 5 * PIECE)]
    before = time.perf_counter()
    h, landed = engine.submit_read_into(f, PIECE, [buf], runs).wait_xxh3(10.0)
    assert before <= landed <= time.perf_counter(), "the read ended during the call"
    assert h == xxh3_64(data[PIECE:])
    assert bytes(buf[10 * PIECE : 13 * PIECE]) + bytes(buf[: 5 * PIECE]) == data[PIECE:]
    f.close()


def test_a_read_that_fails_part_way_gives_its_error_not_a_hash(tmp_path: Path) -> None:
    """The file ends in the read's third request: the first two land, the read is short."""
    engine = Engine(2, 8 * PIECE, request_bytes=PIECE)
    path = tmp_path / "f"
    path.write_bytes(os.urandom(2 * PIECE + 100))
    f = engine.open(path)
    read = engine.submit_read_into(f, 0, [_buffer(4 * PIECE)], [(0, 0, 0, 4 * PIECE)])
    with pytest.raises(ShortReadError):
        read.wait_xxh3(10.0)
    assert read.done()
    f.close()


def _flip(path: Path, at: int) -> None:
    """Flip payload byte `at` of the stored record (negative: from the payload's end)."""
    where = HEADER_BYTES + at % LAYOUT.chunk_bytes
    fd = os.open(path, os.O_RDWR)
    try:
        (b,) = os.pread(fd, 1, where)
        os.pwrite(fd, bytes([b ^ 0xFF]), where)
    finally:
        os.close(fd)


def test_damage_in_the_first_and_in_the_last_request_is_caught_as_it_lands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunk 2's record is damaged in its payload's first request, chunk 5's in its last
    one; each chunk lands in 8 requests. No chunk is hashed after its read (the in-place
    hash is replaced by a test double that fails): the hashes taken as the requests
    landed catch both, the records are withdrawn and the chunks come from L3."""
    engine = Engine(4, LAYOUT.chunk_bytes, request_bytes=PIECE)
    assert LAYOUT.chunk_bytes == 8 * PIECE
    l2 = SSDTier(tmp_path / "l2", None, engine, layout=LAYOUT)
    tiers = [l2, LowerTier(tmp_path / "l3", layout=LAYOUT)]
    for t in tiers:
        tokens, keys = fill_state(t, LAYOUT, TOKENS, seed=5, model="m")
    _flip(l2.path_of(keys[2]), 10)
    _flip(l2.path_of(keys[5]), -10)

    def hashed_after_the_wait(*_args: object) -> int:
        raise AssertionError("a direct read was hashed after it landed, not as it landed")

    monkeypatch.setattr(window, "xxh3_runs", hashed_after_the_wait)
    dest = PagedKVCache.allocate(LAYOUT, TOKENS)
    r = Restorer(Store(tiers), LAYOUT, window=4, engine=engine, model="m")
    res = r.restore(r.probe(tokens), dest)
    assert res.outcome == "complete", res.reason
    assert [f["chunk"] for f in res.fallbacks] == [2, 5]
    for f in res.fallbacks:
        assert "payload checksum mismatch after a direct read" in " ".join(f["causes"])
    assert res.source_tiers[2] == res.source_tiers[5] == "L3"
    assert res.timings["direct_chunks"] == CHUNKS - 2 and _ok(dest)
    assert len(l2.quarantined_files()) == 2
