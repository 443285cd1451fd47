"""CUDA host registration of the staging arena (runs only where a GPU is present)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bsr_io import Engine, as_tensor, register_cuda, unregister_cuda

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def test_register_without_cuda_is_a_no_op() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA present: covered by the registered test")
    assert register_cuda(Engine(1, 4096)) is False


@needs_cuda
def test_registered_slots_copy_asynchronously(tmp_path: Path) -> None:
    data = torch.arange(1 << 20, dtype=torch.int32)
    (tmp_path / "f").write_bytes(data.numpy().tobytes())
    eng = Engine(2, 4 << 20)
    assert register_cuda(eng) is True
    assert register_cuda(eng) is True  # idempotent
    try:
        slot = eng.read(eng.open(tmp_path / "f"), 0, 4 << 20)
        host = as_tensor(slot, dtype=torch.int32)
        dev = torch.empty_like(host, device="cuda")
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            dev.copy_(host, non_blocking=True)
        stream.synchronize()
        assert torch.equal(dev.cpu(), data)
    finally:
        unregister_cuda(eng)
    unregister_cuda(eng)  # idempotent
