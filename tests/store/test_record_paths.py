"""What sits at a record's path.

A FIFO, socket, directory or device node put where a record was must fail that
chunk at once, in every tier, never hang the restore. Invalidation withdraws
exactly the record that failed: one republished at the same path meanwhile (as
another process sharing the directory would) stays. Real files, real engine.
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
import stat
import threading

import pytest

from bsr_io import Engine
from bsr_io.cli.synthetic import fill_state, synthetic_chunk
from bsr_io.load.kvcache import PagedKVCache
from bsr_io.model.layout import preset
from bsr_io.model.record import HEADER_BYTES
from bsr_io.restore import Restorer
from bsr_io.store import Store, open_store
from bsr_io.tiers import LowerTier, MemoryTier, SSDTier

LAYOUT = preset("tiny")
CHUNKS = 6
BAD = 3  # the chunk whose record is replaced


def _put_special(path, kind: str):
    """Replace the record file at `path` by a non-regular file of `kind`."""
    os.unlink(path)
    if kind == "fifo":
        os.mkfifo(path)  # no writer: a blocking open for reading never returns
    elif kind == "socket":
        s = socket.socket(socket.AF_UNIX)
        short = f"/tmp/bsr-sock-{os.getpid()}"  # sun_path is 108 bytes: bind, then move
        s.bind(short)
        os.rename(short, path)
        return s
    elif kind == "directory":
        os.mkdir(path)
    elif kind == "device":
        try:
            os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 5))  # /dev/zero
        except PermissionError:
            pytest.skip("making a device node needs CAP_MKNOD")
    return None


def _restore_in_thread(r, plan, dest, limit_s=20.0):
    out = []
    t = threading.Thread(target=lambda: out.append(r.restore(plan, dest)), daemon=True)
    t.start()
    t.join(limit_s)
    assert not t.is_alive(), "the restore hangs on a non-regular file at a record's path"
    return out[0]


@pytest.mark.parametrize("kind", ["fifo", "socket", "directory", "device"])
@pytest.mark.parametrize("tier", ["L2", "L3"])
def test_non_regular_record_is_a_chunk_failure(tmp_path, tier, kind):
    engine = Engine(2, LAYOUT.chunk_bytes)
    if tier == "L2":
        t = SSDTier(tmp_path / "l2", None, engine, layout=LAYOUT)
    else:
        t = LowerTier(tmp_path / "l3", layout=LAYOUT)
    tokens, keys = fill_state(t, LAYOUT, CHUNKS * 16, seed=7, model="m")
    r = Restorer(Store([t]), LAYOUT, window=2, engine=engine, model="m", timeout_s=5)
    plan = r.probe(tokens)
    assert plan.hit_chunks == CHUNKS  # discovery saw regular files
    keep = _put_special(t.path_of(keys[BAD]), kind)
    res = _restore_in_thread(r, plan, PagedKVCache.allocate(LAYOUT, CHUNKS * 16))
    assert res.outcome == "zero"
    assert f"chunk {BAD}" in res.reason
    assert (
        ("regular file" in res.reason)
        or ("Is a directory" in res.reason)
        or (
            "No such device" in res.reason  # a socket refuses the open itself (ENXIO)
        )
    ), res.reason
    assert engine.free_slots() == 2
    # The other records are untouched and still advertised.
    assert t.probe(keys[:BAD]) == BAD
    if keep is not None:
        keep.close()


def test_non_regular_record_falls_back_to_a_lower_copy(tmp_path):
    engine = Engine(2, LAYOUT.chunk_bytes)
    store = open_store(engine, tmp_path / "l2", layout=LAYOUT, lower_dir=tmp_path / "l3")
    tokens, keys = fill_state(store.tier("L2"), LAYOUT, CHUNKS * 16, seed=7, model="m")
    fill_state(store.tier("L3"), LAYOUT, CHUNKS * 16, seed=7, model="m")
    r = Restorer(store, LAYOUT, window=2, engine=engine, model="m", timeout_s=5)
    plan = r.probe(tokens)
    _put_special(store.tier("L2").path_of(keys[BAD]), "fifo")
    dest = PagedKVCache.allocate(LAYOUT, CHUNKS * 16)
    res = _restore_in_thread(r, plan, dest)
    assert res.outcome == "complete", res.reason
    assert res.source_tiers[BAD] == "L3" and res.fallbacks[0]["chunk"] == BAD
    assert dest.chunk_bytes(BAD) == synthetic_chunk(LAYOUT, 7, BAD).tobytes()


def test_engine_open_refuses_special_files(tmp_path):
    engine = Engine(1, 4096)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    errors = []

    def try_open():
        try:
            engine.open(fifo)  # would block for a writer without O_NONBLOCK
        except OSError as exc:
            errors.append(exc)

    t = threading.Thread(target=try_open, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "engine.open blocks on a FIFO"
    assert errors and "not a regular file" in str(errors[0])
    with pytest.raises(OSError) as exc:
        engine.open(tmp_path)
    assert exc.value.errno == errno.EISDIR
    engine.open(fifo, special=True).close()  # asked for: a FIFO is allowed


class _RepublishBeforeInvalidate:
    """Tier double: another process republishes a good record at the path after a read
    of the old one failed and before the window invalidates it (the race in defect 5).
    Everything else is the real tier."""

    def __init__(self, inner, republish):
        self.inner, self.republish = inner, republish

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def invalidate(self, key, reason, **kw):
        self.republish(key)
        return self.inner.invalidate(key, reason, **kw)


@pytest.mark.parametrize("damage", ["payload", "truncate"])
def test_invalidation_spares_a_record_republished_meanwhile(tmp_path, damage):
    engine = Engine(2, LAYOUT.chunk_bytes)
    store = open_store(engine, tmp_path / "l2", layout=LAYOUT, lower_dir=tmp_path / "l3")
    l2, l3 = store.tier("L2"), store.tier("L3")
    tokens, keys = fill_state(l2, LAYOUT, CHUNKS * 16, seed=7, model="m")
    fill_state(l3, LAYOUT, CHUNKS * 16, seed=7, model="m")
    path = l2.path_of(keys[BAD])
    racing = Store([_RepublishBeforeInvalidate(l2, lambda key: republish(key)), l3])
    r = Restorer(racing, LAYOUT, window=2, engine=engine, model="m")
    plan = r.probe(tokens)
    assert plan.source_names()[BAD] == "L2"
    # Real damage on disk after discovery: a flipped payload byte, or a torn tail.
    raw = bytearray(path.read_bytes())
    if damage == "payload":
        raw[HEADER_BYTES + 10] ^= 0xFF
    else:
        raw = raw[: HEADER_BYTES + 100]
    path.write_bytes(raw)
    # The other process writes through its own tier object on the same directory.
    other = SSDTier(tmp_path / "l2", None, Engine(1, LAYOUT.chunk_bytes), layout=LAYOUT)
    fresh = []

    def republish(key):
        if key == keys[BAD] and not fresh:
            if path.exists():
                path.unlink()  # the writer replaces whatever is there
            assert other.write(key, synthetic_chunk(LAYOUT, 7, BAD), LAYOUT)
            fresh.append(os.stat(path).st_ino)

    dest = PagedKVCache.allocate(LAYOUT, CHUNKS * 16)
    res = r.restore(plan, dest)
    assert res.outcome == "complete", res.reason
    assert res.source_tiers[BAD] == "L3"
    assert fresh, "the failed read never reached invalidation"
    # The fresh record is where it was published, and only the damaged one is aside.
    assert path.exists(), "the record republished meanwhile was quarantined"
    assert os.stat(path).st_ino == fresh[0]
    assert len(l2.quarantined_files()) == 1
    plain = Restorer(store, LAYOUT, window=2, engine=engine, model="m")
    plan = plain.probe(tokens)
    assert plan.source_names() == ["L2"] * CHUNKS  # the fresh record is advertised
    dest = PagedKVCache.allocate(LAYOUT, CHUNKS * 16)
    assert plain.restore(plan, dest).complete
    assert dest.chunk_bytes(BAD) == synthetic_chunk(LAYOUT, 7, BAD).tobytes()


def test_memory_invalidation_spares_an_entry_written_meanwhile(tmp_path):
    """L1 honours the record identity too: the failing read's entry is dropped, a good
    copy written at the same key between the failure and the window's invalidation
    (a save of the same prefix, a promotion) stays and is served next time."""
    engine = Engine(2, LAYOUT.chunk_bytes)
    l1 = MemoryTier(64 * LAYOUT.chunk_bytes, layout=LAYOUT)
    l3 = LowerTier(tmp_path / "l3", None, layout=LAYOUT)
    tokens, keys = fill_state(l1, LAYOUT, CHUNKS * 16, seed=7, model="m")
    fill_state(l3, LAYOUT, CHUNKS * 16, seed=7, model="m")
    fresh = []

    def republish(key):
        if key == keys[BAD] and not fresh:
            assert l1.write(key, synthetic_chunk(LAYOUT, 7, BAD), LAYOUT)
            fresh.append(l1._entries[key])

    racing = Store([_RepublishBeforeInvalidate(l1, republish), l3])
    r = Restorer(racing, LAYOUT, window=2, engine=engine, model="m")
    plan = r.probe(tokens)
    assert plan.source_names()[BAD] == "L1"
    with l1._lock:  # real damage to the private copy after discovery (a stray write)
        l1._entries[keys[BAD]].data[10] ^= 0xFF
    dest = PagedKVCache.allocate(LAYOUT, CHUNKS * 16)
    res = r.restore(plan, dest)
    assert res.outcome == "complete", res.reason
    assert res.source_tiers[BAD] == "L3"
    assert fresh, "the failed read never reached invalidation"
    assert l1.contains(keys[BAD]), "the entry written meanwhile was dropped"
    assert l1._entries[keys[BAD]] is fresh[0]
    assert l1.stats()["quarantined"] == 1  # the damaged entry, once
    plain = Restorer(Store([l1, l3]), LAYOUT, window=2, engine=engine, model="m")
    plan = plain.probe(tokens)
    assert plan.source_names() == ["L1"] * CHUNKS  # the fresh entry is advertised
    dest = PagedKVCache.allocate(LAYOUT, CHUNKS * 16)
    assert plain.restore(plan, dest).complete
    assert dest.chunk_bytes(BAD) == synthetic_chunk(LAYOUT, 7, BAD).tobytes()


def test_quarantine_puts_back_a_record_that_replaced_the_bad_one(tmp_path):
    """The last step of exact invalidation: a record renamed in between the identity
    check and the move is put back (never left in quarantine)."""
    engine = Engine(1, LAYOUT.chunk_bytes)
    l2 = SSDTier(tmp_path / "l2", None, engine, layout=LAYOUT)
    _, keys = fill_state(l2, LAYOUT, 2 * 16, seed=7, model="m")
    path = l2.path_of(keys[0])
    from bsr_io.tiers.files import RecordId

    old = RecordId.of(os.stat(path))
    good = path.with_name("good")
    shutil.copy2(path, good)
    os.rename(good, path)  # a new inode at the same path
    l2.invalidate(keys[0], "test", record=old)
    assert path.exists() and l2.quarantined_files() == []
    assert l2.contains(keys[0])


# -- links: never followed, also when one is swapped in between probe and read ------------
def _swap_in_link(path, to):
    os.unlink(path)
    os.symlink(to, path)


def test_engine_open_never_follows_a_link(tmp_path, backend):
    engine = Engine(1, 4096, backend=backend)
    target = tmp_path / "target"
    target.write_bytes(bytes(8192))
    link = tmp_path / "link"
    link.symlink_to(target)
    for kw in ({}, {"write": True}, {"create": True}):
        with pytest.raises(OSError) as exc:
            engine.open(link, **kw)
        assert exc.value.errno == errno.ELOOP and "symbolic link" in str(exc.value)
    engine.open(target).close()  # control: the file itself opens
    engine.close()


@pytest.mark.parametrize("to", ["valid record", "outside file", "directory"])
def test_a_link_swapped_in_after_the_probe_is_never_read(tmp_path, backend, to):
    """After the probe saw a regular file, the record's path becomes a link: to a valid
    record of the same key kept elsewhere, to a file outside the store, to a directory.
    The read refuses it: the chunk comes from the lower copy (with one), or the restore
    ends zero (without), on every backend; the link's target is never what is restored."""
    engine = Engine(2, LAYOUT.chunk_bytes, backend=backend)
    store = open_store(engine, tmp_path / "l2", layout=LAYOUT, lower_dir=tmp_path / "l3")
    tokens, keys = fill_state(store.tier("L2"), LAYOUT, CHUNKS * 16, seed=7, model="m")
    fill_state(store.tier("L3"), LAYOUT, CHUNKS * 16, seed=7, model="m")
    path = store.tier("L2").path_of(keys[BAD])
    target = {
        "valid record": tmp_path / "kept.chunk",
        "outside file": tmp_path / "passwd",
        "directory": tmp_path / "somewhere",
    }[to]
    if to == "valid record":
        shutil.copyfile(path, target)  # the same key's record, but out of the store
    elif to == "outside file":
        target.write_bytes(b"root:x:0:0:root:/root:/bin/bash\n" * 200)
    else:
        target.mkdir()
    r = Restorer(store, LAYOUT, window=2, engine=engine, model="m", timeout_s=5)
    plan = r.probe(tokens)
    assert plan.hit_chunks == CHUNKS
    _swap_in_link(path, target)
    dest = PagedKVCache.allocate(LAYOUT, CHUNKS * 16)
    res = _restore_in_thread(r, plan, dest)
    assert res.outcome == "complete", res.reason
    assert res.source_tiers[BAD] == "L3" and res.fallbacks[0]["chunk"] == BAD
    assert "symbolic link" in str(res.fallbacks[0]), res.fallbacks
    assert dest.chunk_bytes(BAD) == synthetic_chunk(LAYOUT, 7, BAD).tobytes()
    # Without a lower copy the same swap ends the restore zero.
    l2 = SSDTier(tmp_path / "l2", None, engine, layout=LAYOUT)
    alone = Restorer(Store([l2]), LAYOUT, window=2, engine=engine, model="m", timeout_s=5)
    plan = alone.probe(tokens)
    assert plan.hit_chunks == BAD  # chunk BAD's link was withdrawn by the first restore
    _swap_in_link(l2.path_of(keys[BAD - 1]), target)
    res = _restore_in_thread(alone, plan, PagedKVCache.allocate(LAYOUT, CHUNKS * 16))
    assert res.outcome == "zero" and f"chunk {BAD - 1}" in res.reason, res.reason
    assert target.exists()  # never moved or removed: it is not the store's
    store.close()
    engine.close()


@pytest.mark.parametrize("to", ["outside the store", "inside the store"])
def test_a_directory_swapped_for_a_link_after_the_probe_is_never_read(tmp_path, backend, to):
    """After the probe, the records' directory (chunks/<namespace>) is moved away and a
    link to it put in its place: to a directory outside the store, or to another one
    inside the store; either way it still holds every record, valid and of the same key.
    The engine resolves record paths below the store root with no link in any component
    (openat2 RESOLVE_NO_SYMLINKS, or its directory walk): every chunk comes from the
    lower copy (with one), or the restore ends zero (without); nothing read through the
    link is committed. Only the final component was checked before, so every chunk came
    from L2 through the link."""
    engine = Engine(2, LAYOUT.chunk_bytes, backend=backend)
    store = open_store(engine, tmp_path / "l2", layout=LAYOUT, lower_dir=tmp_path / "l3")
    tokens, keys = fill_state(store.tier("L2"), LAYOUT, CHUNKS * 16, seed=7, model="m")
    fill_state(store.tier("L3"), LAYOUT, CHUNKS * 16, seed=7, model="m")
    records = store.tier("L2").path_of(keys[0]).parent
    assert all(store.tier("L2").path_of(k).parent == records for k in keys)
    moved = {
        "outside the store": tmp_path / "elsewhere",
        "inside the store": tmp_path / "l2" / "elsewhere",
    }[to]
    r = Restorer(store, LAYOUT, window=2, engine=engine, model="m", timeout_s=5)
    plan = r.probe(tokens)
    assert plan.hit_chunks == CHUNKS
    os.rename(records, moved)
    os.symlink(moved, records)
    dest = PagedKVCache.allocate(LAYOUT, CHUNKS * 16)
    res = _restore_in_thread(r, plan, dest)
    assert res.outcome == "complete", res.reason
    assert res.source_tiers == ["L3"] * CHUNKS, res.source_tiers
    assert "symbolic link" in str(res.fallbacks[0]), res.fallbacks
    assert all(dest.chunk_bytes(i) == synthetic_chunk(LAYOUT, 7, i).tobytes() for i in (0, 5))
    # Without a lower copy: a probe while the link is there finds nothing (the listing's
    # rules: no link below chunks/); one made before the swap, the restore ends zero.
    alone = Restorer(Store([store.tier("L2")]), LAYOUT, window=2, engine=engine, model="m")
    assert alone.probe(tokens).hit_chunks == 0
    os.unlink(records)
    os.rename(moved, records)
    plan = alone.probe(tokens)
    assert plan.hit_chunks == CHUNKS
    os.rename(records, moved)
    os.symlink(moved, records)
    res = _restore_in_thread(alone, plan, PagedKVCache.allocate(LAYOUT, CHUNKS * 16))
    assert res.outcome == "zero" and res.committed_chunks == 0, res
    assert "symbolic link" in res.reason, res.reason
    assert len(list(moved.iterdir())) == CHUNKS  # nothing withdrawn: it proves nothing
    store.close()
    engine.close()
