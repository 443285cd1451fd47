"""A v2 batch whose read of one pool's record the kernel holds past the deadline: the
batch ends every pool's prefix at that page, and never hands SGLang a page of any pool
the kernel may still write.

A real kernel stall (tests/fuse_stall.py) on the C4 indexer's record of page 1, in a
batch of DeepSeek-V4's KV-derived pools (hybrid_stall_worker.py says how it is built and
why in a process of its own). Without the hold, `batch_get_v2` answered at the deadline;
SGLang frees the false pages and reuses them while the given-up O_DIRECT read still
lands in the indexer's page 1.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

NAMES = ["deepseek_v4_c4", "deepseek_v4_c4_indexer", "deepseek_v4_c128"]


def test_a_stalled_read_in_a_v2_batch_cuts_every_pool_and_holds_its_pages(
    run_stall_worker: Callable[[str], dict[str, Any]],
) -> None:
    facts = run_stall_worker("hybrid_stall_worker.py")
    assert facts["aligned"], facts  # else no direct read: the case would not be this one
    # While the kernel holds the indexer's page 1, the batch has not answered and the
    # backend reports no hit, so no new load starts.
    assert facts["held_by_backend"], facts
    assert facts["exists_while_held"] == 0, facts
    assert facts["direct_pages"] >= 1, facts
    # Then it answers: page 0 of every pool, never the indexer's page 1 alone.
    assert facts["got"] == dict.fromkeys(NAMES, [True, False, False, False]), facts
    assert all(facts["head_right"].values()), facts
    assert facts["returned"], facts
    # Every pool's reused pages hold what SGLang wrote there, never the late bytes.
    assert all(facts["reused_intact"].values()), facts
    assert not any(any(v) for v in facts["late_bytes_in_reused"].values()), facts
    # The page that stalled left the indexer's catalog: every pool's prefix ends there.
    assert facts["exists_after"] == 1, facts
