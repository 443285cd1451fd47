"""`bsr-io bench store` runs end to end on a small state, through the installed console
script (the command a user runs, so a broken entry point or import fails here), and
writes the ratios it exists to report."""

import json
import subprocess
import sys
from pathlib import Path

from bsr_io.model.layout import preset

RATIOS = (
    "write_ratio_store_vs_raw",
    "read_ratio_store_vs_raw",
    "write_read_ratio_store_vs_raw",
    "read_ratio_store_vs_fio",
    "read_ratio_store_vs_fio_hugemem",
)


def test_bench_store_small(tmp_path):
    exe = Path(sys.executable).with_name("bsr-io")  # the venv's console script
    assert exe.is_file(), f"{exe} is missing: install the package (scripts/install.sh)"
    out = tmp_path / "r.json"
    size = 3 * preset("deepseek-v4-flash").chunk_bytes  # 47 MiB
    argv = ["bench", "store", "--size", str(size), "--rounds", "1", "--window", "2"]
    argv += ["--dir", str(tmp_path), "--json", str(out)]
    proc = subprocess.run([exe, *argv], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["chunks"] == 3 and rep["size_bytes"] == size
    assert rep["verified_reads"] == 3  # every L2 read was checked
    for name in ("store", "raw"):
        assert rep["read_gib_s"][name] > 0 and rep["write_gib_s"][name] > 0
    for key in RATIOS[:3]:
        assert rep[key] > 0, key
    assert set(RATIOS) <= set(rep)  # the fio ratios are None only where fio could not run
    assert 0 < rep["open_close_us_per_chunk"] < rep["chunk_read_us"]
    # The reference is fio at its best (huge-page buffers) wherever it could run.
    if rep["read_ratio_store_vs_fio"] is not None:
        assert (rep["read_ratio_store_vs_fio_hugemem"] is None) == bool(rep["fio_hugemem_note"])
        # ... at the depth it read fastest at, of those it tried.
        scan = rep["fio_depth_scan_s"]
        assert len(scan) >= 2 and scan[str(rep["fio_depth"])] == min(scan.values())
    assert "ratio vs raw" in proc.stdout
    assert list(tmp_path.iterdir()) == [out]  # the store and raw file were removed
