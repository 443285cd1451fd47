"""The conformance cases (tests/conformance/cases.py) against the vLLM connector's
scheduler and worker pair, driven as vLLM drives them with no engine (vllm_host.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import vllm_host
from conformance.cases import Case, applying, check_table, run_case

CHILD = [str(Path(__file__).parent), "vllm_host", "make"]


def test_every_case_says_whether_it_applies_to_vllm() -> None:
    check_table("vllm")


@pytest.mark.parametrize("case", applying("vllm"), ids=lambda c: c.name)
def test_case(case: Case, tmp_path: Path) -> None:
    run_case(case, vllm_host.make, tmp_path, CHILD)
