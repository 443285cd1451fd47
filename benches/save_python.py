"""What a record's save costs beyond the engine's own publish: the Python around it.

Run from the repository root: `python benches/save_python.py [--json PATH]`. A vLLM
worker's step cuts write from threads that share the GIL with the forward thread, and
every microsecond of Python they run is one the forward may wait for. This times
`SSDTier.write` of small records (the Python of a save is the same at any size) on a
RAM-backed store with the flushes off, against the reference measured in the same run:
the engine's `publish` of the same bytes alone (creation, write, rename: the native
call the tier ends in), pass by pass, best of several passes each. The difference is what a save
adds per record: its Python, with the already-stored check's two lstats and the small
record's checksum (both native, a few microseconds).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

from bsr_io import Engine
from bsr_io.cli.report import write_json
from bsr_io.model.keys import chunk_keys
from bsr_io.model.layout import preset
from bsr_io.model.record import make_header
from bsr_io.tiers.ssd import SSDTier

LAYOUT = preset("tiny")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--records", type=int, default=2000, help="records per pass")
    p.add_argument("--passes", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    root = tempfile.mkdtemp(prefix="bsr-save-python-", dir=base)
    tier_us, raw_us = [], []
    try:
        engine = Engine(4, max(LAYOUT.chunk_bytes, 1 << 20))
        tier = SSDTier(os.path.join(root, "tier"), None, engine, layout=LAYOUT, durable=False)
        raw_dir = os.path.join(root, "raw")
        os.makedirs(raw_dir)
        slot = engine.lease()
        slot.set_length(LAYOUT.chunk_bytes)
        head = make_header(chunk_keys([0] * LAYOUT.chunk_tokens, LAYOUT, "m")[0], LAYOUT, 0)
        encoded = head.encode()
        for n in range(args.passes):
            tokens = [n] + list(range(args.records * LAYOUT.chunk_tokens))
            keys = chunk_keys(tokens, LAYOUT, "save-python")
            t = time.perf_counter()
            for k in keys:
                tier.write(k, slot, LAYOUT)
            tier_us.append((time.perf_counter() - t) / len(keys) * 1e6)
            t = time.perf_counter()
            for i in range(len(keys)):
                final = f"{raw_dir}/{n}-{i}.chunk"
                engine.publish(
                    slot, final + ".tmp", final, encoded, LAYOUT.chunk_bytes, durable=False
                )
            raw_us.append((time.perf_counter() - t) / len(keys) * 1e6)
        del slot
        engine.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    tier_best, raw_best = min(tier_us), min(raw_us)
    doc = {
        "bench": "save_python",
        "ran": f"CPU only; {LAYOUT.name} records of {LAYOUT.chunk_bytes} bytes on a "
        f"store in {base or tempfile.gettempdir()}, durable off; best of the passes",
        "records_per_pass": args.records,
        "tier_write_us": tier_best,
        "engine_publish_us": raw_best,
        "python_us_per_record": tier_best - raw_best,
        "tier_vs_publish": tier_best / raw_best,
        "passes": {"tier_write_us": tier_us, "engine_publish_us": raw_us},
    }
    print(
        f"tier write {tier_best:.1f} us/record, engine publish alone {raw_best:.1f} us: "
        f"{tier_best - raw_best:.1f} us a record beyond it ({tier_best / raw_best:.2f}x)"
    )
    write_json(args.json, doc)


if __name__ == "__main__":
    main()
