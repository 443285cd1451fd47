"""The group commit of directory fsyncs after a record's rename (tiers/files/publish.py).

A caller may return only once an fsync of its directory that began after its rename
has succeeded. The fsync is a fault double here (it counts its calls, can be held until
the test releases it, can fail): the directory and the threads are real.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from bsr_io.tiers.files import publish
from bsr_io.tiers.files.publish import DirSyncs


class HeldFsync:
    """A directory fsync that counts its calls; the first one blocks until `release()`
    and then raises `first_error` if one is set (fault double)."""

    def __init__(self, first_error: OSError | None = None) -> None:
        self.calls = 0
        self.started = threading.Event()
        self._go = threading.Event()
        self._error = first_error
        self._lock = threading.Lock()

    def __call__(self, path: Path) -> None:
        with self._lock:
            self.calls += 1
            first = self.calls == 1
        if first:
            self.started.set()
            self._go.wait(10)
            if self._error is not None:
                raise self._error

    def release(self) -> None:
        self._go.set()


def _call(syncs: DirSyncs, path: Path, out: list[BaseException | None]) -> threading.Thread:
    def run() -> None:
        try:
            syncs.sync(path)
            out.append(None)
        except BaseException as exc:  # noqa: BLE001 - what the caller got
            out.append(exc)

    t = threading.Thread(target=run)
    t.start()
    return t


def _waiting(t: threading.Thread) -> bool:
    time.sleep(0.2)
    return t.is_alive()


def test_renames_during_an_fsync_share_the_next_one(tmp_path, monkeypatch):
    fsync = HeldFsync()
    monkeypatch.setattr(publish, "fsync_dir", fsync)
    syncs = DirSyncs()
    out: list[BaseException | None] = []
    first = _call(syncs, tmp_path, out)
    assert fsync.started.wait(5)
    # Renamed after the first fsync began: it cannot cover them; they wait for the next.
    later = [_call(syncs, tmp_path, out) for _ in range(3)]
    assert all(_waiting(t) for t in later)
    fsync.release()
    for t in [first, *later]:
        t.join(5)
    assert out == [None] * 4
    assert fsync.calls == 2  # the held one, and one for the three that came during it


def test_callers_one_after_another_each_get_an_fsync(tmp_path, monkeypatch):
    """Control: with no fsync running when a caller comes, it runs its own."""
    calls: list[Path] = []
    monkeypatch.setattr(publish, "fsync_dir", calls.append)
    syncs = DirSyncs()
    for _ in range(4):
        syncs.sync(tmp_path)
    assert len(calls) == 4


def test_a_failed_fsync_covers_nobody(tmp_path, monkeypatch):
    """Its caller gets the error; the callers waiting on it run one of their own."""
    fsync = HeldFsync(first_error=OSError(5, "injected EIO"))
    monkeypatch.setattr(publish, "fsync_dir", fsync)
    syncs = DirSyncs()
    out: list[BaseException | None] = []
    first = _call(syncs, tmp_path, out)
    assert fsync.started.wait(5)
    later = [_call(syncs, tmp_path, out) for _ in range(2)]
    assert all(_waiting(t) for t in later)
    fsync.release()
    for t in [first, *later]:
        t.join(5)
    errors = [e for e in out if e is not None]
    assert len(errors) == 1 and "injected EIO" in str(errors[0])
    assert out.count(None) == 2
    assert fsync.calls == 2  # the failed one, then one that covers both waiters


def test_directories_do_not_share_fsyncs(tmp_path, monkeypatch):
    fsync = HeldFsync()
    monkeypatch.setattr(publish, "fsync_dir", fsync)
    syncs = DirSyncs()
    out: list[BaseException | None] = []
    first = _call(syncs, tmp_path / "a", out)
    assert fsync.started.wait(5)
    other = _call(syncs, tmp_path / "b", out)
    other.join(5)  # not held behind a's fsync: it ran its own
    assert not other.is_alive() and fsync.calls == 2
    fsync.release()
    first.join(5)
    assert out == [None, None]
