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
