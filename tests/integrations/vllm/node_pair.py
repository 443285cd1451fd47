"""What the two-node tests (test_two_nodes.py, test_node_loss.py) set up alike: a
directory of their own with a tiny Llama, one `store_dir` path with each node's own drive
bound over it, the event log both nodes append to, and clusters of the two nodes."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from bsr_lab.vllm.harness import CHUNK_TOKENS, Events, write_tiny_llama
from bsr_lab.vllm.nodes import Cluster

Env = tuple[dict[str, str], dict[str, str]]  # node 0's, node 1's


@dataclass(frozen=True)
class NodePair:
    root: Path
    model: str
    store: Path
    disks: tuple[Path, Path]  # node 0's drive, node 1's
    events: Events

    def connector(self, **settings: Any) -> dict[str, Any]:
        """The connector's settings on both nodes: `settings` and those all these tests use."""
        return {
            "store_dir": str(self.store),  # the same path on both nodes, a different drive on each
            "window": 4,
            "chunk_tokens": CHUNK_TOKENS,
            **settings,
            "events_path": self.events.path,  # outside the store: both nodes append to it
        }

    def cluster(self, work: str, connector: dict[str, Any] | None, env: Env) -> Cluster:
        """The two nodes, their logs in `root/work` (made here)."""
        c = Cluster(self.model, self.root / work, self.store, self.disks, connector, env)
        c.work.mkdir()
        return c


def node_pair(vllm_root: Path, name: str) -> NodePair:
    """A pair set up in `vllm_root/name`, with empty drives."""
    if shutil.which("unshare") is None:
        pytest.fail("util-linux's unshare is needed to give each node its own drive")
    root = vllm_root / name
    root.mkdir()
    model = write_tiny_llama(root / "model")
    store, disks = root / "store", (root / "disk0", root / "disk1")
    for d in (store, *disks):
        d.mkdir()
    return NodePair(root, model, store, disks, Events(str(root / "events.jsonl")))
