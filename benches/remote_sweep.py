"""`bsr-lab bench remote` over the Mooncake tier's data-call settings (threads in flight,
their CPU priority, reads into the destination or through the slots): the measurement
behind the tier's defaults. Each setting is one bench run (its own loopback pool, its
own bulk reference, shuffled paths per round); every run's whole JSON is kept.

Run from the repository root: `python benches/remote_sweep.py --size 1GiB --rounds 3
--json docs/results/remote-sweep.json`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from bsr_io.cli.report import write_json

SETTINGS = [  # (io_threads, io_priority)
    (1, "normal"),
    (2, "normal"),
    (1, "low"),
    (2, "low"),
    (4, "low"),
    (2, "idle"),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--size", default="1GiB")
    ap.add_argument("--window", default="4")
    ap.add_argument("--rounds", default="3")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for threads, priority in SETTINGS:
            out = Path(tmp) / f"{threads}-{priority}.json"
            cmd = [
                sys.executable,
                "-m",
                "bsr_lab.cli",
                "bench",
                "remote",
                "--size",
                args.size,
                "--window",
                args.window,
                "--rounds",
                args.rounds,
                "--io-threads",
                str(threads),
                "--io-priority",
                priority,
                "--json",
                str(out),
            ]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
            doc = json.loads(out.read_text())
            runs.append(doc)
            print(
                f"io_threads {threads}, {priority:6s}: restore {doc['restore_gib_s']:.2f} "
                f"GiB/s, bulk {doc['client_bulk_gib_s']:.2f}: ratio {doc['ratio']:.3f} "
                f"(rounds' median {doc['ratio_median_of_rounds']:.3f}); through the slots "
                f"{doc['ratio_slots']:.3f}; vs bulk from a low-priority thread "
                f"{doc['ratio_vs_bulk_low_median_of_rounds']:.3f}",
                flush=True,
            )
    keys = (
        "io_threads",
        "io_priority",
        "ratio",
        "ratio_median_of_rounds",
        "ratio_min_of_rounds",
        "ratio_slots",
        "restore_gib_s",
        "restore_slots_gib_s",
        "client_bulk_gib_s",
        "client_bulk_low_gib_s",
        "ratio_vs_bulk_low_median_of_rounds",
        "restore_cpu_s_per_gib",
        "bulk_cpu_s_per_gib",
        "restore_read_wait_share",
    )
    summary = [{k: d[k] for k in keys} for d in runs]
    write_json(args.json, {"settings": summary, "runs": runs})


if __name__ == "__main__":
    main()
