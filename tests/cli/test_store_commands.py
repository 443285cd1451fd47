"""`bsr-io store fill|stats|verify` on real directories."""

import json
import shutil

import pytest

from bsr_io.cli import main
from bsr_io.cli.synthetic import synthetic_tokens
from bsr_io.model.keys import chunk_keys
from bsr_io.model.layout import preset
from bsr_io.model.record import HEADER_BYTES


def fill(tmp_path, capsys, *extra):
    assert (
        main(["store", "fill", str(tmp_path), "--layout", "tiny", "--tokens", "100", *extra]) == 0
    )
    out = capsys.readouterr().out.splitlines()
    return out[0], [line for line in out[1:] if line.endswith(".chunk")]


def test_fill_stats_verify(tmp_path, capsys):
    head, files = fill(tmp_path, capsys, "--seed", "11", "--rank", "1", "--world-size", "2")
    assert head.startswith("seed 11: 6 chunks")
    assert len(files) == 6 and all((tmp_path / f).exists() for f in files)
    keys = chunk_keys(synthetic_tokens(11, 100), preset("tiny"), "synthetic", 1, 2)
    assert sorted(files) == sorted(
        str(tmp_path / "chunks" / k.namespace() / f"{k.file_stem()}.chunk") for k in keys
    )
    assert main(["store", "stats", str(tmp_path), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["records"] == 6 and stats["namespaces"][0]["rank"] == 1
    assert stats["bytes"] == 6 * (HEADER_BYTES + preset("tiny").chunk_bytes)
    assert main(["store", "verify", str(tmp_path)]) == 0
    assert "6 records verified, 0 corrupt" in capsys.readouterr().out


def test_verify_reports_corrupt_records(tmp_path, capsys):
    _, files = fill(tmp_path, capsys)
    raw = bytearray(open(files[2], "rb").read())
    raw[HEADER_BYTES + 1] ^= 0x80
    open(files[2], "wb").write(raw)
    shutil.copyfile(files[4], files[3])  # a record under another key's name
    assert main(["store", "verify", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert out.count("CORRUPT") == 2
    assert files[2] in out and files[3] in out
    assert "checksum" in out and "another key" in out
    # The rest is sound, but what was found stays a failure until somebody looks.
    assert main(["store", "verify", str(tmp_path)]) == 1
    assert "4 records verified, 0 corrupt; 2 quarantined earlier" in capsys.readouterr().out
    for f in (tmp_path / "quarantine").iterdir():
        f.unlink()
    assert main(["store", "verify", str(tmp_path)]) == 0
    assert "4 records verified, 0 corrupt\n" in capsys.readouterr().out


def test_stats_moves_nothing_so_verify_still_sees_bad_headers(tmp_path, capsys):
    """A monitor running `stats` must not hide corruption from `verify` (issue 48): stats
    reports the bad headers, exits 1, and leaves every file where it was."""
    _, files = fill(tmp_path, capsys)
    for f in files[:2]:
        with open(f, "r+b") as fh:
            fh.write(b"XXXXXXXX")  # the magic
    before = sorted(p for p in tmp_path.rglob("*") if p.is_file())
    assert main(["store", "stats", str(tmp_path), "--json"]) == 1
    stats = json.loads(capsys.readouterr().out)
    assert stats["records"] == 4 and stats["quarantined"] == 0
    assert sorted(b["file"] for b in stats["bad"]) == sorted(files[:2])
    assert all("bad magic" in b["reason"] for b in stats["bad"])
    assert sorted(p for p in tmp_path.rglob("*") if p.is_file()) == before
    assert main(["store", "stats", str(tmp_path)]) == 1
    assert "2 bad (left in place" in capsys.readouterr().out
    assert main(["store", "verify", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert out.count("CORRUPT") == 2 and "4 records verified, 2 corrupt" in out


def test_bad_arguments(tmp_path, capsys):
    assert main(["store", "fill", str(tmp_path), "--layout", "tiny", "--tokens", "3"]) == 2
    assert "less than one chunk" in capsys.readouterr().err
    assert main(["store", "stats", str(tmp_path / "none")]) == 2
    assert "not a bsr-io store" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["store", "fill", str(tmp_path), "--layout", "nope", "--tokens", "100"])
