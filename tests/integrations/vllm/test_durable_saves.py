"""`durable_saves: false`: records published without the fdatasync before the rename
and the directory's fsync after it. Both are device flushes, and on the Xeon VM of
`bsr-lab bench serve` they were most of what the saves cost a saturated server
(docs/results/serve-xeon-nosync.json). No engine: the real worker side over vLLM's own
planner (the tiny Gemma 3's groups), real files; the flushes are held with the
engine's stall double, as a stalled drive would hold them, to see which ones a save
reaches.
"""

from __future__ import annotations

import time

import pytest
from step_records import gemma_worker, group_of, stored, wait_for

from bsr_io._core import stall_publish
from bsr_io.integrations.vllm.config import ConnectorConfig
from bsr_io.integrations.vllm.layout import WINDOW
from bsr_io.integrations.vllm.metadata import BsrMetadata, RecordOrder, Transfer


@pytest.mark.parametrize("durable", [False, True])
def test_a_save_flushes_only_when_durable(tmp_path, durable):
    store = tmp_path / "store"
    cfg = ConnectorConfig(store_dir=str(store), chunk_tokens=256, durable_saves=durable)
    worker = gemma_worker(cfg)
    held = [stall_publish(step, str(store)) for step in ("fdatasync", "dirsync")]
    try:
        record = RecordOrder(group_of(worker, WINDOW).index, 0, 100, (1, 2))
        worker.save_step(BsrMetadata(step_saves=[Transfer("s", "tiny", (record,))]))
        if durable:  # the control: held at each flush in turn until the drive "recovers"
            deadline = time.monotonic() + 20
            for h in held:
                while h.hits == 0:
                    assert time.monotonic() < deadline, [x.hits for x in held]
                    time.sleep(0.02)
                h.release()
        wait_for(worker, "saved", 1)
        hits = [h.hits for h in held]
        assert hits == ([1, 1] if durable else [0, 0]), hits
        assert len(stored(store)) == 1  # published, whole, either way
    finally:
        for h in held:
            h.release()
        worker.close()
