"""Engine reads and writes on real O_DIRECT files, on every backend."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import numpy as np
import pytest

from bsr_io import (
    AlignmentError,
    Engine,
    ShortReadError,
    as_numpy,
    dio_alignment,
    xxh3_64,
)

MiB = 1 << 20


def make_file(path: Path, size: int, seed: int = 0) -> bytes:
    data = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()
    path.write_bytes(data)
    return data


def test_reports_backend_and_features(backend: str) -> None:
    with Engine(2, 3 * MiB + 1, backend=backend) as eng:
        assert eng.backend == ("pread" if backend == "pread" else "io_uring")
        feats = eng.features
        assert feats["backend"] == eng.backend
        assert feats["queue_depth"] == 32 and feats["request_bytes"] == MiB
        if backend == "io_uring_plain":
            assert not feats["fixed_buffers"] and not feats["registered_files"]
        for key in ("fixed_buffers", "registered_files", "mlock", "hugepages"):
            assert isinstance(feats[key], bool)
        assert isinstance(feats["notes"], str)
        assert eng.slot_bytes == 3 * MiB + 4096  # rounded up to the page
        assert eng.arena_bytes == 2 * eng.slot_bytes
        assert eng.arena_address % 4096 == 0


def test_fixed_buffers_where_allowed() -> None:
    # As root (or with enough memlock) the default io_uring path registers everything.
    eng = Engine(2, MiB, backend="io_uring")
    feats = eng.features
    if not feats["fixed_buffers"]:
        assert "fixed buffers" in feats["notes"]
    eng.close()


def test_env_selects_pread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BSR_IO_BACKEND", "pread")
    assert Engine(1, 4096).backend == "pread"
    monkeypatch.setenv("BSR_IO_BACKEND", "bogus")
    with pytest.raises(ValueError, match="unknown backend"):
        Engine(1, 4096)


@pytest.mark.parametrize("request_bytes", [64 * 1024, MiB])
def test_read_whole_file_in_slots(backend: str, tmp_path: Path, request_bytes: int) -> None:
    size = 5 * MiB + 12345  # unaligned tail
    data = make_file(tmp_path / "f", size)
    slot = 2 * MiB
    with Engine(3, slot, queue_depth=8, request_bytes=request_bytes, backend=backend) as eng:
        f = eng.open(tmp_path / "f")
        assert f.direct and f.size == size and not f.writable
        assert f.alignment in (512, 1024, 2048, 4096)
        got = bytearray()
        pendings = [eng.submit_read(f, off, min(slot, size - off)) for off in range(0, size, slot)]
        for p in pendings:
            s = p.wait()
            assert len(s) <= slot
            got += bytes(s)
            del s
        assert bytes(got) == data
        assert eng.live_bytes() == 0 and eng.free_slots() == 3
        assert eng.peak_bytes() == 3 * eng.slot_bytes


def test_tail_shorter_than_alignment(backend: str, tmp_path: Path) -> None:
    data = make_file(tmp_path / "tiny", 100)
    with Engine(1, 4096, backend=backend) as eng:
        f = eng.open(tmp_path / "tiny")
        s = eng.read(f, 0, 100)
        assert len(s) == 100 and bytes(s) == data


def test_short_read_raises_and_frees_slot(backend: str, tmp_path: Path) -> None:
    make_file(tmp_path / "f", 10_000)
    with Engine(2, MiB, backend=backend) as eng:
        f = eng.open(tmp_path / "f")
        with pytest.raises(ShortReadError) as exc:
            eng.read(f, 4096, 8192)
        assert exc.value.errno == errno.ENODATA
        assert "ended after 5904" in str(exc.value)
        assert exc.value.filename == str(tmp_path / "f")
        with pytest.raises(ShortReadError):
            eng.read(f, 1 << 20, 4096)  # wholly past the end
        assert eng.free_slots() == 2 and eng.live_bytes() == 0


def test_unaligned_offset(backend: str, tmp_path: Path) -> None:
    data = make_file(tmp_path / "f", 3 * 4096)
    with Engine(1, 4 * 4096, backend=backend) as eng:
        f = eng.open(tmp_path / "f")
        with pytest.raises(AlignmentError) as exc:
            eng.submit_read(f, 100, 4096)
        assert exc.value.errno == errno.EINVAL
        assert eng.free_slots() == 1
        # Buffered files take any offset.
        fb = eng.open(tmp_path / "f", direct=False)
        assert not fb.direct and fb.alignment == 1
        assert bytes(eng.read(fb, 100, 5000)) == data[100:5100]


def test_write_then_read_back(backend: str, tmp_path: Path) -> None:
    path = tmp_path / "out"
    with Engine(2, MiB, backend=backend) as eng:
        f = eng.open(path, create=True)
        assert f.writable and f.size == 0
        assert (os.stat(path).st_mode & 0o777) == 0o600
        payload = np.random.default_rng(1).integers(0, 256, MiB, dtype=np.uint8)
        slot = eng.lease()
        assert len(slot) == slot.capacity == MiB
        as_numpy(slot)[:] = payload
        assert eng.write(slot, f, 0) == MiB
        # An unaligned tail: padded for O_DIRECT, then trimmed back.
        slot.set_length(777)
        p = eng.submit_write(slot, f, MiB)
        assert p.wait() is slot and p.done()
        assert f.size == MiB + 777
        f.sync()
        on_disk = path.read_bytes()
        assert len(on_disk) == MiB + 777
        assert on_disk[:MiB] == payload.tobytes() and on_disk[MiB:] == payload[:777].tobytes()
        del slot
        s = eng.read(f, MiB, 777)
        assert bytes(s) == payload[:777].tobytes()


def test_padded_write_inside_file_keeps_later_bytes(backend: str, tmp_path: Path) -> None:
    data = make_file(tmp_path / "f", 4 * 4096)
    with Engine(1, 4 * 4096, backend=backend) as eng:
        f = eng.open(tmp_path / "f", write=True)
        slot = eng.lease()
        slot.fill_from(b"x" * 5000)
        eng.write(slot, f, 4096, 5000)
        on_disk = (tmp_path / "f").read_bytes()
        assert len(on_disk) == len(data)
        # O_DIRECT pads to whole blocks; the engine pads with what the file held there.
        assert on_disk[4096:9096] == b"x" * 5000
        assert on_disk[9096:] == data[9096:]
        assert on_disk[:4096] == data[:4096]


def test_checksum_matches_module_function(backend: str, tmp_path: Path) -> None:
    data = make_file(tmp_path / "f", 3 * 4096 + 5)
    with Engine(1, 4 * 4096, backend=backend) as eng:
        s = eng.read(eng.open(tmp_path / "f"), 0, len(data))
        assert s.checksum() == xxh3_64(data) == xxh3_64(np.frombuffer(data, np.uint8))
        assert s.checksum(10, 100) == xxh3_64(data[10:110])
        assert xxh3_64(b"") == 0x2D06800538D394C2
        assert xxh3_64(data) != xxh3_64(data[:-1])


def test_dio_alignment(tmp_path: Path) -> None:
    mem, off = dio_alignment(tmp_path)
    assert mem > 0 and off > 0 and (off & (off - 1)) == 0
    make_file(tmp_path / "f", 10)
    assert dio_alignment(tmp_path / "f")[1] == Engine(1, 4096).open(tmp_path / "f").alignment


def test_many_reads_in_flight_stress(backend: str, tmp_path: Path) -> None:
    """Window of 4 cycled over a file many times with reads kept in flight."""
    size = 8 * MiB
    data = make_file(tmp_path / "f", size)
    slot = 256 * 1024
    with Engine(4, slot, queue_depth=4, request_bytes=64 * 1024, backend=backend) as eng:
        f = eng.open(tmp_path / "f")
        offsets = list(range(0, size, slot)) * 2
        inflight = []
        for off in offsets:
            if len(inflight) == 4:
                o, p = inflight.pop(0)
                assert bytes(p.wait()) == data[o : o + slot]
            inflight.append((off, eng.submit_read(f, off, slot)))
        for o, p in inflight:
            assert bytes(p.wait()) == data[o : o + slot]
        assert eng.peak_bytes() == 4 * slot
        assert eng.live_bytes() == 0


def test_concurrent_submitters(backend: str, tmp_path: Path) -> None:
    size = 4 * MiB
    data = make_file(tmp_path / "f", size)
    errors: list[BaseException] = []
    with Engine(8, 128 * 1024, queue_depth=16, backend=backend) as eng:
        f = eng.open(tmp_path / "f")

        def reader(k: int) -> None:
            try:
                for i in range(k, size // (128 * 1024), 4):
                    off = i * 128 * 1024
                    s = eng.read(f, off, 128 * 1024)
                    assert bytes(s) == data[off : off + 128 * 1024]
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=reader, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors


def test_direct_refused_falls_back_to_buffered(backend: str) -> None:
    # procfs refuses O_DIRECT with EINVAL: the engine opens it buffered and says so.
    with Engine(1, 4096, backend=backend) as eng:
        f = eng.open("/proc/meminfo")
        assert not f.direct and f.alignment == 1
        assert bytes(eng.read(f, 0, 9)) == b"MemTotal:"
