"""A view of one rank's records kept fresh by listing again (tiers/files/fresh.py).

The case it exists for: a rank that never writes (SGLang MLA at TP>1, where only the
storage-writer rank stores pages) must learn of records another process writes after
it started, within one re-listing interval, and a save or a drop the process itself
makes while a listing runs must not be undone by that listing. Records are written by
a real tier of another "process" (its own tier object and engine).
"""

from __future__ import annotations

import os
import time

import pytest

from bsr_io import Engine
from bsr_io.cli.synthetic import fill_state
from bsr_io.model.layout import preset
from bsr_io.tiers import SSDTier
from bsr_io.tiers.files import fresh
from bsr_io.tiers.files.fresh import NamespaceView, RecentChanges

LAYOUT = preset("tiny")


def _write(root, tokens_chunks: int, seed: int = 1):
    """Records written by another process's tier: (namespace, chunk hashes in order)."""
    with Engine(1, LAYOUT.chunk_bytes) as engine:
        tier = SSDTier(root, None, engine, layout=LAYOUT)
        _, keys = fill_state(tier, LAYOUT, tokens_chunks * LAYOUT.chunk_tokens, seed, 0, 2, "m")
    return keys[0].namespace(), [k.chunk_hash for k in keys]


def test_a_rank_that_does_not_write_sees_records_written_after_it_started(tmp_path):
    ns, first = _write(tmp_path, 2)
    view = NamespaceView([tmp_path / "chunks", tmp_path / "lower" / "chunks"], ns)
    assert view.leading(first) == 2
    _, later = _write(tmp_path, 4)  # the writer rank stores more pages of the prefix
    assert view.leading(later) == 2  # not yet listed
    view.start(0.01)
    try:
        limit = time.monotonic() + 30
        while view.refreshes < 2 and time.monotonic() < limit:
            time.sleep(0.01)
    finally:
        view.close()
    assert view.leading(later) == 4


def test_links_are_not_in_the_view(tmp_path):
    ns, hashes = _write(tmp_path, 2)
    ns_dir = tmp_path / "chunks" / ns
    (ns_dir / f"{0xABC:032x}.chunk").symlink_to(ns_dir / f"{hashes[0]:032x}.chunk")
    other = ns.replace("-w2r0", "-w2r1")
    (tmp_path / "chunks" / other).symlink_to(ns_dir, target_is_directory=True)
    assert NamespaceView([tmp_path / "chunks"], ns).hashes() == set(hashes)
    assert len(NamespaceView([tmp_path / "chunks"], other)) == 0


def test_a_save_or_a_drop_during_a_listing_is_not_undone_by_it(tmp_path, monkeypatch):
    """The listing reads the directory, then (before it is applied) the process saves
    one record and drops another that the listing found. The listing is held at that
    point by a wrapper around the module's `chunk_hashes` (a test double, to make the
    interleaving certain)."""
    ns, hashes = _write(tmp_path, 2)
    view = NamespaceView([tmp_path / "chunks"], ns)
    new = 0x123
    real = fresh.chunk_hashes

    def listing_then_changes(ns_dir):
        found = real(ns_dir)
        (ns_dir / f"{new:032x}.chunk").write_bytes(b"x")
        view.saved(new)
        view.forget(hashes[1])  # a failed load: its file was quarantined
        os.unlink(ns_dir / f"{hashes[1]:032x}.chunk")
        return found

    monkeypatch.setattr(fresh, "chunk_hashes", listing_then_changes)
    view.refresh()
    monkeypatch.undo()
    assert new in view and hashes[1] not in view and hashes[0] in view
    view.refresh()  # the next listing agrees
    assert view.hashes() == {hashes[0], new}


def test_a_pinned_record_stays_across_listings_until_forgotten(tmp_path):
    """A page written through to a pool is on no drive: listing again keeps it, a
    failed load (`forget`) drops it; an unpinned save the drive lacks goes."""
    ns, hashes = _write(tmp_path, 1)
    view = NamespaceView([tmp_path / "chunks"], ns)
    view.saved(0x77, pinned=True)
    view.saved(0x78)
    view.refresh()
    assert 0x77 in view and 0x78 not in view and hashes[0] in view
    view.forget(0x77)
    view.refresh()
    assert view.hashes() == set(hashes)


def test_overlapping_listings_each_keep_the_changes_made_since_they_began():
    changes = RecentChanges()
    a = changes.begin()
    changes.note("ns", 1, True)
    b = changes.begin()
    changes.note("ns", 2, True)
    found_b: dict[str, set[int]] = {}
    changes.end(b, found_b)
    assert found_b == {"ns": {2}}  # 1 was saved before b began: b's listing saw it
    found_a: dict[str, set[int]] = {}
    changes.end(a, found_a)
    assert found_a == {"ns": {1, 2}}
    changes.note("ns", 3, True)  # no listing running: nothing kept
    c = changes.begin()
    found_c: dict[str, set[int]] = {}
    changes.end(c, found_c)
    assert found_c == {}


def test_a_view_refuses_an_interval_that_is_not_a_positive_number(tmp_path):
    view = NamespaceView([tmp_path / "chunks"], "0" * 32 + "-" + "0" * 32 + "-w1r0")
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="interval_s"):
            view.start(bad)
