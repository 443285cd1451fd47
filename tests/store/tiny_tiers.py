"""The tiny layout and tiers of it, shared by the store tests (the `engine` and `keys`
fixtures in tests/store/conftest.py are sized by this layout)."""

from bsr_io.model.layout import preset
from bsr_io.model.record import HEADER_BYTES
from bsr_io.tiers import LowerTier, MemoryTier, SSDTier

LAYOUT = preset("tiny")
REC = HEADER_BYTES + LAYOUT.chunk_bytes  # one record on disk: header and chunk


def tier_at(kind, root, engine, records=None, layout=None):
    """A tier of `kind` ("L1", "L2" or "L3") at `root` (L1 has none) with room for
    `records` records: None is no capacity on disk, 64 records in memory. With a `layout`,
    the tier refuses at construction a capacity below one of its records."""
    if kind == "L1":
        return MemoryTier(LAYOUT.chunk_bytes * (records or 64), layout=layout)
    capacity = REC * records if records else None
    if kind == "L2":
        return SSDTier(root, capacity, engine, layout=layout)
    return LowerTier(root, capacity, layout=layout)
