"""A record is withdrawn only when it is shown bad (checksum, key, layout, size, torn
write). An I/O error, a timeout or a tier that is down is a fallback for this restore and
nothing more: the record stays and the next restore reads it again. The fault double's
"error" raises what a real EIO mid-read raises (naming the record file); "corrupt" flips a
real byte on disk, the control that must be quarantined."""

from __future__ import annotations

import pytest

from bsr_io import Engine
from bsr_io.cli.synthetic import fill_state, synthetic_chunk
from bsr_io.errors import (
    ChunkCorrupt,
    ChunkMissing,
    ChunkReadError,
    TierDown,
    Unproven,
    proves_bad,
)
from bsr_io.faults import Fault, FaultPlan
from bsr_io.load.kvcache import PagedKVCache
from bsr_io.model.layout import preset
from bsr_io.restore import Restorer
from bsr_io.store import Store, open_store
from bsr_io.tiers import MemoryTier

LAYOUT = preset("tiny")
CHUNKS = 6
BAD = 2


def test_only_chunk_corrupt_proves_a_record_bad():
    assert ChunkCorrupt.proven_bad
    for cls in (ChunkReadError, ChunkMissing, TierDown):
        exc = cls("x", record="the-record")
        assert not cls.proven_bad
        assert isinstance(exc.record, Unproven) and exc.record.record == "the-record"
        assert not proves_bad(exc.record)
    assert ChunkCorrupt("x", record="r").record == "r" and proves_bad("r")
    assert proves_bad(None)  # a caller's own invalidate(key) without a record


@pytest.mark.parametrize("kind", ["error", "corrupt"])
@pytest.mark.parametrize("threads", [1, 2])
def test_l2_record_behind_an_io_error_stays_a_bad_one_goes(tmp_path, kind, threads):
    engine = Engine(4, LAYOUT.chunk_bytes)
    base = open_store(engine, tmp_path / "l2", layout=LAYOUT, lower_dir=tmp_path / "l3")
    l2, l3 = base.tier("L2"), base.tier("L3")
    tokens, keys = fill_state(l2, LAYOUT, CHUNKS * 16, seed=3, model="m")
    fill_state(l3, LAYOUT, CHUNKS * 16, seed=3, model="m")
    faulty = FaultPlan([Fault(kind, tier="L2", chunks=[BAD], times=1)]).wrap(l2)
    r = Restorer(
        Store([faulty, l3]), LAYOUT, window=4, engine=engine, model="m", install_threads=threads
    )

    def restore():
        dest = PagedKVCache.allocate(LAYOUT, CHUNKS * 16)
        res = r.restore(r.probe(tokens), dest)
        assert res.complete, res.reason
        for i in range(CHUNKS):
            assert dest.chunk_bytes(i) == synthetic_chunk(LAYOUT, 3, i).tobytes()
        return res

    first = restore()
    assert first.source_tiers[BAD] == "L3"  # the failed chunk came from the lower tier
    assert [f["chunk"] for f in first.fallbacks] == [BAD]
    second = restore()  # the fault fired once: what is left in L2 is read from L2
    if kind == "error":
        assert l2.quarantined_files() == [] and l2.stats()["quarantined"] == 0
        assert l2.contains(keys[BAD])
        assert second.source_tiers == ["L2"] * CHUNKS
    else:
        assert len(l2.quarantined_files()) == 1 and not l2.contains(keys[BAD])
        assert second.source_tiers[BAD] == "L3"
    assert engine.live_bytes() == 0


def test_memory_tier_keeps_an_entry_on_an_unproven_failure():
    tier = MemoryTier(1 << 22)
    _, keys = fill_state(tier, LAYOUT, 2 * 16, seed=1)
    entry = tier._entries[keys[0]]
    tier.invalidate(keys[0], "timeout", record=ChunkReadError("t", record=entry).record)
    assert tier.contains(keys[0]) and tier.stats()["quarantined"] == 0
    tier.invalidate(keys[0], "checksum", record=entry)  # the control: a proof
    assert not tier.contains(keys[0]) and tier.stats()["quarantined"] == 1


def _as_version_1(path) -> None:
    """Rewrite the record at `path` as an intact record of format version 1."""
    from bsr_io.model.record import HEADER_BYTES, _header_sum

    with open(path, "r+b") as f:
        body = bytearray(f.read(HEADER_BYTES))
        body[8:10] = (1).to_bytes(2, "little")
        body[HEADER_BYTES - 8 :] = _header_sum(body)
        f.seek(0)
        f.write(body)


@pytest.mark.parametrize("tier_kind", ["L2", "L3"])
def test_records_of_an_older_format_are_a_miss_and_stay(tmp_path, tier_kind):
    from bsr_io.tiers import LowerTier, SSDTier

    engine = Engine(2, LAYOUT.chunk_bytes)
    make = (
        (lambda: SSDTier(tmp_path, None, engine))
        if tier_kind == "L2"
        else (lambda: LowerTier(tmp_path))
    )
    tier = make()
    _, keys = fill_state(tier, LAYOUT, 3 * 16, seed=4)
    path = tier.path_of(keys[1])
    _as_version_1(path)
    # An older bsr-io's file name (a 16-hex stem) beside the records: not ours now.
    legacy = path.with_name("0123456789abcdef.chunk")
    legacy.write_bytes(path.read_bytes())
    fresh = make()  # its scan skips both
    for t in (tier, fresh):
        assert t.probe(keys) == 1
        with pytest.raises(ChunkMissing, match="older format"):
            t.read_into(keys[1], engine)
        assert t.quarantined_files() == [] and t.stats()["quarantined"] == 0
    assert path.exists() and legacy.exists()
    assert keys[1] not in fresh.keys() and len(fresh.keys()) == 2
