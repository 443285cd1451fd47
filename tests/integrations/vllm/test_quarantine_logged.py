"""A record withdrawn for a bad header is logged with the worker's rank and the reason
(issue 31, item 4): met by a load's discovery (the load fails, and its line says why
the record is in no tier). A worker's start reads no header (issue 52 item 3), so a
bad record is first met, quarantined and logged by the load that uses it. No engine: the real worker
side over vLLM's own planner (the tiny Gemma 3's groups), real files, real header
corruption (a flipped byte, no test double).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from bsr_io.integrations.vllm import kv_shapes
from bsr_io.integrations.vllm.config import ConnectorConfig
from bsr_io.integrations.vllm.layout import WINDOW, GroupLayout, group_layouts
from bsr_io.integrations.vllm.metadata import BsrMetadata, RecordOrder, Transfer
from bsr_io.integrations.vllm.worker import WorkerSide

HASHES = (100, 101, 102)


def order(group: int, c: int) -> RecordOrder:
    """The window record at chunk boundary `c` (hash HASHES[c]), two blocks of its own."""
    return RecordOrder(group, c, HASHES[c], (1 + 2 * c, 2 + 2 * c))


def worker(store: Path, groups: list[GroupLayout]) -> WorkerSide:
    cfg = ConnectorConfig(store_dir=str(store), chunk_tokens=256, rescan_s=60)
    w = WorkerSide(cfg, groups, 24, rank=0, world_size=1, model="tiny")
    w.register(kv_shapes.allocate(kv_shapes.gemma3()))
    return w


def spoil_header(store: Path) -> Path:
    """Flip a header byte of one stored record (the header checksum then fails)."""
    path = sorted((store / "chunks").glob("*/*.chunk"))[0]
    with open(path, "r+b") as f:
        f.seek(8)
        b = f.read(1)
        f.seek(8)
        f.write(bytes([b[0] ^ 0xFF]))
    return path


def test_a_record_withdrawn_for_its_header_is_logged_with_rank_and_reason(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="bsr_io.vllm")
    store = tmp_path / "store"
    groups = group_layouts(kv_shapes.gemma3(), 256)
    window = next(g for g in groups if g.kind == WINDOW)
    saver = worker(store, groups)
    try:
        records = tuple(order(window.index, c) for c in range(len(HASHES)))
        saver.save_step(BsrMetadata(step_saves=[Transfer("s", "tiny", records)]))
        deadline = time.monotonic() + 30
        while len(list((store / "chunks").glob("*/*.chunk"))) < len(HASHES):
            assert time.monotonic() < deadline, "the records were not written"
            time.sleep(0.05)
    finally:
        saver.close()

    # A load meets the bad header in discovery: the record is withdrawn (quarantined)
    # and the failed load's line names the rank and the header's problem.
    loader = worker(store, groups)
    try:
        bad = spoil_header(store)
        c = HASHES.index(int(bad.stem, 16))
        loader.submit(BsrMetadata(loads=[Transfer("r", "tiny", (order(window.index, c),), 256)]))
        failed: set[str] = set()
        deadline = time.monotonic() + 30
        while "r" not in failed:
            assert time.monotonic() < deadline, "the load was not reported"
            failed |= loader.results()[2]
            time.sleep(0.02)
    finally:
        loader.close()
    lines = [r for r in caplog.records if "load of request r failed" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING, caplog.text
    text = lines[0].getMessage()
    assert "rank 0" in text and "unreadable header: header checksum mismatch" in text, text
    assert "quarantined" in text, text

    # A worker's start reads no record's header (issue 52: opening a store of 10^6
    # records must not wait on 10^6 header reads): a bad record stays where it is,
    # nothing is said at start, and its first load meets it as above.
    caplog.clear()
    bad = spoil_header(store)
    worker(store, groups).close()
    assert not [r for r in caplog.records if "quarantined at start" in r.getMessage()]
    assert bad.exists() and len(list((store / "quarantine").glob("*.chunk"))) == 1
