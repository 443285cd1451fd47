"""The conformance cases (cases.py) against the core `Restorer` API (core_host.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conformance import core_host
from conformance.cases import Case, applying, check_table, run_case

CHILD = [str(Path(core_host.__file__).parent.parent), "conformance.core_host", "make"]


def test_every_case_says_whether_it_applies_to_the_core() -> None:
    check_table("core")


@pytest.mark.parametrize("case", applying("core"), ids=lambda c: c.name)
def test_case(case: Case, tmp_path: Path) -> None:
    run_case(case, core_host.make, tmp_path, CHILD)
