"""The drive is sent requests of `request_bytes`, not what the block layer would merge
them into: a batch of contiguous requests would be plugged and merged up to the queue's
`max_sectors_kb`, and larger requests read slower on the drive this was measured on
(docs/architecture.md, the engine)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bsr_io import Engine

MiB = 1 << 20
REQUEST = MiB
REQUESTS = 16


def block_queue(path: Path) -> Path | None:
    """The sysfs directory of the block device holding `path` (its partition's disk for
    the queue limits), or None on a file system without one (tmpfs, FUSE, overlay)."""
    st = os.stat(path)
    dev = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    if not dev.exists():
        return None
    dev = dev.resolve()
    return dev if (dev / "queue").exists() else dev.parent


def reads_completed(disk: Path) -> int:
    return int((disk / "stat").read_text().split()[0])


def test_contiguous_requests_reach_the_drive_unmerged(tmp_path: Path) -> None:
    disk = block_queue(tmp_path)
    if disk is None:
        pytest.skip(f"{tmp_path} is not on a block device: no device requests to count")
    limit_kib = int((disk / "queue" / "max_sectors_kb").read_text())
    if limit_kib * 1024 < 2 * REQUEST:
        pytest.skip(f"the queue takes at most {limit_kib} KiB a request: nothing to merge")
    path = tmp_path / "data"
    path.write_bytes(os.urandom(REQUESTS * REQUEST))
    os.sync()
    with Engine(1, REQUESTS * REQUEST, request_bytes=REQUEST, backend="io_uring") as eng:
        f = eng.open(path)
        before = reads_completed(disk)
        slot = eng.read(f, 0, REQUESTS * REQUEST)  # one op: 16 contiguous requests at once
        after = reads_completed(disk)
        slot.release()
    # Other I/O on the drive can only add to the count. Merged (one plugged batch), the
    # 16 MiB arrive as max_sectors_kb-sized requests: 4 of 4 MiB on the virtio disk here.
    assert after - before >= REQUESTS, (
        f"{after - before} device reads for {REQUESTS} requests of {REQUEST} bytes: "
        "the block layer merged them"
    )
