"""The conformance cases (tests/conformance/cases.py) against SGLang's HiCache backend
with SGLang's own classes (sglang_host.py).

The stalled read runs in a process of its own with THP_MEM_ALLOC_ENABLE=1: torch reads
it at its first allocation, and with it SGLang's CPU host pool is page-aligned as a GPU
machine's pinned pool is, so the backend reads straight into its pages (O_DIRECT), the
path where a given-up read can write pages SGLang reused (stall_worker.py says more).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import sglang_host
from conformance.cases import Case, applying, check_table, run_case, run_child

HERE = str(Path(__file__).parent)
CHILD = [HERE, "sglang_host", "make"]
# The child finds SGLang's ninja (its page-key hash extension) where this venv keeps it.
CHILD_ENV = {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}


def test_every_case_says_whether_it_applies_to_sglang() -> None:
    check_table("sglang")


@pytest.mark.parametrize("case", applying("sglang"), ids=lambda c: c.name)
def test_case(case: Case, tmp_path: Path) -> None:
    if case.name == "stalled_read":
        env = {**CHILD_ENV, "THP_MEM_ALLOC_ENABLE": "1"}
        run_child(case.name, tmp_path, CHILD, env=env)
    elif case.child:
        run_child(case.name, tmp_path, CHILD, seccomp=case.name == "openat2_eperm", env=CHILD_ENV)
    else:
        run_case(case, sglang_host.make, tmp_path)
