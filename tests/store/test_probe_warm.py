"""A probe's metadata kept warm (tiers/files/warm.py): a file tier holds each namespace
directory it has found a record in open (O_PATH), so the kernel keeps that path's
dentries (a cold path walk is a directory and an inode read per component), and stats a
request's records side by side before probing them in order. Real files, real stats."""

from __future__ import annotations

import os
from pathlib import Path

from bsr_io import Engine
from bsr_io.cli.synthetic import fill_state
from bsr_io.model.layout import preset
from bsr_io.tiers import SSDTier
from bsr_io.tiers.files.warm import PREFETCH_FROM, Pins, prefetch

LAY = preset("tiny")


def _held(directory: Path) -> int:
    """How many of this process's descriptors name `directory`."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == str(directory):
                n += 1
        except OSError:
            pass
    return n


def test_a_probe_pins_the_namespace_directory_until_close(tmp_path: Path) -> None:
    with Engine(2, LAY.chunk_bytes) as engine:
        tier = SSDTier(tmp_path / "l2", None, engine, layout=LAY)
        _, keys = fill_state(tier, LAY, 4 * LAY.chunk_tokens, seed=1, model="m")
        ns_dir = tier.path_of(keys[0]).parent
        fresh = SSDTier(tmp_path / "l2", None, engine, layout=LAY)
        assert _held(ns_dir) == 0  # control: opening the tier holds nothing yet
        assert fresh.probe(keys) == 4
        assert _held(ns_dir) == 1
        assert fresh.probe(keys) == 4
        assert _held(ns_dir) == 1  # once per directory
        fresh.close()
        assert _held(ns_dir) == 0


def test_a_miss_pins_nothing_and_a_link_is_never_pinned(tmp_path: Path) -> None:
    pins = Pins()
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    pins.pin(tmp_path / "link")
    pins.pin(tmp_path / "absent")
    assert len(pins) == 0
    pins.pin(real)
    assert len(pins) == 1 and _held(real) == 1
    pins.close()
    assert _held(real) == 0


def test_prefetch_leaves_the_probe_s_answer_alone(tmp_path: Path) -> None:
    """Prefetched or not, the probe's own stat decides: a removed record is a miss."""
    n = PREFETCH_FROM + 4
    with Engine(2, LAY.chunk_bytes) as engine:
        tier = SSDTier(tmp_path / "l2", None, engine, layout=LAY)
        _, keys = fill_state(tier, LAY, n * LAY.chunk_tokens, seed=1, model="m")
        prefetch([tier.path_of(k) for k in keys] + [tmp_path / "nothing" / "here"])
        assert tier.probe(keys) == n
        tier.path_of(keys[n - 3]).unlink()
        tier.prepare_probe(keys)
        assert tier.probe(keys) == n - 3
