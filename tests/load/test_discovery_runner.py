"""Discovery's deadline wait runs on kept runner threads (tiers/files/bounded.py), not
on a thread started per probe: a stalled probe holds its runner, never the next probe,
and what the probe's own calls raise reaches the caller as it was raised."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from bsr_io import Engine
from bsr_io.cli.synthetic import fill_state
from bsr_io.faults import Fault, FaultPlan
from bsr_io.load import discovery
from bsr_io.load.discovery import DiscoveryTimedOut, sources_of
from bsr_io.model.layout import preset
from bsr_io.restore import Restorer
from bsr_io.store import Store
from bsr_io.tiers import SSDTier

LAYOUT = preset("tiny")


def test_probes_start_no_thread_each(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Twenty probes in a row start at most one thread (a runner, kept): before, each
    probe started one, which cost more than a one-chunk probe's own work."""
    engine = Engine(2, LAYOUT.chunk_bytes)
    tier = SSDTier(tmp_path / "l2", None, engine)
    tokens, _ = fill_state(tier, LAYOUT, LAYOUT.chunk_tokens, seed=2, model="m")
    r = Restorer(Store([tier]), LAYOUT, engine=engine, model="m")
    assert r.probe(tokens).hit_chunks == 1  # a runner kept from here on
    started: list[str] = []
    start = threading.Thread.start

    def counted(self: threading.Thread) -> None:  # a test double: counts, then starts
        started.append(self.name)
        start(self)

    monkeypatch.setattr(threading.Thread, "start", counted)
    assert all(r.probe(tokens).hit_chunks == 1 for _ in range(20))
    assert len(started) <= 1, started


def test_a_stalled_probe_holds_its_runner_not_the_next(tmp_path: Path) -> None:
    """A probe stalled in a metadata call (fault double: 'hang_probe') ends at its
    deadline; the probe after it, of a healthy tier, gets its answer from another
    runner while the stalled one is still held."""
    engine = Engine(2, LAYOUT.chunk_bytes)
    tier = SSDTier(tmp_path / "l2", None, engine)
    _, keys = fill_state(tier, LAYOUT, LAYOUT.chunk_tokens * 2, seed=2, model="m")
    hung = FaultPlan([Fault("hang_probe", chunks=frozenset({0}), delay_s=3.0)]).wrap(
        tier, keys=keys
    )
    with pytest.raises(DiscoveryTimedOut):
        sources_of([hung], keys, time.monotonic() + 0.2)
    assert sources_of([tier], keys, time.monotonic() + 30.0) == [0, 0]


def test_a_timeout_the_probe_raises_is_not_its_deadline() -> None:
    """A TimeoutError from the work itself (a tier's own wait) is raised as it is, well
    before the deadline; only the deadline passing is DiscoveryTimedOut."""

    def times_out() -> None:
        raise TimeoutError("the tier's own wait")

    with pytest.raises(TimeoutError, match="the tier's own wait") as got:
        discovery._by(time.monotonic() + 30.0, "discovery", times_out)
    assert not isinstance(got.value, DiscoveryTimedOut)
    assert discovery._by(time.monotonic() + 30.0, "discovery", lambda: 7) == 7
