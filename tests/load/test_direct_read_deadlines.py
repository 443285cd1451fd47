"""Direct reads (straight into a host cache's blocks) have the restore's deadline.

A direct read still in flight at the deadline is given up: the restore returns then, not
when the read ends, `zero`, with no fallback into those blocks, and reports them
(`unusable_chunks`); no later restore reuses that destination. The same holds when the
engine breaks down with the read in the kernel's hands (KernelOwnedError: "destination
blocks still owned by the kernel"), which the tier reports as DestinationUnusable.

The stalls are provoked with the fault double's "hang" (bsr_io.faults: the read is not
done for `delay_s`, as a stalled drive's) and with a FIFO nobody writes as a record's
payload source (a test double of the tier, below); the engine, the tier's checks and the
window are the real ones.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from bsr_io import Engine
from bsr_io.cli.synthetic import fill_state, synthetic_chunk
from bsr_io.faults import Fault, FaultPlan
from bsr_io.load.kvcache import PagedKVCache
from bsr_io.load.window import unusable_chunks
from bsr_io.model.keys import ChunkKey, chunk_keys
from bsr_io.model.layout import preset
from bsr_io.restore import Restorer
from bsr_io.store import Store
from bsr_io.tiers import SSDTier

DSV4 = preset("deepseek-v4-flash")  # 16 MiB chunks: O_DIRECT straight into the blocks
CHUNKS = 3
HANG_S = 30.0
TIMEOUT_S = 1.5


@pytest.fixture(scope="module")
def dsv4_store(tmp_path_factory):
    root = tmp_path_factory.mktemp("dsv4") / "l2"
    with Engine(2, DSV4.chunk_bytes) as eng:
        tokens, _ = fill_state(
            SSDTier(root, None, eng), DSV4, DSV4.chunk_tokens * CHUNKS, seed=5, model="m"
        )
    return root, tokens


def test_a_direct_read_past_the_deadline_returns_then_and_its_blocks_are_not_reused(
    dsv4_store,
):
    """Chunk 1's read into the cache hangs (fault double) far past the deadline. The
    restore returns at the deadline, `zero`, and reports chunk 1's blocks unusable; a
    second restore into the same cache ends `zero` at once, reading nothing. Before, the
    run waited for the hung read to end (the whole hang). Control: a new cache restores
    complete, every chunk read in place."""
    root, tokens = dsv4_store
    with Engine(2, DSV4.chunk_bytes) as engine:
        tier = SSDTier(root, None, engine)
        keys = chunk_keys(tokens, DSV4, "m")
        hung = FaultPlan([Fault("hang", chunks={1}, delay_s=HANG_S)]).wrap(tier, keys=keys)
        r = Restorer(Store([hung]), DSV4, engine=engine, model="m", timeout_s=TIMEOUT_S)
        plan = r.probe(tokens)
        assert plan.hit_chunks == CHUNKS
        dest = PagedKVCache.allocate(DSV4, plan.hit_tokens)
        t0 = time.monotonic()
        res = r.restore(plan, dest)
        took = time.monotonic() - t0
        assert took < TIMEOUT_S + 3.0, f"waited {took:.1f} s for a read hung {HANG_S} s"
        assert res.outcome == "zero" and res.timed_out, res
        assert res.unusable_chunks == [1], res
        assert unusable_chunks(dest) == {1}
        assert tier.stats()["quarantined"] == 0  # a stall proves nothing against a record
        # Never reused: the next restore into this cache ends at once, nothing read.
        again = r.restore(r.probe(tokens), dest)
        assert again.outcome == "zero" and "may still be written" in again.reason, again
        assert again.bytes_read == {}
        # Control: a fresh cache restores complete, read in place (a deadline a loaded
        # machine cannot miss: this is not about the deadline).
        plain = Restorer(Store([tier]), DSV4, engine=engine, model="m", timeout_s=60)
        fresh = PagedKVCache.allocate(DSV4, plan.hit_tokens)
        ok = plain.restore(plain.probe(tokens), fresh)
        assert ok.complete and ok.timings["direct_chunks"] == CHUNKS, ok
        assert fresh.chunk_bytes(1) == synthetic_chunk(DSV4, 5, 1).tobytes()


# -- an engine break-down with a direct read in the kernel's hands -------------------------
TINY = preset("tiny")


class _FifoSourced(SSDTier):
    """Test double: chunk `stuck`'s payload is read from a FIFO (a source that answers only
    when the test writes it); the record's header, its checks and everything after the
    read are the real tier's."""

    fifo: Path
    stuck: ChunkKey

    def _start(self, key, engine, submit):  # type: ignore[no-untyped-def]
        if key != self.stuck:
            return super()._start(key, engine, submit)
        src = engine.open(self.fifo, special=True)
        return super()._start(key, engine, lambda _f, n: submit(src, n))


def _ring_fds() -> set[int]:
    found = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") == "anon_inode:[io_uring]":
                found.add(int(name))
        except OSError:
            pass
    return found


def test_a_break_down_with_a_direct_read_in_the_kernel_ends_zero_and_spares_the_blocks(
    backend, tmp_path
):
    """The ring breaks (its descriptor pointed at /dev/null, a real io_uring_enter
    failure) while chunk 0's direct read from a FIFO is in the kernel. The tier turns the
    engine's KernelOwnedError into DestinationUnusable: the restore ends `zero` (no
    EngineBrokenError out of it, no fallback into those blocks), reports chunk 0's
    blocks unusable, and no later restore reuses the cache."""
    if backend == "pread":
        pytest.skip("no ring on the pread pool to break")
    before = _ring_fds()
    engine = Engine(2, TINY.chunk_bytes, backend=backend, request_bytes=4096)
    (ring,) = _ring_fds() - before
    tier = _FifoSourced(tmp_path / "l2", None, engine)
    tokens, keys = fill_state(tier, TINY, TINY.chunk_tokens * 4, seed=3, model="m")
    tier.fifo, tier.stuck = tmp_path / "fifo", keys[0]
    os.mkfifo(tier.fifo)
    writer = os.open(tier.fifo, os.O_RDWR)  # a writer that writes only when told
    r = Restorer(Store([tier]), TINY, engine=engine, model="m", timeout_s=20)
    plan = r.probe(tokens)
    dest = PagedKVCache.allocate(TINY, plan.hit_tokens)
    out: list = []
    run = threading.Thread(target=lambda: out.append(r.restore(plan, dest)), daemon=True)
    run.start()
    time.sleep(1.0)  # chunk 0's requests are with the kernel, waiting on the FIFO
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, ring)
    os.close(null)
    os.write(writer, b"\7" * 100)  # one request ends short; its resubmit breaks the ring
    run.join(15)
    assert not run.is_alive()
    (res,) = out
    assert res.outcome == "zero" and res.unusable_chunks == [0], res
    assert "still owned by the kernel" in res.reason, res.reason
    assert unusable_chunks(dest) == {0}
    # The kernel keeps that memory for good: never reported given back.
    assert res.unusable_returned is not None and not res.unusable_returned()
    assert tier.stats()["quarantined"] == 0
    os.close(writer)
    engine.close()
