"""Every wait of the save and of discovery has a deadline.

- The engine's fdatasync runs on its I/O thread and is waited for with a timeout. (An L2
  record's publication, one native call, is stalled step by step in
  test_publish_deadline.py.)
- Discovery (stats, header reads, pool queries) is waited for until the load's deadline:
  a stalled metadata call ends the hit on this rank, never the caller's progress.

The stalls are real where they can be: the engine's only I/O lane is held by a read of a
FIFO nobody writes (a hung device as the engine sees one: every later request waits
behind it), on the io_uring backends. A stalled stat or header read is provoked with
the fault double's "hang_probe" (bsr_io.faults).
"""

from __future__ import annotations

import time

import pytest
from stalls import lane_held

from bsr_io import Engine, WaitTimeoutError
from bsr_io.cli.synthetic import fill_state
from bsr_io.faults import Fault, FaultPlan
from bsr_io.load.discovery import DiscoveryTimedOut, sources_of
from bsr_io.load.kvcache import PagedKVCache
from bsr_io.load.records import LoadOptions, load_records
from bsr_io.model.keys import chunk_keys
from bsr_io.model.layout import preset
from bsr_io.restore import Restorer
from bsr_io.store import Store
from bsr_io.tiers import SSDTier

LAYOUT = preset("tiny")
DEADLINE_S = 1.0


def _one_lane_engine(backend: str) -> Engine:
    """An io_uring engine with one I/O lane (one request in flight). The pread pool's
    worker cannot be held by a FIFO (pread on one fails at once, ESPIPE); its waits are
    the same `Pending.wait` with a timeout."""
    if backend == "pread":
        pytest.skip("a FIFO cannot hold the pread pool's worker (ESPIPE)")
    return Engine(2, LAYOUT.chunk_bytes, backend=backend, queue_depth=1)


def test_a_stalled_sync_is_bounded(backend, tmp_path):
    """fdatasync runs on the I/O thread: a wait for it ends at its timeout. Before, the
    save called fdatasync on the caller's thread, with no limit."""
    with _one_lane_engine(backend) as engine:
        (tmp_path / "f").write_bytes(bytes(4096))
        f = engine.open(tmp_path / "f", write=True)
        engine.sync(f, timeout=5)  # control: it works
        with lane_held(engine, tmp_path):
            t0 = time.monotonic()
            with pytest.raises(WaitTimeoutError):
                engine.sync(f, timeout=DEADLINE_S)
            assert time.monotonic() - t0 < DEADLINE_S + 2.0


# -- discovery ------------------------------------------------------------------------------
def test_a_stalled_probe_ends_the_hit_at_the_deadline(tmp_path):
    """A metadata call of discovery stalls (fault double: 'hang_probe', 30 s). The load
    and the Restorer's probe end at their deadline with no hit, saying why. Before,
    both waited out the stall."""
    with Engine(2, LAYOUT.chunk_bytes) as engine:
        tier = SSDTier(tmp_path / "l2", None, engine)
        tokens, keys = fill_state(tier, LAYOUT, LAYOUT.chunk_tokens * 3, seed=2, model="m")
        # Control: without the fault discovery answers at once.
        assert sources_of([tier], keys, time.monotonic() + DEADLINE_S) == [0, 0, 0]
        plan = FaultPlan([Fault("hang_probe", chunks={1}, delay_s=30.0)])
        hung = plan.wrap(tier, keys=keys)
        t0 = time.monotonic()
        with pytest.raises(DiscoveryTimedOut):
            sources_of([hung], keys, time.monotonic() + DEADLINE_S)
        assert time.monotonic() - t0 < DEADLINE_S + 1.0
        dest = PagedKVCache.allocate(LAYOUT, len(tokens))
        t0 = time.monotonic()
        res = load_records(
            engine, [plan.wrap(tier, keys=keys)], keys, dest,
            LoadOptions(deadline=time.monotonic() + DEADLINE_S),
        )  # fmt: skip
        assert time.monotonic() - t0 < DEADLINE_S + 1.0
        assert res.outcome == "zero" and "did not finish by its deadline" in res.reason, res
        r = Restorer(Store([plan.wrap(tier)]), LAYOUT, engine=engine, model="m", timeout_s=1.0)
        t0 = time.monotonic()
        probed = r.probe(tokens)
        assert time.monotonic() - t0 < 1.0 + 1.0
        assert probed.hit_chunks == 0 and "did not finish" in probed.reason, probed
        assert chunk_keys(tokens, LAYOUT, "m") == keys
