"""bsr-io: Bounded-State Restoration of long LLM KV-cache prefixes.

Restores prefixes of any size from SSD and lower tiers into a KV cache through a
fixed window of W staging slots, and commits them all-or-nothing across
allocator groups and tensor-parallel ranks.
"""

from bsr_io._core import (
    AlignmentError,
    BackendUnavailable,
    BsrIoError,
    Engine,
    EngineClosedError,
    File,
    FileMissingError,
    FilePermissionError,
    NoFreeSlot,
    NoSpaceError,
    Pending,
    ShortReadError,
    Slot,
    dio_alignment,
    xxh3_64,
)
from bsr_io.engine import as_numpy, as_tensor, register_cuda, unregister_cuda

__version__ = "0.1.0"

__all__ = [
    "AlignmentError",
    "BackendUnavailable",
    "BsrIoError",
    "Engine",
    "EngineClosedError",
    "File",
    "FileMissingError",
    "FilePermissionError",
    "NoFreeSlot",
    "NoSpaceError",
    "Pending",
    "ShortReadError",
    "Slot",
    "__version__",
    "as_numpy",
    "as_tensor",
    "dio_alignment",
    "register_cuda",
    "unregister_cuda",
    "xxh3_64",
]

# Chunk store: keys, layouts, records, tiers.
from bsr_io.errors import (  # noqa: E402
    CapacityError,
    ChunkCorrupt,
    ChunkError,
    ChunkMissing,
    ChunkReadError,
    ChunkWriteError,
    EngineBusy,
    LayoutError,
    TierDown,
)
from bsr_io.keys import ChunkKey, chunk_keys, prefix_hashes  # noqa: E402
from bsr_io.layout import AllocatorGroup, KVLayout, preset  # noqa: E402
from bsr_io.store import Store, fill_state, open_store, synthetic_chunk  # noqa: E402
from bsr_io.tiers import LowerTier, MemoryTier, SSDTier, Tier  # noqa: E402

__all__ += [
    "AllocatorGroup",
    "CapacityError",
    "ChunkCorrupt",
    "ChunkError",
    "ChunkKey",
    "ChunkMissing",
    "ChunkReadError",
    "ChunkWriteError",
    "EngineBusy",
    "KVLayout",
    "LayoutError",
    "LowerTier",
    "MemoryTier",
    "SSDTier",
    "Store",
    "Tier",
    "TierDown",
    "chunk_keys",
    "fill_state",
    "open_store",
    "prefix_hashes",
    "preset",
    "synthetic_chunk",
]

# Restoration: discovery, windowed install, commit, the whole-plan baseline.
from bsr_io.commit import Agreement  # noqa: E402
from bsr_io.discovery import Plan  # noqa: E402
from bsr_io.kvcache import Destination, PagedKVCache  # noqa: E402
from bsr_io.metrics import RestoreMetrics  # noqa: E402
from bsr_io.restore import Restorer, RestoreResult  # noqa: E402
from bsr_io.whole_plan import WholePlanRestorer  # noqa: E402

__all__ += [
    "Agreement",
    "Destination",
    "PagedKVCache",
    "Plan",
    "RestoreMetrics",
    "RestoreResult",
    "Restorer",
    "WholePlanRestorer",
]
