"""Tiers where chunk records live: L1 host memory, L2 local SSD (one drive, or striped
over several: `StripedSSDTier`), L3 lower tier or a
Mooncake Store pool (`MooncakeTier`; Mooncake itself is imported only when one is built)."""

from bsr_io.tiers.base import PendingChunk, Tier
from bsr_io.tiers.files import FileTier
from bsr_io.tiers.lower import LowerTier
from bsr_io.tiers.memory import MemoryTier
from bsr_io.tiers.mooncake import MooncakeConfig, MooncakeTier
from bsr_io.tiers.ssd import SSDTier
from bsr_io.tiers.striped import StripedSSDTier

__all__ = [
    "FileTier",
    "LowerTier",
    "MemoryTier",
    "MooncakeConfig",
    "MooncakeTier",
    "PendingChunk",
    "SSDTier",
    "StripedSSDTier",
    "Tier",
]
