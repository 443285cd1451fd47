"""The conformance cases (cases.py) against LMCache's engine with bsr-io's plugin
(lmcache_host.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conformance import lmcache_host
from conformance.cases import Case, applying, check_table, run_case

CHILD = [str(Path(lmcache_host.__file__).parent.parent), "conformance.lmcache_host", "make"]


def test_every_case_says_whether_it_applies_to_lmcache() -> None:
    check_table("lmcache")


@pytest.mark.parametrize("case", applying("lmcache"), ids=lambda c: c.name)
def test_case(case: Case, tmp_path: Path) -> None:
    run_case(case, lmcache_host.make, tmp_path, CHILD)
