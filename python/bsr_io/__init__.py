"""bsr-io: Bounded-State Restoration of long LLM KV-cache prefixes.

Restores prefixes of any size from SSD and lower tiers into a KV cache through a
fixed window of W staging slots, and commits them all-or-nothing across
allocator groups and tensor-parallel ranks.
"""

from importlib.metadata import PackageNotFoundError, version

from bsr_io._core import (
    AlignmentError,
    BackendUnavailable,
    BsrError,
    BsrIoError,
    BsrTypeError,
    BsrValueError,
    Engine,
    EngineBrokenError,
    EngineClosedError,
    File,
    FileMissingError,
    FilePermissionError,
    KernelOwnedError,
    NoFreeSlot,
    NoMemoryError,
    NoSpaceError,
    Pending,
    ShortReadError,
    Slot,
    WaitTimeoutError,
    dio_alignment,
    xxh3_64,
)
from bsr_io.engine import as_numpy, as_tensor, register_cuda, unregister_cuda

try:
    __version__ = version("bsr-io")
except PackageNotFoundError:  # a source tree on sys.path, never installed
    __version__ = "0+unknown"

__all__ = [
    "AlignmentError",
    "BackendUnavailable",
    "BsrError",
    "BsrIoError",
    "BsrTypeError",
    "BsrValueError",
    "Engine",
    "EngineBrokenError",
    "EngineClosedError",
    "File",
    "FileMissingError",
    "FilePermissionError",
    "KernelOwnedError",
    "NoFreeSlot",
    "NoMemoryError",
    "NoSpaceError",
    "Pending",
    "ShortReadError",
    "Slot",
    "WaitTimeoutError",
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
    DestinationUnusable,
    EngineBusy,
    LayoutError,
    RecordFormatError,
    TierDown,
)
from bsr_io.model.keys import ChunkKey, chunk_keys, extend_prefix_hashes, prefix_hashes  # noqa: E402
from bsr_io.model.layout import AllocatorGroup, KVLayout, preset  # noqa: E402
from bsr_io.store import Store, open_store  # noqa: E402
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
    "DestinationUnusable",
    "EngineBusy",
    "KVLayout",
    "LayoutError",
    "LowerTier",
    "MemoryTier",
    "RecordFormatError",
    "SSDTier",
    "Store",
    "Tier",
    "TierDown",
    "chunk_keys",
    "open_store",
    "extend_prefix_hashes",
    "prefix_hashes",
    "preset",
]

# Restoration: discovery, windowed install, commit. (The whole-plan baseline and the
# synthetic data of tests and benchmarks are not part of the API.)
from bsr_io.commit import Agreement  # noqa: E402
from bsr_io.load.discovery import Plan  # noqa: E402
from bsr_io.load.kvcache import Destination, PagedKVCache  # noqa: E402
from bsr_io.metrics import RestoreMetrics  # noqa: E402
from bsr_io.restore import Restorer, RestoreResult  # noqa: E402

__all__ += [
    "Agreement",
    "Destination",
    "PagedKVCache",
    "Plan",
    "RestoreMetrics",
    "RestoreResult",
    "Restorer",
]
