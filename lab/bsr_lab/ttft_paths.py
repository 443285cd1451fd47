"""The paths `bench ttft` times over one state (see bench_ttft): the whole-plan baseline
and its engine-read control, BSR's restore, and fio on both kinds of buffer."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from bsr_io._core import Engine, xxh3_runs
from bsr_io.cli.fio import HugeMem, fio_read, fio_read_payloads
from bsr_io.cli.host import process_cpu_s, vmhwm_bytes, vmhwm_reset
from bsr_io.cli.synthetic import synthetic_chunk, synthetic_tokens
from bsr_io.cli.whole_plan import WholePlanRestorer
from bsr_io.load.kvcache import PagedKVCache
from bsr_io.metrics import RestoreMetrics
from bsr_io.model.keys import chunk_keys
from bsr_io.model.layout import KVLayout
from bsr_io.model.record import HEADER_BYTES
from bsr_io.model.sizes import GiB
from bsr_io.restore import Restorer
from bsr_io.store import Store
from bsr_io.tiers import SSDTier

FIO_DEPTH = 32
MODEL = "bsr-io-bench-ttft"


class TtftPaths:
    """The paths `bench ttft` times over one state: their shared engine, store, keys and
    destination, and one method per path."""

    def __init__(self, args: argparse.Namespace, root: Path, lay: KVLayout) -> None:
        self.args, self.root, self.lay = args, root, lay
        self.chunks: int = args.tokens // lay.chunk_tokens
        self.tokens: int = self.chunks * lay.chunk_tokens
        self.state: int = self.chunks * lay.chunk_bytes
        self.seed = 5
        self.token_ids = synthetic_tokens(self.seed, self.tokens)
        self.keys = chunk_keys(self.token_ids, lay, MODEL, 0, 1)
        # Staging memory is measured, not counted: peak-RSS growth while each path's
        # staging comes to be (the engine's arena here, the whole-plan pool in
        # prepare_whole_plan), plus its growth during each restore.
        h0 = vmhwm_reset()
        self.engine = Engine(args.window, lay.chunk_bytes, backend=args.backend)
        self.arena_vmhwm_bytes = vmhwm_bytes() - h0
        self.pool_vmhwm_bytes = 0
        self.l2 = SSDTier(root / "l2", None, self.engine, layout=lay)
        self.store = Store([self.l2])
        self.metrics = RestoreMetrics()
        self.fast = Restorer(self.store, lay, window=args.window, engine=self.engine, model=MODEL)
        self.dest: PagedKVCache | None = None
        self.whole_plan: dict[str, WholePlanRestorer] = {}
        self.huge = HugeMem(None, "not requested")
        self.fio_file: Path | None = None  # a reference file, where records cannot be read

    def prepare_whole_plan(self) -> None:
        """Both whole-plan paths share one L1 pool of the state, resident before timing."""
        h0 = vmhwm_reset()
        lmc = WholePlanRestorer(
            self.store, self.lay, l1_bytes=self.state, threads=self.args.naive_threads
        )
        lmc.prepare(self.state)
        self.pool_vmhwm_bytes = vmhwm_bytes() - h0
        ctl = WholePlanRestorer(
            self.store,
            self.lay,
            l1_bytes=self.state,
            engine=self.engine,
            reads="engine",
            pool=lmc.pool,
        )
        self.whole_plan = {"naive": lmc, "naive_engine": ctl}

    def naive(self, method: str) -> dict[str, Any]:
        wp = self.whole_plan[method]
        h0 = vmhwm_reset()
        t0 = time.perf_counter()
        plan = self.fast.probe(self.token_ids)
        if plan.hit_chunks != self.chunks:
            raise RuntimeError(f"probe found {plan.hit_chunks} of {self.chunks} chunks")
        assert self.dest is not None
        res = wp.restore(plan, self.dest)
        seconds = time.perf_counter() - t0
        growth = vmhwm_bytes() - h0
        if not res.complete:
            raise RuntimeError(f"{method} failed: {res.reason}")
        parts = {k: res.timings[k] for k in ("stage_s", "install_s")}
        return {
            "seconds": seconds,
            "rws_bytes": res.rws_peak_bytes,
            "vmhwm_growth_bytes": growth,
            **parts,
        }

    def fio(self, method: str) -> dict[str, Any]:
        """fio reading the records' payload ranges (or the reference file)."""
        huge = self.huge if method == "fio_hugemem" else None
        if self.fio_file is not None:
            iomem = huge.iomem("ttft") if huge else None
            res = fio_read(
                self.fio_file, size=self.state, block_bytes=fio_block(self.state), iomem=iomem
            )
        else:
            res = fio_read_payloads(
                self.l2.path_of(self.keys[0]).parent,
                payload_offset=HEADER_BYTES,
                payload_bytes=self.lay.chunk_bytes,
                files=self.chunks,
                iodepth=FIO_DEPTH,
                hugemem=huge,
            )
        seconds = res.seconds or res.wall_s  # under a millisecond fio reports 0
        return {
            "seconds": seconds,
            "gib_s": res.bytes_read / seconds / GiB,
            "bytes_read": res.bytes_read,
            "fio_runtime_s": res.seconds,
            "fio_wall_s": res.wall_s,
        }

    def fast_path(self) -> dict[str, Any]:
        h0 = vmhwm_reset()
        c0 = process_cpu_s()
        t0 = time.perf_counter()
        plan = self.fast.probe(self.token_ids)
        assert self.dest is not None
        res = self.fast.restore(plan, self.dest)
        seconds = time.perf_counter() - t0
        cpu = process_cpu_s() - c0
        growth = vmhwm_bytes() - h0
        self.metrics.observe(res)
        if not res.complete:
            raise RuntimeError(f"fast restore failed: {res.reason}")
        floor = self.hash_floor()
        return {
            "seconds": seconds,
            # This process's user + system CPU: from a drive (DMA, no kernel copy) that is
            # the restore's own cost, the figure that carries over to a faster drive.
            "cpu_s_per_gib": cpu * GiB / self.state,
            "hash_floor_cpu_s_per_gib": floor,
            "direct_chunks": int(res.timings.get("direct_chunks", 0)),
            "rws_bytes": res.rws_peak_bytes,
            "vmhwm_growth_bytes": growth,
            "read_wait_s": res.timings["read_wait_s"],
            "install_copy_s": res.timings["install_copy_s"],
            "commit_s": res.timings["commit_s"],
        }

    def hash_floor(self) -> float:
        """CPU s/GiB of hashing the restored bytes where they lie (`hash_cpu_s`)."""
        assert self.dest is not None
        return hash_cpu_s(self.dest, self.chunks) * GiB / self.state

    def check(self) -> bool:
        """The first and last chunk in the destination are the bytes that were written."""
        dest = self.dest
        assert dest is not None
        return all(
            dest.chunk_bytes(i) == synthetic_chunk(self.lay, self.seed, i).tobytes()
            for i in {0, self.chunks - 1}
        )


def fio_block(size: int) -> int:
    """fio's request size: 1 MiB like the engine's, smaller only for a tiny state."""
    block = 1 << 20
    while block > 4096 and block > size:
        block //= 2
    return block


def records_readable_by_fio(lay: KVLayout) -> bool:
    # O_DIRECT reads whole 4 KiB blocks: fio can read exactly the payload only when its
    # length is a multiple of that (true of the real layouts; not of "tiny").
    return lay.chunk_bytes % 4096 == 0


def hash_cpu_s(dest: PagedKVCache, chunks: int) -> float:
    """CPU seconds of hashing the first `chunks` restored chunks where they lie, chunk by
    chunk, with no read: the least a restore that verifies every byte costs on this core."""
    where = [dest.host_runs(i) for i in range(chunks)]
    t0 = time.thread_time()
    for w in where:
        assert w is not None
        xxh3_runs(*w)
    return time.thread_time() - t0
