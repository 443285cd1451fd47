"""One file stalled in the kernel holds no other file's reads, on every backend.

The stall is a real one: a file served through FUSE (tests/fuse_stall.py) whose reads past
its first page are answered seconds late. FUSE's direct reads do not honour io_uring's
non-blocking first try, so issued inline they held the ring's only thread in
io_uring_enter for the whole stall, and a healthy file's read on the local disk waited
"not yet handed to the kernel" behind it. Files on such file systems now go straight to a
kernel worker (IOSQE_ASYNC, rust/core/src/fstype.rs); local files are issued as before.
"""

from __future__ import annotations

import mmap
import os
import sys
from pathlib import Path

import pytest

from bsr_io import Engine, WaitTimeoutError

sys.path.insert(0, str(Path(__file__).parent.parent))
from fuse_stall import late_file  # noqa: E402

KiB = 1 << 10
# Seconds FUSE holds each read of the stalled file: the healthy reads must all end
# before the stalled one does, which is the check (ordering, not a time limit).
STALL_S = 4.0


def test_a_stalled_files_read_holds_no_other_files_read(backend: str, tmp_path: Path) -> None:
    stalled, healthy = tmp_path / "stalled", tmp_path / "healthy"
    stalled_bytes, healthy_bytes = os.urandom(64 * KiB), os.urandom(64 * KiB)
    stalled.write_bytes(stalled_bytes)
    healthy.write_bytes(healthy_bytes)
    # 4 KiB requests: the stalled read is two requests, each held STALL_S by FUSE.
    with (
        Engine(4, 64 * KiB, request_bytes=4 * KiB, backend=backend) as eng,
        late_file(stalled, delay_s=STALL_S),
    ):
        sf, hf = eng.open(stalled), eng.open(healthy)
        assert sf.direct and hf.direct
        stuck = eng.submit_read(sf, 4 * KiB, 8 * KiB)
        # The stalled read's own deadline rule is unchanged: past it, the wait says the
        # read is in the kernel (it cannot be withdrawn).
        with pytest.raises(WaitTimeoutError, match="in the kernel"):
            stuck.wait(0.5)
        assert not stuck.withdraw()
        # The healthy file, through a slot and straight into caller memory.
        pending = eng.submit_read(hf, 0, 32 * KiB)
        dest = mmap.mmap(-1, 32 * KiB)  # page-aligned, as O_DIRECT wants
        direct = eng.submit_read_into(hf, 32 * KiB, [dest], [(0, 0, 0, 32 * KiB)])
        # A bound against a hang only: both end long before the stall does, or (before
        # the fix) right after it, which the ordering check below catches.
        slot = pending.wait(30)
        assert direct.wait(30) == 32 * KiB
        assert not stuck.done(), "a healthy file's reads waited for the stalled file's"
        assert bytes(slot) == healthy_bytes[: 32 * KiB]
        assert bytes(dest) == healthy_bytes[32 * KiB :]
        slot.release()
        # Then the stalled read ends as FUSE answers, with the file's bytes.
        with stuck.wait(30) as got:
            assert bytes(got) == stalled_bytes[4 * KiB : 12 * KiB]
        dest.close()
        sf.close()
        hf.close()
