"""The one scratch-directory policy (bsr_io.cli.scratch): on disk unless memory is
asked for, never the current directory, refused with the bytes needed when too small."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from bsr_io.cli import main, scratch
from bsr_io.cli.scratch import fs_type, make_scratch, scratch_base, scratch_dir
from bsr_lab.cli import main as lab_main

SHM = Path("/dev/shm")
needs_shm = pytest.mark.skipif(
    not SHM.is_dir() or fs_type(SHM) != "tmpfs", reason="no /dev/shm tmpfs"
)


def test_an_explicit_disk_dir_is_the_base_and_is_created(tmp_path):
    assert fs_type(tmp_path) not in scratch.MEMORY_FS  # the control: tmp_path is on disk
    base = tmp_path / "a" / "b"
    assert scratch_base(base) == base and base.is_dir()


@needs_shm
def test_tmpfs_only_when_asked(tmp_path):
    with pytest.raises(ValueError, match="in memory"):
        scratch_base(SHM)
    assert scratch_base(SHM, memory=True) == SHM
    assert scratch_base(None, memory=True) == SHM
    with pytest.raises(ValueError, match="not in memory"):
        scratch_base(tmp_path, memory=True)


@needs_shm
def test_temp_dirs_in_memory_are_skipped_and_never_the_cwd(tmp_path, monkeypatch):
    """$TMPDIR and the system temp dir on a tmpfs are passed over; with no disk
    candidate left the policy refuses rather than fall back to the current directory,
    although that one is writable and on disk here."""
    monkeypatch.setenv("TMPDIR", str(SHM))
    monkeypatch.setattr(tempfile, "tempdir", str(SHM))
    monkeypatch.chdir(tmp_path)
    disk = scratch_base(None)
    assert disk == Path(scratch.DISK_FALLBACKS[0]) and fs_type(disk) not in scratch.MEMORY_FS
    monkeypatch.setattr(scratch, "DISK_FALLBACKS", (str(SHM),))
    with pytest.raises(ValueError, match="no writable directory on disk.*pass --dir"):
        scratch_base(None)
    assert os.access(Path.cwd(), os.W_OK) and fs_type(Path.cwd()) not in scratch.MEMORY_FS


def test_no_room_names_the_bytes_needed(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    need = free + (1 << 40)
    with pytest.raises(ValueError, match=f"needs .*\\({need:,} bytes\\)"):
        make_scratch(tmp_path, "x-", need_bytes=need, what="the state")
    assert list(tmp_path.iterdir()) == []  # refused before anything is made
    root = make_scratch(tmp_path, "x-", need_bytes=1 << 20)  # control: room enough
    assert root.parent == tmp_path and root.name.startswith("x-")


def test_scratch_dir_is_removed_unless_kept(tmp_path):
    with scratch_dir(tmp_path, "gone-") as root:
        (root / "f").write_bytes(b"x")
    assert not root.exists()
    with scratch_dir(tmp_path, "kept-", keep=True) as root:
        pass
    assert root.is_dir()


def test_benches_refuse_a_dir_in_memory_and_the_cwd_is_untouched(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    if SHM.is_dir() and fs_type(SHM) == "tmpfs":
        for run, argv in (
            (lab_main, ["bench", "ssd", "--size", "1MiB"]),
            (main, ["bench", "store", "--size", "16MiB", "--layout", "tiny"]),
            (lab_main, ["bench", "sweep", "--layout", "tiny", "--tokens", "64"]),
        ):
            assert run([*argv, "--dir", str(SHM)]) == 2, argv
            assert "in memory" in capsys.readouterr().err
    assert lab_main(["bench", "paper", "--tokens", str(1 << 34), "--quiet"]) == 2
    assert "bytes) free in" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
