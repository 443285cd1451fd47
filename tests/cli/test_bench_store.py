"""`bsr-io bench store` runs end to end on a small state and reports what it measured."""

import json

from bsr_io.cli import main
from bsr_io.model.layout import preset


def test_bench_store_small(tmp_path, capsys):
    out = tmp_path / "r.json"
    size = 3 * preset("deepseek-v4-flash").chunk_bytes
    rc = main(
        [
            "bench",
            "store",
            "--size",
            str(size),
            "--rounds",
            "1",
            "--window",
            "2",
            "--dir",
            str(tmp_path),
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    rep = json.loads(out.read_text())
    assert rep["chunks"] == 3 and rep["size_bytes"] == size
    assert rep["verified_reads"] == 3  # every L2 read was checked
    for name in ("store", "raw"):
        assert rep["read_gib_s"][name] > 0 and rep["write_gib_s"][name] > 0
    assert 0 < rep["open_close_us_per_chunk"] < rep["chunk_read_us"]
    # The reference is fio at its best (huge-page buffers) wherever it could run.
    if rep["read_ratio_store_vs_fio"] is not None:
        assert (rep["read_ratio_store_vs_fio_hugemem"] is None) == bool(rep["fio_hugemem_note"])
    assert "ratio vs raw" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == [out]  # the store and raw file were removed
