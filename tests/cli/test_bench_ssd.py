"""`bsr-lab bench ssd` end to end at a small size, and the fio driver."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bsr_io.cli.fio import fio_available, fio_read
from bsr_lab.cli import main


def test_bench_ssd_small(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "ssd.json"
    argv = ["bench", "ssd", "--size", "8MiB", "--window", "2", "--slot", "1MiB"]
    argv += ["--dir", str(tmp_path), "--json", str(out), "--rounds", "1"]
    assert main(argv) == 0
    rep = json.loads(out.read_text())
    for key in ("backend", "cold_cache", "size_bytes", "window", "slot_bytes", "ratio_vs_fio"):
        assert key in rep
    assert rep["size_bytes"] == 8 << 20 and rep["window"] == 2 and rep["slot_bytes"] == 1 << 20
    assert rep["backend"] in ("io_uring", "pread")
    assert rep["results"]["bsr_io"]["gib_s"] > 0
    assert rep["results"]["buffered"]["gib_s"] > 0
    # The engine read the whole file through at most W slots.
    assert rep["rws_peak_bytes"] == 2 * (1 << 20)
    if fio_available():
        assert rep["results"]["fio"]["gib_s"] > 0
        assert rep["ratio_vs_fio"] > 0
    else:
        assert rep["ratio_vs_fio"] is None
    assert not list(tmp_path.glob("bsr-io-bench-ssd-*"))  # test file removed
    table = capsys.readouterr().out
    assert "ratio bsr_io/fio" in table and "RWS peak: 2.00 MiB" in table


def test_bench_ssd_rejects_bad_window(tmp_path: Path) -> None:
    assert main(["bench", "ssd", "--size", "1MiB", "--window", "0", "--dir", str(tmp_path)]) == 2


@pytest.mark.skipif(not fio_available(), reason="fio not installed")
def test_fio_read_reports_bandwidth(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"\1" * (4 << 20))
    r = fio_read(tmp_path / "f")
    assert r.bytes_read == 4 << 20 and r.gib_s > 0
    with pytest.raises(ValueError, match="empty"):
        (tmp_path / "e").write_bytes(b"")
        fio_read(tmp_path / "e")
