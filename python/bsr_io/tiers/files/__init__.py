"""Record files in a directory: the part L2 and L3 share.

records.py     names, identity (RecordId), opening a record file safely
listing.py     what a directory holds, by name: the one listing every component uses
fresh.py       views kept fresh by listing again, the process's own saves never undone
index.py       the per-process index (LRU, sizes) and the directory scan
publish.py     atomic publication: temp file, fdatasync, rename, fsync of the directory
capacity.py    room for a write: reservations and eviction of the oldest records
quarantine.py  moving the exact file that failed aside
tier.py        FileTier, which puts them together; SSDTier and LowerTier derive from it
"""

from bsr_io.tiers.files.index import STALE_TMP_S
from bsr_io.tiers.files.quarantine import Problem
from bsr_io.tiers.files.records import _HOST, SUFFIX, RecordId, open_record
from bsr_io.tiers.files.tier import FileTier

__all__ = ["STALE_TMP_S", "SUFFIX", "_HOST", "FileTier", "Problem", "RecordId", "open_record"]
