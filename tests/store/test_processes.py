"""Several real processes sharing one store directory."""

import json
import subprocess
import sys

from bsr_io import Engine
from bsr_io.cli.synthetic import synthetic_chunk, synthetic_tokens
from bsr_io.model.keys import chunk_keys
from bsr_io.model.layout import preset
from bsr_io.tiers import SSDTier

LAYOUT = preset("tiny", chunk_tokens=256)  # 33 KiB chunks

_PROC = r"""
import json, sys, time
from bsr_io import Engine
from bsr_io.errors import ChunkCorrupt, ChunkMissing
from bsr_io.model.keys import chunk_keys
from bsr_io.model.layout import preset
from bsr_io.cli.synthetic import fill_state, synthetic_chunk, synthetic_tokens
from bsr_io.tiers import SSDTier

role, root, rank, seconds = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
lay = preset("tiny", chunk_tokens=256)
shared = chunk_keys(synthetic_tokens(100, 256 * 6), lay, "shared")
out = {"ok": 0, "missing": 0, "corrupt": 0, "wrong": 0}
with Engine(2, lay.chunk_bytes) as eng:
    tier = SSDTier(root, None, eng)
    if role == "fill":
        fill_state(tier, lay, 256 * 6, seed=rank, rank=rank, world_size=3, model="m")
        fill_state(tier, lay, 256 * 6, seed=100, model="shared")  # the same keys, all at once
    elif role == "churn":  # remove and rewrite the shared records again and again
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for i, k in enumerate(shared):
                tier.remove(k)
                tier.write(k, synthetic_chunk(lay, 100, i), lay)
                out["ok"] += 1
    else:  # read the shared records while another process churns them
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for i, k in enumerate(shared):
                try:
                    slot = tier.read_into(k, eng)
                except ChunkMissing:
                    out["missing"] += 1
                    continue
                except ChunkCorrupt:
                    out["corrupt"] += 1
                    continue
                same = bytes(memoryview(slot)) == synthetic_chunk(lay, 100, i).tobytes()
                out["ok" if same else "wrong"] += 1
                del slot
print(json.dumps(out))
"""


def spawn(role, root, rank=0, seconds=0.0):
    return subprocess.Popen(
        [sys.executable, "-c", _PROC, role, str(root), str(rank), str(seconds)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc):
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    return json.loads(out)


def test_concurrent_writers_share_a_directory(tmp_path):
    procs = [spawn("fill", tmp_path, rank) for rank in range(3)]
    for p in procs:
        finish(p)
    with Engine(2, LAYOUT.chunk_bytes) as engine:
        tier = SSDTier(tmp_path, None, engine)
        assert tier.problems == [] and not list(tmp_path.rglob("*.tmp"))
        for rank in range(3):
            keys = chunk_keys(synthetic_tokens(rank, 256 * 6), LAYOUT, "m", rank, 3)
            for i, k in enumerate(keys):
                slot = tier.read_into(k, engine)
                assert bytes(memoryview(slot)) == synthetic_chunk(LAYOUT, rank, i, rank).tobytes()
        assert len(tier.keys()) == 3 * 6 + 6


def test_reader_never_sees_a_torn_record_while_another_process_rewrites(tmp_path):
    finish(spawn("fill", tmp_path, 0))
    churn, reader = spawn("churn", tmp_path, 0, 3.0), spawn("read", tmp_path, 0, 3.0)
    seen, rewrites = finish(reader), finish(churn)
    assert rewrites["ok"] > 0 and seen["ok"] > 0
    assert seen["corrupt"] == 0 and seen["wrong"] == 0
