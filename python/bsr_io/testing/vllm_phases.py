"""Issue 19's remaining vLLM tests as phases of one real engine (test support).

    python -m bsr_io.testing.vllm_phases run --work DIR --out R.json [--extra JSON]
    python -m bsr_io.testing.vllm_phases baseline --work DIR --out R.json

`run` starts one engine with the connector (per-rank cap, Mooncake pool below the SSD
tier when `--extra` carries `bsr.mooncake.*` keys, the fault double from BSR_IO_FAULTS
as the caller set it) and runs, in order: a read that hangs, a long save beside a load,
several corrupt records in one load, a restore served by the pool, and hot chunks kept
by vLLM's local hits while new saves overflow the cap. `baseline` computes the same
prompts without the connector. Engines come from the vLLM harness
(vllm_harness.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from bsr_io.testing import vllm_harness as h

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


def faults() -> list[dict[str, Any]]:
    """TEST DOUBLE (BSR_IO_FAULTS): the first read of request chunk 11 (prompt H, the only
    one that long) on the SSD tier hangs; the pool's first reads at E's corrupt chunks
    fail with EIO, so E's load fails (no good copy anywhere) instead of falling back."""
    return [
        {"kind": "hang", "tier": "L2", "chunks": [11], "times": 1, "delay_s": HANG_S},
        {"kind": "error", "tier": "L3", "chunks": list(CORRUPT), "times": len(CORRUPT)},
    ]


def record_size(events: h.Events) -> int:
    from bsr_io.record import HEADER_BYTES

    return HEADER_BYTES + int(h.groups_of(events)[0]["record_bytes"])


PHASES = ("hang", "save", "corrupt", "pool", "hot")


def run_phases(model: str, work: str, extra: dict[str, Any],
               phases: tuple[str, ...] = PHASES) -> dict[str, Any]:  # fmt: skip
    store = os.path.join(work, "store")
    events = h.Events(os.path.join(work, "events.jsonl"))
    from bsr_io.record import HEADER_BYTES

    # One record of the tiny Llama: 2 layers x K and V x 64 tokens x 2 heads x 64 x bf16.
    rec = HEADER_BYTES + 2 * 2 * C * 2 * 64 * 2
    cfg = {"store_dir": store, "window": h.WINDOW, "chunk_tokens": C,
           "load_timeout_s": LOAD_TIMEOUT_S, "save_timeout_s": 600.0,
           "events_path": events.path, "store_bytes": CAP_RECORDS * rec, **extra}  # fmt: skip
    llm = h.engine(model, 1, connector=cfg)
    assert record_size(events) == rec, (record_size(events), rec)
    P = prompts()
    out: dict[str, Any] = {"record_bytes": rec}

    def run(name: str, save: bool = False, wait_save: bool = True) -> dict[str, Any]:
        toks, cached, rid, dt = h.generate(llm, P[name])
        if save and wait_save:
            done = events.wait(rid, "save", 1)
            bad = [e for e in done if e["outcome"] != "complete"]
            if bad:
                raise RuntimeError(f"the save of {name} failed: {bad}")
        return {"tokens": toks, "cached": cached, "loads": events.of(rid, "load"),
                "saves": events.of(rid, "save"), "seconds": dt, "request_id": rid}  # fmt: skip

    # 1. A read that hangs: the request recomputes within the timeout; once the read
    #    returns, saves resume and the next load runs at the speed of a control load.
    if "hang" in phases:
        hang(run, llm, out)
    if "save" in phases:
        beside(run, llm, out, events)
    if "corrupt" in phases:
        corrupt(run, llm, out, events, store, model, P)
    if "pool" in phases and any(k.startswith("bsr.mooncake.") for k in extra):
        pool(run, llm, out, events, store, model, P)
    if "hot" in phases:
        hot(run, llm, out, events, store, model, P)
    out["events"] = events.all()
    return out


def hang(run: Any, llm: Any, out: dict[str, Any]) -> None:
    run("J", save=True)
    h.reset(llm)
    out["J"] = run("J")  # a control load
    run("H", save=True)
    h.reset(llm)
    t0 = time.monotonic()
    out["H"] = run("H")
    out["H_wall_s"] = time.monotonic() - t0
    time.sleep(max(0.0, HANG_S + 1.0 - (time.monotonic() - t0)))
    out["K_first"] = run("K", save=True)
    h.reset(llm)
    out["K"] = run("K")


def beside(run: Any, llm: Any, out: dict[str, Any], events: h.Events) -> None:
    # 2. A long save in flight beside a load: L saved, BIG computed (its 30-record save
    #    starts on the save lane), L restored at once, while BIG's save runs.
    run("L", save=True)
    h.reset(llm)
    out["L_control"] = run("L")
    h.reset(llm)
    out["BIG"] = run("BIG", save=True, wait_save=False)
    out["L_beside"] = run("L")
    out["BIG_save"] = events.wait(out["BIG"]["request_id"], "save", 1)
    out["L_beside_end"] = time.time()


def corrupt(run: Any, llm: Any, out: dict[str, Any], events: h.Events, store: str, model: str,
            P: dict[str, list[int]]) -> None:  # fmt: skip
    # 3. Three corrupt records in one load (and the pool's copies failing, fault double):
    #    the load fails, every corrupt record is quarantined by it, and the next request
    #    succeeds (the three from the pool).
    run("E", save=True)
    out["E_corrupted"] = [
        h.corrupt_record(events, store, 1, model, P["E"], 0, c) for c in CORRUPT
    ]  # fmt: skip
    h.reset(llm)
    out["E"] = run("E")
    out["E_quarantine"] = sorted(os.listdir(os.path.join(store, "quarantine")))
    h.reset(llm)
    out["E_again"] = run("E")


def pool(run: Any, llm: Any, out: dict[str, Any], events: h.Events, store: str, model: str,
         P: dict[str, list[int]]) -> None:  # fmt: skip
    # 4. The pool serves a restore when the SSD tier misses: M's SSD records deleted.
    run("M", save=True)
    gone = [h.record_path(events, store, 1, model, P["M"], 0, c) for c in range(10)]
    for p in gone:
        os.unlink(p)
    out["M_deleted"] = len(gone)
    h.reset(llm)
    out["M"] = run("M")


def hot(run: Any, llm: Any, out: dict[str, Any], events: h.Events, store: str, model: str,
        P: dict[str, list[int]]) -> None:  # fmt: skip
    # 5. Hot chunks: HOT and COLD saved together; HOT's prefix then served by vLLM's
    #    own cache (local hits) between saves that overflow the cap several times.
    run("HOT", save=True)
    run("COLD", save=True)
    out["hot_local"] = []
    for i in range(6):
        out["hot_local"].append(run(f"HOT{i}")["cached"])
        run(f"FILL{i}", save=True)
    held = {}
    for name in ("HOT", "COLD"):
        held[name] = [os.path.exists(h.record_path(events, store, 1, model, P[name], 0, c))
                      for c in range(10)]  # fmt: skip
    out["held"] = held
    out["rank_records"] = sum(
        len(os.listdir(os.path.join(store, "chunks", d)))
        for d in os.listdir(os.path.join(store, "chunks"))
    )


def run_baseline(model: str) -> dict[str, list[int]]:
    llm = h.engine(model, 1, connector=None)
    P = prompts()
    return {name: h.generate(llm, P[name])[0] for name in COMPARED}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bsr_io.testing.vllm_phases")
    ap.add_argument("what", choices=["run", "baseline"])
    ap.add_argument("--work", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--extra", default="{}")
    ap.add_argument("--phases", default=",".join(PHASES))
    args = ap.parse_args(argv)
    os.makedirs(args.work, exist_ok=True)
    model = os.path.abspath(h.write_tiny_llama(os.path.join(args.work, "..", "model-l2")))
    if args.what == "run":
        result: Any = {
            "model": model,
            **run_phases(model, args.work, json.loads(args.extra), tuple(args.phases.split(","))),
        }
    else:
        result = {"model": model, "outputs": run_baseline(model)}
    Path(args.out).write_text(json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
