"""Memory measured, not counted: an engine and a retrieve through bsr-io's plugin grow
the process's resident set (VmHWM) by a few windows, where LMCache's own retrieve over
the same records stages the whole state in L1.

Each retrieve runs in a fresh process over records stored beforehand (the plugin's SSD
tier outlives its engine). The destination (the stood-in GPU's KV tensors) and the
source state for the data check are touched before the baseline; the LMCache engine is
built after it, since its L1 pool is resident from its start: LMCache's own retrieve
needs an L1 that holds the whole state, bsr-io's bounded retrieve one of 2 W chunks.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

MiB = 1 << 20
N_CHUNKS = 160
WINDOW = 2
SHAPE_KW = {"num_layers": 8}  # 1 MiB chunks: a 160 MiB state
START_UP = 48 * MiB  # an LMCache engine's own start (threads, event loop): ~37 MiB here


def _retrieve(path: str, bounded: bool) -> dict[str, object]:
    """In this (fresh) process: build an LMCache engine with the plugin over the stored
    records and retrieve them once; VmHWM growth from before the engine existed."""
    import logging

    from bsr_io.cli.host import vmhwm_bytes, vmhwm_reset
    from bsr_io.integrations.lmcache.config import lmcache_settings
    from bsr_lab.lmcache import harness as h

    logging.disable(logging.WARNING)
    shape = h.Shape(**SHAPE_KW)
    src = h.make_state(shape, N_CHUNKS, seed=3)
    dst = h.empty_like(src)
    for t in dst.kvcaches:
        t.fill_(1)  # the destination's pages resident before the baseline
    engines = h.Engines(shape)
    try:
        # LMCache's L1 pool is resident from the engine's start, so it counts: the stock
        # retrieve needs L1 to hold the state (a smaller one hangs), bsr-io's two windows.
        l1 = 2 * WINDOW if bounded else N_CHUNKS + 4
        settings = lmcache_settings(path, window=WINDOW, bounded_retrieve=bounded)
        base = vmhwm_reset()
        eng = engines(l1_chunks=l1, settings=settings)
        mask = eng.retrieve(src.tokens, **dst.kwargs())
        growth = vmhwm_bytes() - base
        return {
            "complete": bool(mask.all()),
            "data_ok": h.restored_equal(src, dst, len(src.tokens)),
            "growth": growth,
            "state": N_CHUNKS * shape.chunk_bytes,
            "chunk": shape.chunk_bytes,
            "l1_chunks": l1,
        }
    finally:
        engines.close()


def _child(path: Path, bounded: bool) -> dict[str, object]:
    proc = subprocess.run(
        [sys.executable, __file__, str(path), "1" if bounded else "0"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0:
        raise AssertionError(f"child failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_bounded_retrieve_grows_by_its_window_where_stock_stages_the_state(tmp_path):
    pytest.importorskip("lmcache")
    from bsr_io.integrations.lmcache.config import lmcache_settings
    from bsr_lab.lmcache import harness as h

    shape = h.Shape(**SHAPE_KW)
    engines = h.Engines(shape)
    try:
        eng = engines(l1_chunks=8, settings=lmcache_settings(tmp_path, window=WINDOW))
        h.store_windowed(eng, h.make_state(shape, N_CHUNKS, seed=3), 4)
        eng.storage_manager.storage_backends["bsr"].flush()
    finally:
        engines.close()
    bsr = _child(tmp_path, bounded=True)
    assert bsr["complete"] and bsr["data_ok"], bsr
    # Control: LMCache's own retrieve over the same plugin stages every chunk in L1.
    stock = _child(tmp_path, bounded=False)
    assert stock["complete"] and stock["data_ok"], stock
    state, chunk = int(stock["state"]), int(stock["chunk"])
    assert int(stock["growth"]) >= state, stock
    # bsr-io: its L1 of 2 W chunks, the plugin's read and write engines (W slots each),
    # and the engine's own start-up; never the state.
    assert int(bsr["growth"]) <= 4 * WINDOW * chunk + START_UP, (bsr, stock)


if __name__ == "__main__":
    print(json.dumps(_retrieve(sys.argv[1], sys.argv[2] == "1")))
