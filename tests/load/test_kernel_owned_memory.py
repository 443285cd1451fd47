"""Host memory has one owner, by address: a range a given-up read may still write is the
kernel's until the read returns, whichever view object a later load is handed.

The stall is a real one: the record's payload is served through FUSE (tests/fuse_stall.py)
and answered late, so the O_DIRECT read into the cache's blocks is held in the kernel.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from bsr_io import Engine
from bsr_io.cli.synthetic import fill_state, synthetic_chunk
from bsr_io.errors import KernelOwnedMemory
from bsr_io.load import memory
from bsr_io.load.kvcache import HostBuffers, PagedKVCache
from bsr_io.load.memory import registered
from bsr_io.load.window import chunk_ranges, refuse_kernel_owned, unusable_chunks
from bsr_io.model.layout import AllocatorGroup, KVLayout
from bsr_io.restore import Restorer
from bsr_io.store import Store
from bsr_io.tiers import SSDTier

sys.path.insert(0, str(Path(__file__).parent.parent))
from fuse_stall import late_file  # noqa: E402

# One 32 KiB block per chunk: page-aligned runs, which O_DIRECT through FUSE (4096-byte
# alignment) takes straight into the cache.
LAYOUT = KVLayout("owned", (AllocatorGroup("kv", torch.bfloat16, (1024,), 16),), chunk_tokens=16)
CHUNKS = 3
STALLED = 1
# Every backend: io_uring sends a FUSE file's requests to a kernel worker (IOSQE_ASYNC), so
# the held read keeps the stall to its chunk there as the pread pool does.


def _views(cache: PagedKVCache) -> PagedKVCache:
    """Another view object over the same memory and blocks (a per-request cache)."""
    return PagedKVCache(LAYOUT, cache.tensors, [list(range(CHUNKS))])


def test_a_range_the_kernel_owns_is_refused_through_a_new_view(
    backend: str, tmp_path: Path
) -> None:
    """Chunk 1's payload read is held by FUSE past the restore's deadline: the restore
    ends `zero` with chunk 1's blocks unusable. A second restore through a NEW cache
    object over the same memory is refused before reading anything (KernelOwnedMemory,
    not a bad chunk); before, only the first object was refused and the second read
    into the kernel's range again. Once FUSE answers, the range is returned and the same
    new view restores complete. Control: a view over other memory is not refused."""
    with Engine(2, LAYOUT.chunk_bytes, backend=backend) as engine:
        tier = SSDTier(tmp_path / "l2", None, engine)
        tokens, keys = fill_state(tier, LAYOUT, LAYOUT.chunk_tokens * CHUNKS, seed=4, model="m")
        r = Restorer(Store([tier]), LAYOUT, engine=engine, model="m", timeout_s=1.0)
        first = PagedKVCache.allocate(LAYOUT, LAYOUT.chunk_tokens * CHUNKS)
        with late_file(tier.path_of(keys[STALLED]), delay_s=120.0) as stall:
            res = r.restore(r.probe(tokens), first)
            assert res.outcome == "zero" and res.timed_out, res
            assert res.unusable_chunks == [STALLED], res
            assert res.timings["direct_chunks"] >= 1, res  # read in place, not via a slot
            second = _views(first)
            assert second is not first
            assert unusable_chunks(second) == {STALLED}
            again = r.restore(r.probe(tokens), second)
            assert again.outcome == "zero", again
            assert "still owned by the kernel" in again.reason, again.reason
            assert again.bytes_read == {} and again.failed_chunks == [], again
            with pytest.raises(KernelOwnedMemory) as err:
                refuse_kernel_owned(second, CHUNKS)
            lo, hi = err.value.start, err.value.end
            base = first.tensors[0].data_ptr()
            assert (lo, hi) == (base + STALLED * LAYOUT.chunk_bytes, base + 2 * LAYOUT.chunk_bytes)
            # Control: other memory is not the kernel's.
            other = PagedKVCache.allocate(LAYOUT, LAYOUT.chunk_tokens * CHUNKS)
            refuse_kernel_owned(other, CHUNKS)
            assert unusable_chunks(other) == frozenset()
            stall.release()
            assert memory.wait_returned([(lo, hi)], 30.0)
            assert res.unusable_returned is not None and res.unusable_returned()
        assert unusable_chunks(second) == frozenset()
        done = Restorer(Store([tier]), LAYOUT, engine=engine, model="m", timeout_s=30.0)
        ok = done.restore(done.probe(tokens), second)
        assert ok.complete, ok
        for i in range(CHUNKS):
            assert second.chunk_bytes(i) == synthetic_chunk(LAYOUT, 4, i).tobytes()


def test_owned_ranges_are_found_by_address_through_any_buffer_object(
    backend: str, tmp_path: Path
) -> None:
    """The owner is keyed by address range: a flat buffer view made independently of the
    cache (LMCache's staging buffers, `HostBuffers`) over the same bytes is refused too."""
    with Engine(2, LAYOUT.chunk_bytes, backend=backend) as engine:
        tier = SSDTier(tmp_path / "l2", None, engine)
        tokens, keys = fill_state(tier, LAYOUT, LAYOUT.chunk_tokens * CHUNKS, seed=9, model="m")
        r = Restorer(Store([tier]), LAYOUT, engine=engine, model="m", timeout_s=1.0)
        cache = PagedKVCache.allocate(LAYOUT, LAYOUT.chunk_tokens * CHUNKS)
        with late_file(tier.path_of(keys[STALLED]), delay_s=120.0) as stall:
            assert r.restore(r.probe(tokens), cache).unusable_chunks == [STALLED]
            flat = cache.tensors[0].view(-1).view(torch.uint8).numpy()
            n = LAYOUT.chunk_bytes
            views = HostBuffers([flat[i * n : (i + 1) * n] for i in range(CHUNKS)])
            assert unusable_chunks(views) == {STALLED}
            stall.release()
            assert memory.wait_returned(chunk_ranges(views, STALLED), 30.0)
        assert unusable_chunks(views) == frozenset()


# Two groups: a cache whose memory is two buffers, registered as one owner.
TWO = KVLayout(
    "owned2",
    tuple(AllocatorGroup(n, torch.bfloat16, (512,), 16) for n in ("k", "v")),
    chunk_tokens=16,
)


def test_the_memorys_one_owner_holds_its_registration_and_the_kernels_ranges(
    backend: str, tmp_path: Path
) -> None:
    """One object per host memory: the owner the window registered a lasting cache's
    two buffers under is the one that holds the ranges a given-up read may still write,
    and a buffer given up in before its memory was registered passes its range to the
    owner the registration makes (one owner, not two over the same bytes)."""
    with Engine(2, TWO.chunk_bytes, backend=backend) as engine:
        tier = SSDTier(tmp_path / "l2", None, engine)
        tokens, keys = fill_state(tier, TWO, TWO.chunk_tokens * CHUNKS, seed=5, model="m")
        r = Restorer(Store([tier]), TWO, engine=engine, model="m", timeout_s=1.0)
        lasting = PagedKVCache.allocate(TWO, TWO.chunk_tokens * CHUNKS)
        short = PagedKVCache.allocate(TWO, TWO.chunk_tokens * CHUNKS)
        short.lasting = False  # never registered by a load
        with late_file(tier.path_of(keys[STALLED]), delay_s=120.0) as stall:
            for cache in (lasting, short):
                assert r.restore(r.probe(tokens), cache).unusable_chunks == [STALLED]
            owner = registered(engine, lasting.host_memory())
            assert owner is not None, "the lasting cache's memory is registered"
            assert sorted(owner.owned()) == sorted(chunk_ranges(lasting, STALLED))
            assert all(memory.owner_of(b) is owner for b in lasting.host_memory())
            # The short cache's ranges have owners of a buffer each, until its memory is
            # registered: then the registration's owner holds them.
            assert registered(engine, short.host_memory()) is None
            held = short.register(engine)
            assert held.registered_with(engine) and held is not owner
            assert sorted(held.owned()) == sorted(chunk_ranges(short, STALLED))
            assert all(memory.owner_of(b) is held for b in short.host_memory())
            stall.release()
            assert owner.wait_returned(30.0) and held.wait_returned(30.0)
        assert owner.owned() == [] and held.owned() == []
