"""bsr-io: Bounded-State Restoration of long LLM KV-cache prefixes.

Restores prefixes of any size from SSD and lower tiers into a KV cache through a
fixed window of W staging slots, and commits them all-or-nothing across
allocator groups and tensor-parallel ranks.
"""

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

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

# The chunk store (keys, layouts, records, tiers) and restoration (discovery, windowed
# install, commit) are imported on first use (PEP 562), not with the package: they
# import torch (3 s), which the operator's commands (`bsr-io --help`, `store stats`,
# `store verify`) never need. `from bsr_io import Restorer` works as before; type
# checkers read the imports below. (The whole-plan baseline and the synthetic data of
# tests and benchmarks are not part of the API.)
_LAZY: dict[str, str] = {
    "CapacityError": "bsr_io.errors",
    "ChunkCorrupt": "bsr_io.errors",
    "ChunkError": "bsr_io.errors",
    "ChunkMissing": "bsr_io.errors",
    "ChunkReadError": "bsr_io.errors",
    "ChunkWriteError": "bsr_io.errors",
    "DestinationUnusable": "bsr_io.errors",
    "EngineBusy": "bsr_io.errors",
    "LayoutError": "bsr_io.errors",
    "RecordFormatError": "bsr_io.errors",
    "TierDown": "bsr_io.errors",
    "ChunkKey": "bsr_io.model.keys",
    "chunk_keys": "bsr_io.model.keys",
    "extend_prefix_hashes": "bsr_io.model.keys",
    "prefix_hashes": "bsr_io.model.keys",
    "AllocatorGroup": "bsr_io.model.layout",
    "KVLayout": "bsr_io.model.layout",
    "preset": "bsr_io.model.layout",
    "Store": "bsr_io.store",
    "open_store": "bsr_io.store",
    "LowerTier": "bsr_io.tiers",
    "MemoryTier": "bsr_io.tiers",
    "SSDTier": "bsr_io.tiers",
    "Tier": "bsr_io.tiers",
    "Agreement": "bsr_io.commit",
    "Plan": "bsr_io.load.discovery",
    "Destination": "bsr_io.load.kvcache",
    "PagedKVCache": "bsr_io.load.kvcache",
    "RestoreMetrics": "bsr_io.metrics",
    "Restorer": "bsr_io.restore",
    "RestoreResult": "bsr_io.restore",
}
__all__ += sorted(_LAZY)

if TYPE_CHECKING:  # the names as type checkers see them (`X as X`: re-exported)
    from bsr_io.commit import Agreement as Agreement
    from bsr_io.errors import CapacityError as CapacityError
    from bsr_io.errors import ChunkCorrupt as ChunkCorrupt
    from bsr_io.errors import ChunkError as ChunkError
    from bsr_io.errors import ChunkMissing as ChunkMissing
    from bsr_io.errors import ChunkReadError as ChunkReadError
    from bsr_io.errors import ChunkWriteError as ChunkWriteError
    from bsr_io.errors import DestinationUnusable as DestinationUnusable
    from bsr_io.errors import EngineBusy as EngineBusy
    from bsr_io.errors import LayoutError as LayoutError
    from bsr_io.errors import RecordFormatError as RecordFormatError
    from bsr_io.errors import TierDown as TierDown
    from bsr_io.load.discovery import Plan as Plan
    from bsr_io.load.kvcache import Destination as Destination
    from bsr_io.load.kvcache import PagedKVCache as PagedKVCache
    from bsr_io.metrics import RestoreMetrics as RestoreMetrics
    from bsr_io.model.keys import ChunkKey as ChunkKey
    from bsr_io.model.keys import chunk_keys as chunk_keys
    from bsr_io.model.keys import extend_prefix_hashes as extend_prefix_hashes
    from bsr_io.model.keys import prefix_hashes as prefix_hashes
    from bsr_io.model.layout import AllocatorGroup as AllocatorGroup
    from bsr_io.model.layout import KVLayout as KVLayout
    from bsr_io.model.layout import preset as preset
    from bsr_io.restore import Restorer as Restorer
    from bsr_io.restore import RestoreResult as RestoreResult
    from bsr_io.store import Store as Store
    from bsr_io.store import open_store as open_store
    from bsr_io.tiers import LowerTier as LowerTier
    from bsr_io.tiers import MemoryTier as MemoryTier
    from bsr_io.tiers import SSDTier as SSDTier
    from bsr_io.tiers import Tier as Tier


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'bsr_io' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # imported once: later look-ups do not come back here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
