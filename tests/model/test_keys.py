"""Prefix hashing and chunk keys."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from bsr_io.model.keys import ChunkKey, chunk_keys, extend_prefix_hashes, prefix_hashes
from bsr_io.model.layout import preset

FP = "0" * 32


def test_partial_last_chunk_has_no_hash():
    assert len(prefix_hashes(list(range(47)), 16)) == 2
    assert len(prefix_hashes(list(range(48)), 16)) == 3
    assert prefix_hashes([], 16) == []


def test_chaining_names_the_whole_prefix():
    tokens = np.arange(64, dtype=np.int64)
    base = prefix_hashes(tokens, 16)
    late = tokens.copy()
    late[40] += 1  # inside chunk 2
    early = tokens.copy()
    early[3] += 1  # inside chunk 0
    assert prefix_hashes(late, 16)[:2] == base[:2]
    assert prefix_hashes(late, 16)[2:] != base[2:]
    assert all(a != b for a, b in zip(prefix_hashes(early, 16), base, strict=True))
    # The same tokens in a later position hash differently (the chain differs).
    assert len(set(prefix_hashes([7] * 64, 16))) == 4


def test_list_numpy_torch_agree():
    ids = [5, 9, 2**40, 0] * 8
    h = prefix_hashes(ids, 8)
    assert prefix_hashes(np.array(ids, dtype=np.int64), 8) == h
    assert prefix_hashes(np.array(ids, dtype=np.uint64), 8) == h
    assert prefix_hashes(torch.tensor(ids), 8) == h


def _reference_chain(ids, chunk):
    """The scheme as keys.py documents it, in hashlib: keys on disk depend on it."""
    import hashlib

    out, prev = [], b"\0" * 16
    for i in range(0, len(ids) - chunk + 1, chunk):
        h = hashlib.blake2b(digest_size=32, person=b"bsr-prefix")
        h.update(b"bsr-io/prefix/v2" + prev + np.asarray(ids[i : i + chunk], "<i8").tobytes())
        prev = h.digest()[:16]
        out.append(int.from_bytes(prev, "little"))
    return out


def test_hashes_follow_the_documented_scheme():
    rng = np.random.default_rng(3)
    ids = rng.integers(-(2**40), 2**40, size=3 * 64 + 5).tolist()
    want = _reference_chain(ids, 64)
    assert len(want) == 3
    assert prefix_hashes(ids, 64) == want  # a list goes to Rust as it is
    assert prefix_hashes(np.asarray(ids), 64) == want  # an array as int64 bytes
    assert extend_prefix_hashes(want[:1], ids, 64) == want


def test_short_and_long_inputs_hash_by_the_same_scheme():
    """Below 32K tokens the hash keeps the GIL (lib.rs `DETACH_BYTES`), above it the hash
    runs without it: both paths follow the documented scheme, lists and arrays alike."""
    rng = np.random.default_rng(11)
    ids = rng.integers(0, 2**31, size=40_000).tolist()
    want = _reference_chain(ids, 1000)
    assert prefix_hashes(ids, 1000) == want  # 320,000 bytes: without the GIL
    assert prefix_hashes(np.asarray(ids), 1000) == want
    assert prefix_hashes(ids[:3000], 1000) == want[:3]  # 24,000 bytes: with it
    assert extend_prefix_hashes(want[:2], ids[:30_000], 1000) == want[:30]


def test_hash_is_stable_across_processes():
    code = "from bsr_io.model.keys import prefix_hashes; print(prefix_hashes(list(range(100)), 10))"
    outs = set()
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert res.returncode == 0, res.stderr
        outs.add(res.stdout)
    assert outs == {str(prefix_hashes(list(range(100)), 10)) + "\n"}


@pytest.mark.parametrize(
    "bad, msg",
    [
        (np.zeros((2, 8), dtype=np.int64), "one-dimensional"),
        ([1.5] * 8, "integers"),
        ([1] * 7 + ["x"], "integers"),
        ([2**64] * 8, "integers"),
        ([True] * 8, "integers, got bool at index 0"),
        ([1, 2, 3, False, 5, 6, 7, 8], "integers, got bool at index 3"),
        (np.ones(8, dtype=bool), "integers, got dtype bool"),
    ],
)
def test_bad_token_ids(bad, msg):
    with pytest.raises(ValueError, match=msg):
        prefix_hashes(bad, 4)


def test_the_restorer_refuses_bools_as_token_ids(tmp_path):
    """Through the API a user calls: probe and save refuse a list of bools (Python's
    bool is an int, so the list would otherwise hash as ones and zeros)."""
    from bsr_io import Engine, PagedKVCache, Restorer, open_store, preset

    layout = preset("tiny")
    with Engine(2, layout.chunk_bytes) as engine:
        store = open_store(engine, tmp_path / "l2", layout=layout)
        restorer = Restorer(store, layout, engine=engine, model="m")
        tokens = [True, False] * layout.chunk_tokens
        with pytest.raises(ValueError, match="got bool"):
            restorer.probe(tokens)
        with pytest.raises(ValueError, match="got bool"):
            restorer.save(tokens, PagedKVCache.allocate(layout, len(tokens)))
        store.close()


def test_bad_chunk_tokens():
    with pytest.raises(ValueError, match="chunk_tokens"):
        prefix_hashes([1, 2], 0)


def test_key_round_trip_and_identity():
    k = ChunkKey("meta-llama/Llama-3.1-8B", 2, 1, "ab" * 16, 2**64 - 1)
    assert ChunkKey.from_bytes(k.to_bytes()) == k
    variants = [
        ChunkKey("other", 2, 1, "ab" * 16, 2**64 - 1),
        ChunkKey("meta-llama/Llama-3.1-8B", 2, 0, "ab" * 16, 2**64 - 1),
        ChunkKey("meta-llama/Llama-3.1-8B", 4, 1, "ab" * 16, 2**64 - 1),
        ChunkKey("meta-llama/Llama-3.1-8B", 2, 1, "cd" * 16, 2**64 - 1),
    ]
    for v in variants:
        assert v != k and v.hex() != k.hex()
        assert (v.namespace(), v.file_stem()) != (k.namespace(), k.file_stem())


def test_user_strings_never_reach_paths():
    k = ChunkKey("../../etc/passwd\x00/..", 1, 0, FP, 1)
    for part in (k.namespace(), k.file_stem()):
        assert "/" not in part and "." not in part and "\x00" not in part


@pytest.mark.parametrize(
    "args, msg",
    [
        (("", 1, 0, FP, 1), "model"),
        (("m", 0, 0, FP, 1), "world_size"),
        (("m", 2, 2, FP, 1), "rank"),
        (("m", 1, 0, "xyz", 1), "layout_fingerprint"),
        (("m", 1, 0, FP, -1), "chunk_hash"),
        (("m" * 2000, 1, 0, FP, 1), "longer"),
    ],
)
def test_bad_keys(args, msg):
    with pytest.raises(ValueError, match=msg):
        ChunkKey(*args)


def test_from_bytes_rejects_trailing_bytes():
    k = ChunkKey("m", 1, 0, FP, 1)
    with pytest.raises(ValueError, match="trailing"):
        ChunkKey.from_bytes(k.to_bytes() + b"x")


def test_chunk_keys_per_rank_and_layout():
    tiny = preset("tiny")
    other = preset("tiny", chunk_tokens=32)
    ids = list(range(100))
    k0 = chunk_keys(ids, tiny, "m", rank=0, world_size=2)
    k1 = chunk_keys(ids, tiny, "m", rank=1, world_size=2)
    assert len(k0) == 100 // tiny.chunk_tokens
    assert [k.chunk_hash for k in k0] == [k.chunk_hash for k in k1]
    assert not set(k0) & set(k1)
    assert {k.layout_fingerprint for k in chunk_keys(ids, other, "m")} == {other.fingerprint()}


def test_extending_the_chain_equals_hashing_the_whole_sequence():
    tokens = list(np.random.default_rng(5).integers(0, 50_000, 16 * 7 + 5))
    whole = prefix_hashes(tokens, 16)
    assert len(whole) == 7
    for done in range(8):
        for cut in range(done * 16, len(tokens) + 1, 5):
            part = extend_prefix_hashes(whole[:done], tokens[:cut], 16)
            assert part == prefix_hashes(tokens[:cut], 16), (done, cut)
    assert extend_prefix_hashes(whole[:3], tokens, 16) == whole
    # A chain continued from another prefix's hashes names another prefix.
    other = prefix_hashes([t + 1 for t in tokens], 16)
    assert extend_prefix_hashes(other[:2], tokens, 16)[2:] != whole[2:]
    with pytest.raises(ValueError, match="earlier chunk hashes"):
        extend_prefix_hashes(whole, tokens[:20], 16)


def test_chunk_hashes_are_128_bits():
    """Keys carry 128 bits: over a few thousand chunks some hash needs more than 64 bits
    (a 64-bit hash never would), none more than 128; the wider key round-trips."""
    hashes = prefix_hashes(np.arange(4096 * 8, dtype=np.int64) % 50_000, 8)
    assert max(h.bit_length() for h in hashes) > 64
    assert all(0 <= h < 1 << 128 for h in hashes)
    assert len(set(hashes)) == len(hashes)
    k = ChunkKey("m", 1, 0, FP, (1 << 128) - 1)
    assert ChunkKey.from_bytes(k.to_bytes()) == k and len(k.file_stem()) == 32
    with pytest.raises(ValueError, match="128-bit"):
        ChunkKey("m", 1, 0, FP, 1 << 128)
    with pytest.raises(ValueError):
        ChunkKey.from_bytes(k.to_bytes()[:-1])


def test_identity_digest_covers_every_field():
    k = ChunkKey("model#ctx", 2, 1, FP, 12345)
    variants = [
        ChunkKey("model#ctx2", 2, 1, FP, 12345),
        ChunkKey("model#ctx", 4, 1, FP, 12345),
        ChunkKey("model#ctx", 2, 0, FP, 12345),
        ChunkKey("model#ctx", 2, 1, "cd" * 16, 12345),
        ChunkKey("model#ctx", 2, 1, FP, 12345 + (1 << 64)),  # differs above bit 64 only
    ]
    assert len(k.identity_digest()) == 32
    assert len({v.identity_digest() for v in variants} | {k.identity_digest()}) == 6
