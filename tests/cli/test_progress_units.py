"""Progress bars in bytes use the units the tables print (KiB, MiB, GiB), including the
bars that sum over ranks; tqdm's own scaling writes 'MB' and 'G'."""

from __future__ import annotations

import io

import pytest

from bsr_io.cli.progress import ProgressWatcher, RankProgress, binary_meter, byte_bar_class

MiB, GiB = 1 << 20, 1 << 30


def test_binary_meter_figures():
    assert binary_meter(1536 * MiB, 3 * GiB, 2.0, 768 * MiB) == (
        "1.50 GiB/3.00 GiB [00:02<00:02, 768.00 MiB/s]"
    )
    assert binary_meter(5 * MiB, None, 1.0, None) == "5.00 MiB [00:01, 5.00 MiB/s]"
    assert binary_meter(0, 10 * MiB, 0.0, None) == "0 B/10.00 MiB [00:00<?, ? B/s]"


def test_byte_bar_draws_binary_units():
    cls = byte_bar_class()
    if cls is None:
        pytest.skip("tqdm is not installed")
    b = cls(total=3 * GiB, desc="save", unit="B", file=io.StringIO())
    b.update(1536 * MiB)
    text = str(b)
    b.close()
    assert text.startswith("save:  50%|") and "| 1.50 GiB/3.00 GiB [" in text
    assert "GB" not in text and "MB" not in text and "1.61G" not in text
    # A bar counting something else keeps tqdm's plain counts.
    c = cls(total=10, desc="sweep", unit="state", file=io.StringIO())
    c.update(2)
    assert "2/10" in str(c)
    c.close()


def test_rank_bars_sum_in_binary_units(tmp_path, monkeypatch):
    cls = byte_bar_class()
    if cls is None:
        pytest.skip("tqdm is not installed")
    drawn: list[object] = []

    def fake_bar(total, desc, *, unit="B", **kw):
        b = cls(total=total, desc=desc, unit=unit, file=io.StringIO())
        drawn.append(b)
        return b

    monkeypatch.setattr("bsr_io.cli.progress.bar", fake_bar)
    a, b = RankProgress(tmp_path, 0), RankProgress(tmp_path, 1)
    a.phase("restore", 512 * MiB)
    b.phase("restore", 512 * MiB)
    a.advance(256 * MiB)
    b.advance(256 * MiB)
    a._write(force=True)  # advance() writes at most every 0.1 s
    b._write(force=True)
    w = ProgressWatcher(tmp_path, 2)
    w._read()
    w._draw()
    assert len(drawn) == 1
    assert "| 512.00 MiB/1.00 GiB [" in str(drawn[0])
