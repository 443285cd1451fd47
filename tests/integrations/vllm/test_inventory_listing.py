"""The worker's inventory offers what the tier holds, by the store's one listing.

Real records written by a real SSD tier; beside them what an operator or another
process may put there: a link to a record under another record's name, a link in place
of another rank's directory (to this rank's real one), a directory and a FIFO named as
records. The inventory (start listing and re-listing) and its recheck after a failed
load must offer exactly the records the tier's own scan holds: a linked rank directory
offered to the scheduler side would fail every load it plans with ELOOP, be offered
again by the recheck, and never be withdrawn.

And a save that lands while the re-listing thread lists the drive is never reported
removed (it would be a miss on a record that exists for `rescan_s`).
"""

from __future__ import annotations

import os
from pathlib import Path

from bsr_io import Engine
from bsr_io.cli.synthetic import fill_state
from bsr_io.integrations.vllm import inventory as inventory_module
from bsr_io.integrations.vllm.inventory import StoreInventory
from bsr_io.model.layout import preset
from bsr_io.tiers import SSDTier

LAYOUT = preset("tiny")
RANKS = {"-w2r0", "-w2r1"}  # one worker that owns both key ranks' directories


def _store(root: Path) -> tuple[set[tuple[str, int]], Path, Path]:
    """Three records of rank 0 written by a real tier, and beside them four names no
    load can open: (what the tier holds, rank 0's directory, the linked rank 1 one)."""
    with Engine(1, LAYOUT.chunk_bytes) as engine:
        tier = SSDTier(root, None, engine, layout=LAYOUT)
        _, keys = fill_state(tier, LAYOUT, 3 * LAYOUT.chunk_tokens, 1, 0, 2, "m")
        ns_dir = tier.path_of(keys[0]).parent
        (ns_dir / f"{0xABC:032x}.chunk").symlink_to(tier.path_of(keys[0]))
        (ns_dir / f"{0xDEF:032x}.chunk").mkdir()
        os.mkfifo(ns_dir / f"{0xFED:032x}.chunk")
        linked = ns_dir.with_name(ns_dir.name.replace("-w2r0", "-w2r1"))
        linked.symlink_to(ns_dir, target_is_directory=True)
        held = {(k.namespace(), k.chunk_hash) for k in SSDTier(root, None, engine).keys()}
    assert len(held) == 3
    return held, ns_dir, linked


class Offered(set[tuple[str, int]]):
    """What the scheduler side has been offered: the reports applied in order."""

    def apply(self, inv: StoreInventory) -> Offered:
        report = inv.take(10**6)
        self.difference_update((ns, h) for ns, hs in report.removed.items() for h in hs)
        self.update((ns, h) for ns, hs in report.added.items() for h in hs)
        return self


def test_the_inventory_offers_exactly_what_the_tier_holds(tmp_path):
    held, _, _ = _store(tmp_path)
    inv = StoreInventory([tmp_path], RANKS)
    offered = Offered()
    assert offered.apply(inv) == held  # the start listing
    inv.relist()
    assert offered.apply(inv) == held  # and every re-listing


def test_a_linked_rank_directory_is_never_offered_again_after_a_failed_load(tmp_path):
    """The scheduler side drops a record after a failed load and asks the worker to
    recheck it: a record reached through a linked directory, or a linked record, is
    not reported again (a load would fail with ELOOP), a real one is."""
    held, ns_dir, linked = _store(tmp_path)
    inv = StoreInventory([tmp_path], RANKS)
    offered = Offered().apply(inv)
    real = sorted(h for _, h in held)
    for ns, hashes in ((linked.name, real), (ns_dir.name, [0xABC, 0xDEF, 0xFED, real[0]])):
        offered.difference_update((ns, h) for h in hashes)  # the scheduler side's drop
        inv.recheck(ns, hashes)
    assert offered.apply(inv) == held


def test_a_save_landing_while_the_drive_is_listed_is_not_reported_removed(tmp_path, monkeypatch):
    """The re-listing thread reads a directory; a save publishes a record there and the
    worker confirms it (`saved`); then the listing ends without it. The record exists:
    it must stay offered. The listing is held at that point by a wrapper around the
    module's listing function (a test double, to make the interleaving certain)."""
    held, ns_dir, _ = _store(tmp_path)
    inv = StoreInventory([tmp_path], RANKS)
    offered = Offered().apply(inv)
    new = 0x123
    real_list = inventory_module.list_records

    def listing_then_a_save(*args, **kwargs):
        listed = real_list(*args, **kwargs)  # read before the record was written
        (ns_dir / f"{new:032x}.chunk").write_bytes(b"x")
        inv.saved(ns_dir.name, new)
        return listed

    monkeypatch.setattr(inventory_module, "list_records", listing_then_a_save)
    inv.relist()
    monkeypatch.undo()
    assert offered.apply(inv) == held | {(ns_dir.name, new)}
    inv.relist()  # the next listing sees the file: still held, nothing queued
    assert inv.pending() == 0
