"""Which node each worker runs on, as `replicated: "auto"` decides by.

A group every TP rank holds the same bytes of (MLA) can be stored once, by rank 0, only
if every rank reads rank 0's directory: the same store directory on the same machine.
`parallel_config.nnodes` does not say so: an executor may span nodes while it stays 1.
So each worker names its node by its host, its boot and its store directory's device
and inode (two nodes of one machine with their own drives bound over the same path
differ too), the workers exchange these names at the connector's start, and each
reports its own in its handshake, from which the scheduler side decides alike.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from pathlib import Path

from bsr_io.tiers.files.records import mkdir_private

_BOOT_ID = "/proc/sys/kernel/random/boot_id"


def node_identity(store_dir: str) -> str:
    """This process's node as far as the store goes: host, boot, store directory."""
    try:
        with open(_BOOT_ID) as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    try:
        mkdir_private(Path(store_dir))  # the SSD tier makes it next, as here
        st = os.stat(store_dir)
        store = f"{st.st_dev}:{st.st_ino}"
    except OSError:
        store = "?"  # the SSD tier's start says why
    return f"{socket.gethostname()}/{boot}/{store}"


def spans_nodes(nnodes: int, nodes: Sequence[str]) -> bool:
    """Whether the engine's ranks are on more than one node: vLLM's `nnodes`, or the
    workers' own reports (`node_identity`) differing."""
    return nnodes > 1 or len(set(nodes)) > 1


def gather_nodes(identity: str, world_size: int) -> list[str]:
    """Every TP rank's `node_identity`, in rank order, over vLLM's TP group (its CPU
    group). Called in the worker connector's constructor, which every TP rank runs in
    step: vLLM broadcasts the engine id over the same group just before it."""
    if world_size <= 1:
        return [identity]
    import torch.distributed as dist
    from vllm.distributed.parallel_state import get_tp_group

    out: list[object] = [None] * world_size
    dist.all_gather_object(out, identity, group=get_tp_group().cpu_group)
    return [str(n) for n in out]
