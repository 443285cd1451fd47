"""vLLM engine phases (model identity, capacity, a pool below the SSD tier, faults) on
one real engine (test support).

    python -m bsr_lab.vllm.phases run --tp N --work DIR --out R.json [--extra JSON]
    python -m bsr_lab.vllm.phases baseline --tp N --work DIR --out R.json

`run` starts one engine with the connector at tensor-parallel size N (per-rank cap,
Mooncake pool below the SSD tier when `--extra` carries `bsr.mooncake.*` keys, the fault
double from BSR_IO_FAULTS as the caller set it, `faults(N)`) and runs, in order: a read
that hangs, a long save beside a load, several corrupt records in one prompt, a restore
served by the pool, and hot chunks kept by vLLM's local hits while new saves overflow
the cap. Faults and damaged records are on the last rank only: at TP > 1 the other
ranks' loads succeed and vLLM must still recompute the request on every rank. Every
result is per rank (the connector's event log). `baseline` computes the same prompts
without the connector at the same TP. Engines come from the vLLM harness
(vllm_harness.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bsr_lab.vllm import harness as h

C = h.CHUNK_TOKENS
HANG_S = 8.0  # the hung read's stall; the load timeout is 3 s
LOAD_TIMEOUT_S = 3.0
CAP_RECORDS = 40  # store_bytes, in records of this model (one rank)
COMPARED = ("J", "H", "K", "L", "E", "M")


def prompts() -> dict[str, list[int]]:
    hot = h.tokens(80, 10 * C + 17)
    out = {name: h.tokens(60 + i, 10 * C + 17) for i, name in enumerate(COMPARED)}
    out["H"] = h.tokens(66, 12 * C + 17)  # the only prompt with a chunk 11 to hang on
    out["BIG"] = h.tokens(70, 30 * C + 17)
    out["HOT"] = hot
    out["COLD"] = h.tokens(81, 10 * C + 17)
    for i in range(6):
        out[f"HOT{i}"] = hot[: 10 * C] + h.tokens(90 + i, 17)  # vLLM's local hit: 10 chunks
        out[f"FILL{i}"] = h.tokens(100 + i, 10 * C + 17)
    return out


CORRUPT = (2, 5, 7)  # E's records corrupted on disk


def faults(tp: int) -> list[dict[str, Any]]:
    """TEST DOUBLE (BSR_IO_FAULTS), on the last rank only: the first read of request chunk
    11 (prompt H, the first request that long) on the SSD tier hangs; the pool's first
    read of each of E's corrupt chunks fails with EIO, so the load that meets it fails on
    that rank (no good copy anywhere) instead of falling back."""
    last = [tp - 1]
    return [
        {
            "kind": "hang",
            "tier": "L2",
            "chunks": [11],
            "ranks": last,
            "times": 1,
            "delay_s": HANG_S,
        },
    ] + [{"kind": "error", "tier": "L3", "chunks": [c], "ranks": last, "times": 1} for c in CORRUPT]


def record_size(events: h.Events) -> int:
    from bsr_io.model.record import HEADER_BYTES

    return HEADER_BYTES + int(h.groups_of(events)[0]["record_bytes"])


PHASES = ("hang", "save", "corrupt", "pool", "hot")


@dataclass
class Phases:
    """One engine with the connector at TP `tp`, and what its phases found (`out`)."""

    llm: Any
    tp: int
    model: str
    store: str
    events: h.Events
    P: dict[str, list[int]] = field(default_factory=prompts)
    out: dict[str, Any] = field(default_factory=dict)

    def run(self, name: str, save: bool = False, wait_save: bool = True) -> dict[str, Any]:
        """One request: its tokens, vLLM's cached-token count and every rank's load and
        save events (a computed request's saves waited for on every rank)."""
        toks, cached, rid, dt = h.generate(self.llm, self.P[name])
        if save and wait_save:
            done = self.events.wait(rid, "save", self.tp)
            bad = [e for e in done if e["outcome"] != "complete"]
            if bad:
                raise RuntimeError(f"the save of {name} failed: {bad}")
        return {
            "tokens": toks,
            "cached": cached,
            "loads": self.events.of(rid, "load"),
            "saves": self.events.of(rid, "save"),
            "seconds": dt,
            "request_id": rid,
        }

    def path(self, name: str, rank: int, chunk: int) -> str:
        return h.record_path(
            self.events, self.store, self.tp, self.model, self.P[name], rank, chunk
        )


def run_phases(
    model: str, tp: int, work: str, extra: dict[str, Any], phases: tuple[str, ...] = PHASES
) -> dict[str, Any]:
    store = os.path.join(work, "store")
    events = h.Events(os.path.join(work, "events.jsonl"))
    from bsr_io.model.record import HEADER_BYTES

    # One record of the tiny Llama on one rank: 2 layers x K and V x 64 tokens x 2 heads
    # x 64 x bf16, its KV heads split across the TP ranks.
    rec = HEADER_BYTES + 2 * 2 * C * (2 // tp) * 64 * 2
    cfg = {
        **h.FINISH_SAVES,
        "store_dir": store,
        "window": h.WINDOW,
        "chunk_tokens": C,
        "load_timeout_s": LOAD_TIMEOUT_S,
        "save_timeout_s": 600.0,
        "events_path": events.path,
        "store_bytes": CAP_RECORDS * rec,
        **extra,
    }
    llm = h.engine(model, tp, connector=cfg)
    assert record_size(events) == rec, (record_size(events), rec)
    ph = Phases(llm, tp, model, store, events)
    ph.out.update({"tp": tp, "record_bytes": rec})
    if "hang" in phases:
        hang(ph)
    if "save" in phases:
        beside(ph)
    if "corrupt" in phases:
        corrupt(ph)
    if "pool" in phases and any(k.startswith("bsr.mooncake.") for k in extra):
        pool(ph)
    if "hot" in phases:
        hot(ph)
    ph.out["events"] = events.all()
    return ph.out


def hang(ph: Phases) -> None:
    # 1. A read that hangs on the last rank: the request recomputes (on every rank)
    #    within the timeout; once the read returns, saves resume and the next load runs
    #    at the speed of a control load.
    run, out = ph.run, ph.out
    run("J", save=True)
    h.reset(ph.llm)
    out["J"] = run("J")  # a control load
    run("H", save=True)
    h.reset(ph.llm)
    t0 = time.monotonic()
    out["H"] = run("H")
    out["H_wall_s"] = time.monotonic() - t0
    time.sleep(max(0.0, HANG_S + 1.0 - (time.monotonic() - t0)))
    out["K_first"] = run("K", save=True)
    h.reset(ph.llm)
    out["K"] = run("K")


def beside(ph: Phases) -> None:
    # 2. A long save in flight beside a load: L saved, BIG computed (its 30-record save
    #    starts on every rank's save lane), L restored at once, while BIG's save runs.
    run, out = ph.run, ph.out
    run("L", save=True)
    h.reset(ph.llm)
    out["L_control"] = run("L")
    h.reset(ph.llm)
    out["BIG"] = run("BIG", save=True, wait_save=False)
    out["L_beside"] = run("L")
    out["BIG_save"] = ph.events.wait(out["BIG"]["request_id"], "save", ph.tp)
    out["L_beside_end"] = time.time()


def corrupt(ph: Phases) -> None:
    # 3. Three corrupt records in one prompt on the last rank (and that rank's pool copy
    #    of each failing once, fault double): a load stops at the first record it cannot
    #    get, withdrawing it, so each of three requests meets and withdraws the next one
    #    while vLLM recomputes on every rank; the fourth succeeds (the three from the pool).
    last = ph.tp - 1
    ph.run("E", save=True)
    ph.out["E_corrupted"] = [
        h.corrupt_record(ph.events, ph.store, ph.tp, ph.model, ph.P["E"], last, c) for c in CORRUPT
    ]
    ph.out["E_tries"], ph.out["E_quarantine"] = [], []
    for _ in CORRUPT:
        h.reset(ph.llm)
        ph.out["E_tries"].append(ph.run("E"))
        ph.out["E_quarantine"].append(sorted(os.listdir(os.path.join(ph.store, "quarantine"))))
    h.reset(ph.llm)
    ph.out["E_again"] = ph.run("E")


def pool(ph: Phases) -> None:
    # 4. The pool serves a restore when the SSD tier misses: M's SSD records deleted on
    #    every rank.
    ph.run("M", save=True)
    gone = [ph.path("M", r, c) for r in range(ph.tp) for c in range(10)]
    for p in gone:
        os.unlink(p)
    ph.out["M_deleted"] = len(gone)
    h.reset(ph.llm)
    ph.out["M"] = ph.run("M")


def hot(ph: Phases) -> None:
    # 5. Hot chunks: HOT and COLD saved together; HOT's prefix then served by vLLM's
    #    own cache (local hits) between saves that overflow every rank's cap several times.
    run, out = ph.run, ph.out
    run("HOT", save=True)
    run("COLD", save=True)
    out["hot_local"] = []
    for i in range(6):
        out["hot_local"].append(run(f"HOT{i}")["cached"])
        run(f"FILL{i}", save=True)
    out["held"] = {
        name: [[os.path.exists(ph.path(name, r, c)) for c in range(10)] for r in range(ph.tp)]
        for name in ("HOT", "COLD")
    }  # per rank, per chunk
    chunks = os.path.join(ph.store, "chunks")
    by_rank = [0] * ph.tp
    for d in os.listdir(chunks):
        rank = int(d.rsplit("r", 1)[1])  # the namespace ends in -w<W>r<R>
        by_rank[rank] += len(os.listdir(os.path.join(chunks, d)))
    out["rank_records"] = by_rank


def run_baseline(model: str, tp: int) -> dict[str, list[int]]:
    llm = h.engine(model, tp, connector=None)
    P = prompts()
    return {name: h.generate(llm, P[name])[0] for name in COMPARED}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bsr_lab.vllm.phases")
    ap.add_argument("what", choices=["run", "baseline"])
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--work", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--extra", default="{}")
    ap.add_argument("--phases", default=",".join(PHASES))
    args = ap.parse_args(argv)
    os.makedirs(args.work, exist_ok=True)
    model = os.path.abspath(h.write_tiny_llama(os.path.join(args.work, "..", "model-l2")))
    if args.what == "run":
        phases = tuple(args.phases.split(","))
        result: Any = {
            "model": model,
            **run_phases(model, args.tp, args.work, json.loads(args.extra), phases),
        }
    else:
        result = {"model": model, "outputs": run_baseline(model, args.tp)}
    Path(args.out).write_text(json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
