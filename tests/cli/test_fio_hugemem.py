"""fio on huge-page buffers, the drive's real limit: reservation and restore of the huge
pages, the fallback when they cannot be had, and the benches that report both fio
configurations (ssd, ttft reading the record files themselves)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from bsr_io.cli import fio as fio_mod
from bsr_io.cli.fio import fio_available, fio_read_payloads, huge_page_buffers
from bsr_lab.cli import main

needs_fio = pytest.mark.skipif(not fio_available(), reason="fio is not installed")
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="huge pages are reserved as root")


def _hugetlbfs_mounts() -> list[str]:
    return [ln for ln in Path("/proc/mounts").read_text().splitlines() if " hugetlbfs " in ln]


@needs_root
def test_huge_pages_are_reserved_then_given_back():
    before = fio_mod.NR_HUGEPAGES.read_text()
    mounts = _hugetlbfs_mounts()
    with huge_page_buffers(8 << 20) as huge:
        if huge.mount is None:
            pytest.skip(f"huge pages unavailable here: {huge.note}")
        assert fio_mod._meminfo("HugePages_Free") >= 4
        assert huge.iomem("x").startswith(f"mmaphuge:{huge.mount}/")
    # The previous reservation and mounts are back, whatever the block did.
    assert fio_mod.NR_HUGEPAGES.read_text() == before
    assert _hugetlbfs_mounts() == mounts


def test_not_root_gives_a_reason_not_an_error(monkeypatch):
    # A test double for a non-root user: the reservation is refused, fio still runs.
    monkeypatch.setattr(fio_mod.os, "geteuid", lambda: 1000)
    with huge_page_buffers(8 << 20) as huge:
        assert huge.mount is None and huge.iomem("x") is None
        assert "root" in huge.note


@needs_fio
def test_bench_ssd_says_when_huge_pages_cannot_be_had(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(fio_mod.os, "geteuid", lambda: 1000)
    out = tmp_path / "ssd.json"
    argv = ["bench", "ssd", "--size", "8MiB", "--window", "2", "--slot", "1MiB", "--rounds", "1"]
    assert main([*argv, "--dir", str(tmp_path), "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert rep["results"]["fio_hugemem"]["gib_s"] is None
    assert "root" in rep["results"]["fio_hugemem"]["note"]
    assert rep["ratio_vs_fio_hugemem"] is None and rep["results"]["fio"]["gib_s"] > 0
    captured = capsys.readouterr()
    assert "fio on huge pages not run" in captured.err
    assert "ratio bsr_io/fio_hugemem: n/a" in captured.out


@needs_fio
@needs_root
def test_bench_ssd_reports_both_fio_configurations(tmp_path):
    out = tmp_path / "ssd.json"
    argv = ["bench", "ssd", "--size", "16MiB", "--window", "2", "--slot", "1MiB", "--rounds", "1"]
    assert main([*argv, "--dir", str(tmp_path), "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    if rep["results"]["fio_hugemem"]["gib_s"] is None:
        pytest.skip(rep["fio_hugemem_note"])
    huge = rep["results"]["fio_hugemem"]["gib_s"]
    assert huge > 0 and rep["results"]["fio"]["gib_s"] > 0
    assert "/tmp" not in json.dumps(rep)  # no absolute temporary paths in results


@needs_fio
def test_fio_reads_exactly_the_payload_ranges(tmp_path):
    # Three "records": a 4 KiB header, then a payload of 1 MiB + 12 KiB (a tail job).
    payload = (1 << 20) + 3 * 4096
    for i in range(3):
        (tmp_path / f"{i}.chunk").write_bytes(bytes([i]) * (4096 + payload))
    r = fio_read_payloads(tmp_path, payload_offset=4096, payload_bytes=payload, files=3)
    assert r.bytes_read == 3 * payload and r.seconds > 0
    r2 = fio_read_payloads(
        [tmp_path, tmp_path], payload_offset=4096, payload_bytes=payload, files=3
    )
    assert r2.bytes_read == 6 * payload
    # A payload size per directory (a hybrid set's pools): each read to its own length.
    small = tmp_path.parent / f"{tmp_path.name}-small"  # not below tmp_path: opendir recurses
    small.mkdir()
    for i in range(2):
        (small / f"{i}.chunk").write_bytes(bytes([i]) * (4096 + 8192))
    r3 = fio_read_payloads(
        [tmp_path, small], payload_offset=4096, payload_bytes=[payload, 8192], files=[3, 2]
    )
    assert r3.bytes_read == 3 * payload + 2 * 8192
    with pytest.raises(ValueError, match="payload sizes"):
        fio_read_payloads([tmp_path], payload_offset=4096, payload_bytes=[1, 2], files=3)
    with pytest.raises(ValueError, match="aligned"):
        fio_read_payloads(tmp_path, payload_offset=4096, payload_bytes=payload + 100, files=3)


@needs_fio
def test_ttft_fio_reads_the_records_and_the_control_splits_the_speedup(tmp_path):
    out = tmp_path / "ttft.json"
    # Two deepseek-v4-flash chunks: payloads are 4 KiB multiples, so fio reads the records.
    argv = ["bench", "ttft", "--tokens", "512", "--window", "2", "--rounds", "1", "--quiet"]
    assert main([*argv, "--dir", str(tmp_path), "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["fio_source"] == "record payloads" and doc["data_ok"]
    assert doc["per_round"]["fio"][0]["bytes_read"] == doc["state_bytes"]
    assert doc["naive_engine_s"] > 0
    assert doc["speedup_io_path"] * doc["speedup_bounded_staging"] == pytest.approx(doc["speedup"])
    if doc["fio_hugemem_s"] is None:
        assert doc["fio_hugemem_note"] and doc["fast_over_fio_hugemem"] is None
    else:
        assert doc["per_round"]["fio_hugemem"][0]["bytes_read"] == doc["state_bytes"]
        assert doc["fast_over_fio_hugemem"] == pytest.approx(doc["fast_s"] / doc["fio_hugemem_s"])
    assert "dir" not in doc and str(tmp_path) not in out.read_text()
