"""What a restore refuses before it reads, and what it does when an install raises.
Real engine and files; the raising destination is a
documented double."""

from __future__ import annotations

import pytest
import torch

from bsr_io import Engine
from bsr_io.cli.synthetic import fill_state
from bsr_io.errors import LayoutError
from bsr_io.load.kvcache import PagedKVCache
from bsr_io.model.layout import KVLayout, preset
from bsr_io.restore import Restorer
from bsr_io.store import open_store

LAYOUT = preset("tiny")
CHUNKS = 4


def _setup(tmp_path):
    engine = Engine(2, LAYOUT.chunk_bytes)
    store = open_store(engine, tmp_path / "l2", layout=LAYOUT)
    tokens, _ = fill_state(store.tier("L2"), LAYOUT, CHUNKS * 16, seed=7, model="m")
    return engine, store, Restorer(store, LAYOUT, window=2, engine=engine, model="m"), tokens


def test_destination_of_another_layout_is_refused_before_any_read(tmp_path):
    engine, store, r, tokens = _setup(tmp_path)
    # The same groups in another order: the same chunk size, the groups' bytes swapped.
    swapped = KVLayout(LAYOUT.name, tuple(reversed(LAYOUT.groups)), LAYOUT.chunk_tokens)
    assert swapped.chunk_bytes == LAYOUT.chunk_bytes
    assert swapped.fingerprint() != LAYOUT.fingerprint()
    plan = r.probe(tokens)
    reads = store.tier("L2").stats()["reads"]
    engine.reset_peak()
    with pytest.raises(LayoutError, match="laid out as"):
        r.restore(plan, PagedKVCache.allocate(swapped, CHUNKS * 16))
    assert store.tier("L2").stats()["reads"] == reads  # not one payload read
    assert engine.peak_bytes() == 0
    # The right destination restores the same plan's records.
    assert r.restore(r.probe(tokens), PagedKVCache.allocate(LAYOUT, CHUNKS * 16)).complete


class _Raises:
    """Destination double: installing chunk 1 fails (out of memory, bad block ids)."""

    def __init__(self, inner: PagedKVCache) -> None:
        self.inner, self.layout = inner, inner.layout
        self.capacity_chunks = inner.capacity_chunks

    def install(self, chunk_index: int, payload: torch.Tensor):
        if chunk_index == 1:
            raise MemoryError("injected")
        return self.inner.install(chunk_index, payload)

    def extract(self, chunk_index: int, out: torch.Tensor) -> None:
        self.inner.extract(chunk_index, out)

    def synchronize(self) -> None:
        self.inner.synchronize()


def test_an_install_error_reaches_the_caller_and_spares_the_store(tmp_path):
    engine, store, r, tokens = _setup(tmp_path)
    with pytest.raises(MemoryError):
        r.restore(r.probe(tokens), _Raises(PagedKVCache.allocate(LAYOUT, CHUNKS * 16)))
    assert engine.free_slots() == 2  # reads in flight were waited for, slots returned
    l2 = store.tier("L2")
    assert l2.quarantined_files() == [] and r.probe(tokens).hit_chunks == CHUNKS
