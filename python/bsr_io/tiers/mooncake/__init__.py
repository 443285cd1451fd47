"""The Mooncake Store pool as a tier (L3): the tier (`tier`), its config (`config`), the
pool of threads its client calls run on with their deadlines (`calls`) and the memory it
has registered with the pool (`memory`).

Importing it does not import Mooncake, so a connector can read its config (and report a
bad one) before the optional package is needed.
"""

from bsr_io.tiers.mooncake.calls import CallTimeout, code_name, lower_thread_priority
from bsr_io.tiers.mooncake.config import EXTRA_PREFIX, IO_PRIORITIES, MooncakeConfig
from bsr_io.tiers.mooncake.tier import MooncakeTier, open_client

__all__ = [
    "EXTRA_PREFIX",
    "IO_PRIORITIES",
    "CallTimeout",
    "MooncakeConfig",
    "MooncakeTier",
    "code_name",
    "lower_thread_priority",
    "open_client",
]
