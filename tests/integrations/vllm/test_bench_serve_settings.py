"""`bsr-lab bench serve --set KEY=VALUE`: the bsr-io server's connector settings, checked
as the connector checks them before any server starts."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from bsr_lab.bench import serve


def _args(*extra: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    serve.register(p.add_subparsers())
    return p.parse_args(["serve", *extra])


def test_settings_are_added_as_json_or_text(tmp_path: Path) -> None:
    args = _args("--set", "window=2", "--set", "save_gate_s=0", "--set", "io_cpus=inherit")
    got = serve.connector_settings(args, tmp_path / "store", tmp_path / "ev.jsonl")
    assert got["window"] == 2 and got["save_gate_s"] == 0 and got["io_cpus"] == "inherit"
    # The bench's own settings stay unless --set names them.
    assert got["chunk_tokens"] == 256 and got["save_in_steps"] is True
    assert got["store_dir"] == str(tmp_path / "store")
    # The finish save, the connector's other save mode, is one flag away.
    off = serve.connector_settings(_args("--no-save-in-steps"), tmp_path / "s", tmp_path / "e")
    assert off["save_in_steps"] is False


@pytest.mark.parametrize(
    ("item", "why"),
    [
        ("windw=2", "unknown kv_connector_extra_config keys"),
        ("window=0", "window"),
        ("save_in_steps=maybe", "save_in_steps"),
        ("window", "expected KEY=VALUE"),
        ("store_dir=/elsewhere", "the bench sets it"),
    ],
)
def test_a_bad_setting_is_refused_with_its_name(tmp_path: Path, item: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        serve.connector_settings(_args("--set", item), tmp_path / "s", tmp_path / "e")


def test_run_refuses_a_bad_setting_before_any_server(tmp_path: Path, capsys) -> None:
    args = _args("--set", "windw=2", "--dir", str(tmp_path), "--rounds", "1")
    assert serve.run(args) == 2
    assert "windw" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # no model written, no server started


@pytest.mark.parametrize("restarts", ["3", "-1"])
def test_run_refuses_restarts_that_leave_an_epoch_without_rounds(
    tmp_path: Path, capsys, restarts: str
) -> None:
    args = _args("--restarts", restarts, "--rounds", "3", "--dir", str(tmp_path))
    assert serve.run(args) == 2
    assert "--restarts" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_rounds_split_into_epochs_as_evenly_as_they_go() -> None:
    assert serve.round_epochs(9, 2) == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert serve.round_epochs(8, 2) == [0, 0, 0, 1, 1, 1, 2, 2]
    assert serve.round_epochs(4, 0) == [0, 0, 0, 0]
    assert serve.round_epochs(3, 2) == [0, 1, 2]


def test_the_store_file_system_is_named() -> None:
    """A run says where its records went (a drive, or RAM with `--dir /dev/shm/...`):
    the disk's I/O path is part of what a saturated server pays for the saves."""
    assert serve.file_system(Path("/dev/shm/bench/store")) == "tmpfs"
    assert serve.file_system(Path("/proc/self")) == "proc"  # the deepest mount wins
