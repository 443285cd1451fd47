"""`bsr-lab bench serve --write-stall SECONDS[:EVERY]`: holds measured under load (issue 50,
item 8). The bsr-io server's store is served through the kernel's FUSE with the first write
of each record's temp file answered late (tests/fuse_stall.py's `late_dir`): a real kernel
stall, not a double of the connector. The smoke run is the bench's smallest (one round,
a few prompts, two servers); the measured run is the lead's, on a quiet machine."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest
from fuse_stall import late_dir

from bsr_lab.bench import serve
from bsr_lab.bench.serve_pool import load_run

needs_fuse = pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists("/dev/fuse"), reason="FUSE needs root and /dev/fuse"
)
STALL_S = 2.0


def _args(*extra: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    serve.register(p.add_subparsers())
    return p.parse_args(["serve", *extra])


def _mounted(path: Path) -> bool:
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == str(path) for line in f)


@pytest.mark.parametrize("spec", ["0", "-1", "two", "2:0", "2:x"])
def test_a_bad_stall_is_refused_before_any_server(tmp_path: Path, capsys, spec: str) -> None:
    args = _args("--write-stall", spec, "--dir", str(tmp_path), "--rounds", "1")
    assert serve.run(args) == 2
    assert "--write-stall" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # no model written, no server started


@needs_fuse
def test_every_nth_file_has_its_first_write_held_once(tmp_path: Path) -> None:
    """The bench's stall: one held write per record (its first), on every EVERY-th record,
    each logged by the FUSE server; other files' writes pass at once."""
    store, log = tmp_path / "store", tmp_path / "held.tsv"
    store.mkdir()
    with late_dir(store, 0.2, ["write"], ".tmp", every=2, per_file=True, log=log) as late:
        for i in range(4):
            fd = os.open(store / f"r{i}.tmp", os.O_WRONLY | os.O_CREAT, 0o644)
            try:
                for _ in range(3):
                    os.write(fd, b"x" * 4096)
            finally:
                os.close(fd)
        with open(store / "other", "wb") as f:
            f.write(b"y")
        held = late.held()
    assert sorted(p for _, p, _ in held) == ["r1.tmp", "r3.tmp"], held
    assert all(op == "write" and s > 0 for op, _, s in held), held
    assert all((store / f"r{i}.tmp").stat().st_size == 3 * 4096 for i in range(4))


@needs_fuse
def test_stalled_writes_hold_requests_under_load(vllm_root: Path) -> None:
    """One round with every record's write held STALL_S in the kernel and a save window of
    one slot: cuts queue behind the stalled write, so requests vLLM finished are held
    until their cuts copy. The FUSE server saw the writes it held, the JSON reports the
    holds, the cuts by outcome and what they cost against the reference, and the mount is
    gone after the run. Fails with the stall's wiring removed (no held writes, no holds)."""
    work = vllm_root / "serve-stall"
    out = work / "serve.json"
    args = _args(
        "--write-stall", f"{STALL_S:g}",
        "--set", "window=1",
        "--rounds", "1", "--saturated", "3", "--concurrency", "2", "--misses", "1",
        "--users", "2", "--turns", "1", "--doc-chunks", "2", "--miss-chunks", "2",
        "--chunk", "64", "--max-tokens", "4", "--kv-blocks", "32", "--hidden", "128",
        "--layers", "2", "--no-control", "--cached-kv-blocks", "0",
        "--dir", str(work), "--json", str(out),
    )  # fmt: skip
    assert serve.run(args) == 0
    doc = json.loads(out.read_text())
    # The rounds went beside the JSON, where serve-pool finds them.
    assert "rounds" not in doc and doc["rounds_file"] == "serve.trace.json.gz", doc.keys()
    assert len(load_run(out)["rounds"]["bsr_io"]) == 1
    assert doc["bsr_io"]["rss_mib_max"] > 0, doc["bsr_io"]
    ws = doc["write_stall"]
    assert (ws["seconds"], ws["every"]) == (STALL_S, 1)
    # The stall was real: the FUSE server held record writes, and finished requests waited.
    assert ws["writes_held"]["n"] > 0, ws
    assert ws["holds"]["n"] > 0, ws
    assert set(ws["holds"]) >= {"n", "p50", "p90", "max", "short"}, ws
    for saves in (ws["cuts"], ws["finish_saves"]):
        assert set(saves) == {"by_outcome", "unwritten_by_reason"}, ws
    assert sum(ws["cuts"]["by_outcome"].values()) > 0, ws
    for ph in serve.PHASES:
        assert set(ws["vs_baseline"][ph]) == {"throughput_ratio", "ttft_p50_ratio"}, ws
        assert ws["vs_baseline"][ph]["throughput_ratio"] is not None, ws
    assert doc["bsr_io"]["holds"]["n"] == ws["holds"]["n"]
    # bsr-io's engine was waited for after its warm-up and its round, before another server.
    assert len(ws["drain_s"]) == 2, ws
    # Ended with the run: no mount left on the store, the store removed.
    assert not _mounted((work / "store").resolve())
    assert not (work / "store").exists()
