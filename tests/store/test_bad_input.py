"""Bad input and damaged files: each gives a clear error or a detected corruption, and
every other committed record stays intact. Damage is done to real files on disk."""

import errno
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from tiny_tiers import LAYOUT, tier_at

from bsr_io import Engine
from bsr_io.cli.synthetic import fill_state, synthetic_chunk
from bsr_io.errors import ChunkCorrupt, ChunkWriteError, TierDown
from bsr_io.model.layout import preset
from bsr_io.model.record import HEADER_BYTES
from bsr_io.tiers import SSDTier

SEED = 4


def check_intact(tier, keys, engine, skip=()):
    for i, key in enumerate(keys):
        if i in skip:
            continue
        slot = tier.read_into(key, engine)
        assert bytes(memoryview(slot)) == synthetic_chunk(LAYOUT, SEED, i).tobytes(), i


def flip(path, pos):
    raw = bytearray(path.read_bytes())
    raw[pos] ^= 0x01
    path.write_bytes(raw)


def truncate(path, _pos):
    os.truncate(path, path.stat().st_size - 1)


def swap_with_next(tier, keys):
    # Key 1's file now holds key 2's (valid) record.
    shutil.copyfile(tier.path_of(keys[2]), tier.path_of(keys[1]))


DAMAGE = {
    "payload bit flip": (lambda t, k: flip(t.path_of(k[1]), HEADER_BYTES + 7), "checksum"),
    "header bit flip": (lambda t, k: flip(t.path_of(k[1]), 40), "header"),
    "truncated": (lambda t, k: truncate(t.path_of(k[1]), 0), "truncated|bytes"),
    "swapped": (swap_with_next, "another key|expected"),
}


@pytest.mark.parametrize("kind", ["L2", "L3"])
@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damage_found_on_read(kind, damage, tmp_path, engine):
    tier = tier_at(kind, tmp_path, engine)
    _, keys = fill_state(tier, LAYOUT, LAYOUT.chunk_tokens * 4, seed=SEED)
    do, msg = DAMAGE[damage]
    do(tier, keys)
    with pytest.raises(ChunkCorrupt, match=msg) as info:
        tier.read_into(keys[1], engine)
    assert info.value.key == keys[1] and info.value.tier == kind
    assert tier.probe(keys) == 1
    assert len(tier.quarantined_files()) == 1
    check_intact(tier, keys, engine, skip={1})
    assert tier_at(kind, tmp_path, engine).probe(keys) == 1  # stays withdrawn after reopen


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damage_found_on_reopen(damage, tmp_path, engine):
    tier = tier_at("L2", tmp_path, engine)
    _, keys = fill_state(tier, LAYOUT, LAYOUT.chunk_tokens * 4, seed=SEED)
    do, msg = DAMAGE[damage]
    do(tier, keys)
    again = tier_at("L2", tmp_path, engine)
    if damage == "payload bit flip":  # only a read can see payload damage
        assert again.probe(keys) == 4
        with pytest.raises(ChunkCorrupt):
            again.read_into(keys[1], engine)
    else:
        assert again.probe(keys) == 1 and len(again.problems) == 1
        assert again.problems[0].path.endswith(again.path_of(keys[1]).name)
    check_intact(again, keys, engine, skip={1})


@pytest.fixture
def small_fs():
    """A real 8 MiB ext4 filesystem on a loop device (needs root)."""
    if os.geteuid() != 0 or not shutil.which("mkfs.ext4"):
        pytest.skip("needs root and mkfs.ext4 to make a small filesystem")
    work = Path(tempfile.mkdtemp())
    img, mnt = work / "fs.img", work / "mnt"
    mnt.mkdir()
    with open(img, "wb") as f:
        f.truncate(8 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-m", "0", str(img)], check=True)
    if subprocess.run(["mount", "-o", "loop", str(img), str(mnt)]).returncode != 0:
        shutil.rmtree(work)
        pytest.skip("cannot loop-mount here")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)]).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], check=True)
            pytest.fail("the store kept a file open on the filesystem after the test")
        shutil.rmtree(work)


@pytest.mark.parametrize("kind", ["L2", "L3"])
def test_full_disk(kind, small_fs):
    big = preset("tiny", chunk_tokens=1024)  # 135 KiB chunks: the disk fills in ~50
    with Engine(2, big.chunk_bytes) as engine:
        tier = tier_at(kind, small_fs, engine)
        with pytest.raises(ChunkWriteError, match="no space left") as info:
            fill_state(tier, big, big.chunk_tokens * 200, seed=SEED)
        assert info.value.cause.errno == errno.ENOSPC
        held = tier.keys()
        assert 10 < len(held) < 200
        again = tier_at(kind, small_fs, engine)
        assert sorted(again.keys(), key=str) == sorted(held, key=str)
        assert not list(small_fs.rglob("*.tmp"))
        for key in held:
            again.read_into(key, engine)  # verifies key and checksum


_UNPRIVILEGED = r"""
import json, sys
from bsr_io import Engine
from bsr_io.errors import ChunkWriteError, TierDown
from bsr_io.model.layout import preset
from bsr_io.cli.synthetic import fill_state
from bsr_io.tiers import SSDTier
lay = preset("tiny")
out = {}
with Engine(2, lay.chunk_bytes) as eng:
    try:
        SSDTier(sys.argv[2], None, eng)
    except TierDown as exc:
        out["create"] = str(exc)
    tier = SSDTier(sys.argv[1], None, eng)
    out["probe"] = len(tier.keys())
    slot = tier.read_into(tier.keys()[0], eng)
    out["read"] = len(slot)
    del slot
    try:
        fill_state(tier, lay, 64, seed=99)
    except ChunkWriteError as exc:
        out["write"] = str(exc)
print(json.dumps(out))
"""


def test_unwritable_directory(engine):
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv to run a process that permissions apply to")
    work = Path(tempfile.mkdtemp())
    try:
        os.chmod(work, 0o755)
        store = work / "store"
        tier = SSDTier(store, None, engine)
        _, keys = fill_state(tier, LAYOUT, LAYOUT.chunk_tokens * 3, seed=SEED)
        for p in [store, *store.rglob("*")]:  # readable by others, writable by no one else
            os.chmod(p, 0o755 if p.is_dir() else 0o644)
        blocked = work / "blocked"
        blocked.mkdir(mode=0o755)
        res = subprocess.run(
            [
                "setpriv",
                "--reuid=65534",
                "--regid=65534",
                "--clear-groups",
                sys.executable,
                "-c",
                _UNPRIVILEGED,
                str(store),
                str(blocked / "sub"),
            ],
            capture_output=True,
            text=True,
            env=dict(os.environ, HOME=str(work)),
        )
        assert res.returncode == 0, res.stderr
        out = json.loads(res.stdout)
        assert "cannot create or open store directory" in out["create"]
        assert out["probe"] == 3 and out["read"] == LAYOUT.chunk_bytes
        assert "is not writable" in out["write"] and "earlier records intact" in out["write"]
        check_intact(SSDTier(store, None, engine), keys, engine)
    finally:
        shutil.rmtree(work)


def test_store_root_gone_is_tier_down(tmp_path, engine):
    tier = SSDTier(tmp_path / "s", None, engine)
    _, keys = fill_state(tier, LAYOUT, LAYOUT.chunk_tokens, seed=SEED)
    shutil.rmtree(tmp_path / "s")
    with pytest.raises(TierDown, match="gone"):
        tier.read_into(keys[0], engine)


@pytest.mark.parametrize("kind", ["L2", "L3"])
def test_links_in_the_store_are_never_records(kind, tmp_path, engine):
    tier = tier_at(kind, tmp_path / "s", engine)
    _, keys = fill_state(tier, LAYOUT, LAYOUT.chunk_tokens * 2, seed=SEED)
    outside = tmp_path / "outside"
    shutil.copyfile(tier.path_of(keys[0]), outside)  # a valid record, but out of the store
    os.symlink(outside, tier.path_of(keys[1]).with_name("0123456789abcdef.chunk"))
    tier.path_of(keys[1]).unlink()
    os.symlink(outside, tier.path_of(keys[1]))
    again = tier_at(kind, tmp_path / "s", engine)
    assert again.problems == [] and again.keys() == [keys[0]]
    assert again.probe(keys) == 1 and not again.contains(keys[1])
    assert outside.exists()
