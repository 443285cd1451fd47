"""The plain file calls of a save have the save's deadline too (`tiers/files/bounded.py`).

(L2 publishes a record in one native call: its stalls are in test_publish_deadline.py.)

- L3's writes and fdatasync (buffered, on the caller's thread before) are waited for
  `write_timeout_s` at most.

Past it the save fails (ChunkWriteError), nothing is published, no temp file is left and
earlier records read back intact. The stall is a fault double: `os.pwrite` or
`os.fdatasync` blocks, as on a stalled drive or mount, for the descriptors of the tier's
temp files only (found through /proc/self/fd), until the test releases it. No
device-mapper here to suspend a real device (`dmsetup` finds no kernel driver). The
save runs on a thread of the test's, so that a save with no deadline fails the test
instead of hanging it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from stalls import ends_within, fd_path, stalled

from bsr_io import Engine
from bsr_io.cli.synthetic import fill_state, synthetic_chunk
from bsr_io.errors import ChunkWriteError
from bsr_io.model.layout import preset
from bsr_io.model.record import HEADER_BYTES
from bsr_io.tiers import LowerTier, SSDTier

LAYOUT = preset("tiny")
DEADLINE_S = 1.0
SLACK_S = 2.0


def _stalled(monkeypatch: pytest.MonkeyPatch, name: str, root: Path):  # type: ignore[no-untyped-def]
    """`os.<name>` blocked on the tier's temp files under `root` (fault double)."""
    return stalled(monkeypatch, name, lambda fd: _temp_under(fd_path(fd), root))


def _temp_under(path: str, root: Path) -> bool:
    return path.startswith(str(root)) and ".tmp" in path


def _save_in_time(save: Callable[[], object]) -> tuple[float, BaseException | None]:
    """(seconds, what it raised or None); fails the test past the deadline's slack."""
    return ends_within(lambda: (save(), None)[1], DEADLINE_S + SLACK_S, "save")


def _no_leftovers(root: Path, chunks: int) -> None:
    assert len(list(root.rglob("*.chunk"))) == chunks
    assert not list(root.rglob("*.tmp"))


@pytest.mark.parametrize("call", ["pwrite", "fdatasync"])
def test_a_stalled_l3_write_fails_the_save_at_its_deadline(tmp_path, monkeypatch, call):
    """Before, L3's writes and fdatasync ran on the caller's thread with no limit."""
    root = tmp_path / "l3"
    tier = LowerTier(root, write_timeout_s=DEADLINE_S)
    _, first = fill_state(tier, LAYOUT, LAYOUT.chunk_tokens, seed=1, model="m")
    with _stalled(monkeypatch, call, root) as stall:
        took, exc = _save_in_time(
            lambda: fill_state(tier, LAYOUT, LAYOUT.chunk_tokens, seed=2, model="m")
        )
        assert isinstance(exc, ChunkWriteError), exc
        assert "did not end within" in str(exc), exc
        assert stall.hits == 1 and took < DEADLINE_S + SLACK_S
        assert tier.keys() == first
        _no_leftovers(root, 1)
    _no_leftovers(root, 1)
    with Engine(2, LAYOUT.chunk_bytes) as engine:
        got = tier.submit_read(first[0], engine).wait()
        assert bytes(memoryview(got)) == synthetic_chunk(LAYOUT, 1, 0).tobytes()
        got.release()
    _, second = fill_state(tier, LAYOUT, LAYOUT.chunk_tokens, seed=2, model="m")
    assert set(tier.keys()) == {first[0], second[0]}


def test_write_timeout_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="write_timeout_s must be > 0"):
        LowerTier(tmp_path / "l3", write_timeout_s=0)


def test_a_stalled_demotion_to_l3_does_not_hold_the_l2_save(tmp_path, monkeypatch):
    """L2 full: saving a record evicts the oldest, copied down to L3 first (best
    effort). L3's copy stalls (its fdatasync): the copy is given up at L3's
    `write_timeout_s`, the record is evicted anyway and the L2 save goes on. Before, the
    copy ran on the saving thread with no limit."""
    l3_root = tmp_path / "l3"
    l3 = LowerTier(l3_root, write_timeout_s=DEADLINE_S)
    with Engine(2, LAYOUT.chunk_bytes) as engine:
        one = HEADER_BYTES + LAYOUT.chunk_bytes
        l2 = SSDTier(tmp_path / "l2", one, engine, evict_to=l3)
        _, first = fill_state(l2, LAYOUT, LAYOUT.chunk_tokens, seed=1, model="m")
        with _stalled(monkeypatch, "fdatasync", l3_root) as stall:
            took, exc = _save_in_time(
                lambda: fill_state(l2, LAYOUT, LAYOUT.chunk_tokens, seed=2, model="m")
            )
            assert exc is None and stall.hits == 1 and took < DEADLINE_S + SLACK_S
            assert len(l2.keys()) == 1 and l2.keys() != first
            assert l3.keys() == []
            _no_leftovers(l3_root, 0)
        _no_leftovers(l3_root, 0)
        # Control: with the call free the next eviction lands in L3.
        fill_state(l2, LAYOUT, LAYOUT.chunk_tokens, seed=3, model="m")
        assert len(l3.keys()) == 1
