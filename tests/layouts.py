"""Layouts that test folders share."""

import torch

from bsr_io.model.layout import AllocatorGroup, KVLayout

# Blocks of 4 KiB (16 tokens x 256 bytes), two groups: every run of a record is
# page-aligned, so an O_DIRECT read lands straight in a cache's blocks.
ALIGNED = KVLayout(
    "aligned",
    (
        AllocatorGroup("k", torch.float16, (128,), 16),
        AllocatorGroup("v", torch.float16, (2, 64), 16),
    ),
    64,
)
