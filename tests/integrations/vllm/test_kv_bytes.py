"""Exactness by bytes, not tokens: after a restore, the request's KV blocks in vLLM's own
cache equal, byte for byte, the blocks that held the same tokens before they were
evicted (the lab's `kvbytes`, offline API, TP=1 and TP=2, the tiny Llama and the hybrid
tiny Gemma 3 with its two sliding-window groups and one full group).

Token equality alone cannot tell wrong KV from numerics: restored outputs were seen to
differ from a fresh run at bf16 near ties, as vLLM's own prefix hits do. So each rank's
blocks are copied when the computing request finishes (vLLM's worker, reached with
`collective_rpc`), the prefix cache reset and every KV cache tensor zeroed (a block the
restore did not write reads as zeros, and no copy compared is all zeros), the prompt
asked again, and every block of the restored prefix compared with its copy. Token
equality with the computing request stays as a second check.

The comparison can fail, and does, in the same run: prompt B's records of chunks 1 and 2
(one group) swap places on disk before its repeat (TEST DOUBLE, written again through
the tier's write path: valid checksums, so the load completes and installs each chunk at
the other's blocks). The comparison names exactly those chunks' blocks, on every rank.
Tokens alone miss it: in every run here (both models at TP=1 and TP=2) the 8 tokens after
the swap equal the computed ones (printed), while the bytes name the swapped blocks.
"""

from __future__ import annotations

import pytest
from engines import per_rank, run_harness

SWAPPED = (1, 2)  # kvbytes.SWAPPED


@pytest.fixture(
    scope="module",
    # TP=1 on the plain model, TP=2 on the hybrid one: both ranks' sliding-window and
    # full groups, at half the engine starts of every pair (each start is about a minute).
    params=[("llama", 1), ("gemma3", 2)],
    ids=["llama-tp1", "gemma3-tp2"],
)
def kv(request, vllm_root) -> dict:
    model, tp = request.param
    work = vllm_root / f"kvbytes-{model}-tp{tp}"
    work.mkdir()
    return run_harness("kvbytes", tp, work, timeout=1200, module="bsr_lab.vllm.kvbytes",
                       extra=("--model", model))  # fmt: skip


def _restored(kv: dict, name: str) -> None:
    tp, phase = kv["tp"], kv[name]
    loads = per_rank(phase["loads"], tp)
    assert all(e["outcome"] == "complete" for e in loads.values()), loads
    whole = kv["n_blocks"] * kv["block"]
    assert phase["computed"]["cached"] == 0 and phase["restored"]["cached"] == whole, phase


def test_restored_blocks_equal_the_evicted_ones_byte_for_byte(kv):
    _restored(kv, "A")
    a, groups = kv["A"], kv["groups"]
    for rank, cmp in enumerate(a["compare"]):
        assert cmp["differ"] == [] and cmp["missing"] == [] and cmp["zero_copies"] == [], cmp
        # Every group's restored blocks were compared: all of a full group's, the
        # window at the restore point of a sliding-window group's.
        assert cmp["groups"] == [g for g, _ in groups], (rank, cmp)
        assert cmp["blocks"] > 0 and cmp["bytes"] > 0
    assert a["restored"]["tokens"] == a["computed"]["tokens"]  # the second check


def test_two_chunks_swapped_on_disk_are_caught_by_the_bytes(kv):
    _restored(kv, "B")  # the swapped records verify: the load completes
    b, chunk, block = kv["B"], kv["chunk"], kv["block"]
    per_chunk = chunk // block
    want = sorted(
        [kv["swapped_group"], c * per_chunk + i] for c in SWAPPED for i in range(per_chunk)
    )
    assert kv["B_swapped"] == 2 * kv["tp"]
    for cmp in b["compare"]:
        assert cmp["missing"] == [] and sorted(cmp["differ"]) == want, cmp
    print(f"tokens after the swap equal the computed ones: "
          f"{b['restored']['tokens'] == b['computed']['tokens']}")  # fmt: skip
