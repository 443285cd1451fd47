"""A record whose intact header disagrees with its key or layout is corrupt: each field
wrong in turn (header checksum recomputed, so only the field is wrong), written at a
record's path after the probe saw a good one. The restore ends `zero` (never an
exception), the record is quarantined, and the next restore of the prefix up to it is
complete. Real files, real engine; the records are forged on purpose."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

from bsr_io import Engine, PagedKVCache, Restorer, open_store, preset, xxh3_64
from bsr_io.cli.synthetic import fill_state
from bsr_io.model.keys import ChunkKey
from bsr_io.model.record import RecordHeader

BAD = 3
CHUNKS = 6


def _forge(key: ChunkKey, layout, field: str) -> bytes:
    """A record for `key` with one header field wrong; everything else consistent."""
    n = layout.chunk_bytes
    offsets = tuple(layout.group_offsets())
    if field == "longer payload":
        n, offsets = n + 4096, ((0, n + 4096),)
    elif field == "shorter payload":
        n, offsets = n - 64, ((0, n - 64),)
    elif field == "one byte short":
        n, offsets = n - 1, ((0, n - 1),)
    elif field == "group offsets":
        offsets = ((0, n),)  # the right length, but not the layout's groups
    payload = np.random.default_rng(5).integers(0, 255, n, dtype=np.uint8).tobytes()
    digest = xxh3_64(payload)
    rec_key, identity = key, b""
    if field == "payload hash":
        digest ^= 1
    elif field == "chunk hash":
        rec_key = dataclasses.replace(key, chunk_hash=key.chunk_hash ^ 1)
    elif field == "rank":
        rec_key = dataclasses.replace(key, world_size=2, rank=1)
    elif field == "model":
        rec_key = dataclasses.replace(key, model="another-model")
    elif field == "identity":
        identity = bytes(16)
    header = RecordHeader(rec_key, n, digest, offsets, identity)
    return header.encode() + payload


FIELDS = [
    "longer payload",
    "shorter payload",
    "one byte short",
    "group offsets",
    "payload hash",
    "chunk hash",
    "rank",
    "model",
    "identity",
]


@pytest.mark.parametrize("field", FIELDS)
@pytest.mark.parametrize("name", ["tiny", "deepseek-v4-flash"])
def test_a_header_at_odds_with_its_key_or_layout_is_a_miss_never_an_error(tmp_path, name, field):
    layout = preset(name)
    if name != "tiny" and field not in ("longer payload", "one byte short", "group offsets"):
        pytest.skip("the key and hash fields are layout-independent: tiny covers them")
    engine = Engine(2, layout.chunk_bytes)
    store = open_store(engine, tmp_path / "l2", layout=layout)
    l2 = store.tier("L2")
    tokens, keys = fill_state(l2, layout, CHUNKS * layout.chunk_tokens, seed=7, model="m")
    r = Restorer(store, layout, engine=engine, model="m", timeout_s=10)
    plan = r.probe(tokens)
    assert plan.hit_chunks == CHUNKS
    path = l2.path_of(keys[BAD])
    path.write_bytes(_forge(keys[BAD], layout, field))
    res = r.restore(plan, PagedKVCache.allocate(layout, plan.hit_tokens))
    assert res.outcome == "zero" and f"chunk {BAD}" in res.reason, res.reason
    assert not path.exists()  # quarantined: moved aside, with why
    why = [f for f in os.listdir(tmp_path / "l2" / "quarantine") if f.endswith(".why")]
    assert len(why) == 1
    again = r.probe(tokens)
    assert again.hit_chunks == BAD
    res = r.restore(again, PagedKVCache.allocate(layout, again.hit_tokens))
    assert res.outcome == "complete", res.reason
    store.close()
    engine.close()
