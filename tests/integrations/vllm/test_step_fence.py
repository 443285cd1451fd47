"""A step cut copies its blocks after the step that wrote them (save/fence.py).

On a GPU, `wait_for_save` runs when the forward's kernels are enqueued, not done; the
cut's copy must wait on the step's fence first. No GPU here: a test double stands for
the late kernels (the step's bytes land in the blocks only when a copy waits on its
fence), over the real worker side (the tiny Gemma 3's groups, real files). The CUDA
fence itself is checked by tests/gpu/check_cuda.py on a device.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from step_records import expected, fill, gemma_worker, group_of, stored, wait_for

from bsr_io.integrations.vllm.config import ConnectorConfig
from bsr_io.integrations.vllm.layout import FULL, WINDOW
from bsr_io.integrations.vllm.metadata import BsrMetadata, RecordOrder, Transfer
from bsr_io.integrations.vllm.worker import WorkerSide
from bsr_io.save.fence import NO_FENCE, StepFence, step_fence


class _LateKernels(StepFence):
    """Test double for a GPU step still running when it is cut: its writes (a fill of
    every page) land when a copy waits on the fence, not before."""

    def __init__(self, worker: WorkerSide, seed: int) -> None:
        self.worker, self.seed = worker, seed
        self.waits = 0

    @contextmanager
    def ordered(self) -> Iterator[None]:
        self.waits += 1
        fill(self.worker, self.seed)  # the step's kernels finish now
        yield


def test_a_cut_copies_after_its_step_fence(tmp_path: Path) -> None:
    store = tmp_path / "store"
    worker = gemma_worker(ConnectorConfig(store_dir=str(store), chunk_tokens=256))
    try:
        # One record of each kind: a full group's (a writer copies it) and a window
        # group's (copied on the forward thread).
        full, win = group_of(worker, FULL), group_of(worker, WINDOW)
        cuts = [
            Transfer("a", "tiny", (RecordOrder(full.index, 0, 100, (1, 2)),)),
            Transfer("b", "tiny", (RecordOrder(win.index, 0, 101, (5, 6)),)),
        ]
        fill(worker, 2)  # what the step writes
        want = sorted(expected(worker, t) for t in cuts)
        fill(worker, 1)  # what the blocks held before it
        before = sorted(expected(worker, t) for t in cuts)
        assert want != before

        fence = _LateKernels(worker, 2)
        worker.cuts.cut(BsrMetadata(step_saves=cuts), fence)
        wait_for(worker, "saved", 2)
        assert fence.waits == 2
        assert sorted(stored(store)) == want  # never the bytes from before the step
    finally:
        worker.close()


def test_the_fence_is_nothing_on_the_cpu(tmp_path: Path) -> None:
    assert step_fence(torch.device("cpu")) is NO_FENCE
    with NO_FENCE.ordered():  # no event, no stream
        pass
    # A CPU worker's step cut: the bytes its blocks hold when the hook runs.
    store = tmp_path / "store"
    worker = gemma_worker(ConnectorConfig(store_dir=str(store), chunk_tokens=256))
    try:
        assert worker.pages is not None and worker.pages.device.type == "cpu"
        fill(worker, 3)
        t = Transfer("c", "tiny", (RecordOrder(group_of(worker, FULL).index, 0, 100, (1, 2)),))
        worker.save_step(BsrMetadata(step_saves=[t]))
        wait_for(worker, "saved", 1)
        assert stored(store) == [expected(worker, t)]
    finally:
        worker.close()
