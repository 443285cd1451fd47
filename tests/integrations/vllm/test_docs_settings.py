"""docs/vllm.md's settings table is the connector's: every `kv_connector_extra_config`
key the connector reads is in it with its type and default, and every key it shows is
one the connector accepts, with the default it shows (config.py's `KEYS`, the table the
connector parses its settings with)."""

from __future__ import annotations

from pathlib import Path

import pytest
from docs_tables import Row, check_table, settings_rows

from bsr_io.integrations.vllm.config import KEYS

DOC = Path(__file__).resolve().parents[3] / "docs" / "vllm.md"


def test_the_table_is_the_connectors():
    check_table(KEYS, settings_rows(DOC, "## Settings"), {"store_dir": "/mnt/nvme/bsr"})


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (lambda rows: rows.pop("rescan_s"), "`rescan_s` \\(float\\) is not in the table"),
        (lambda rows: rows.update(window=Row("window", "int", 4, "")), "table's default 4"),
        (lambda rows: rows.update(window=Row("window", "float", 8, "")), "the table says 'float'"),
        (lambda rows: rows.update(windw=Row("windw", "int", 8, "")), "code knows no such key"),
    ],
)
def test_a_table_that_drifts_is_caught(change, why):
    rows = settings_rows(DOC, "## Settings")
    change(rows)
    with pytest.raises(AssertionError, match=why):
        check_table(KEYS, rows, {"store_dir": "/mnt/nvme/bsr"})
