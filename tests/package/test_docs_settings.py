"""docs/sglang.md's settings table is the backend's: every key of the HiCache
extra_config that bsr-io reads is in it with its type and default, and every key it
shows is one the backend accepts with that default (config.py's `KEYS`, the table the
backend parses with; it imports no SGLang, so this runs in the main venv). The vLLM
guide's table has the same test in tests/integrations/vllm/test_docs_settings.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from docs_tables import Row, check_table, settings_rows

from bsr_io.integrations.sglang.config import KEYS

DOC = Path(__file__).resolve().parents[2] / "docs" / "sglang.md"
BASE = {"store_dir": "/mnt/nvme0/bsr-hicache"}


def test_the_table_is_the_backends():
    check_table(KEYS, settings_rows(DOC, "## Settings"), BASE)


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (lambda rows: rows.pop("queue_depth"), "`queue_depth` \\(int\\) is not in the table"),
        (lambda rows: rows.update(window=Row("window", "int", 8, "")), "table's default 8"),
        (lambda rows: rows.update(window=Row("window", "float", 32.0, "")), "says 'float'"),
        (lambda rows: rows.update(store_dir=Row("store_dir", "str", "/x", "")), "is required"),
        (lambda rows: rows.update(depth=Row("depth", "int", 8, "")), "code knows no such key"),
        (lambda rows: rows.update({"pool.*": Row("pool.*", "", None, "")}), "no prefix"),
    ],
)
def test_a_table_that_drifts_is_caught(change, why):
    rows = settings_rows(DOC, "## Settings")
    change(rows)
    with pytest.raises(AssertionError, match=why):
        check_table(KEYS, rows, BASE)
