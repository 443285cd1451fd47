"""Cost of one engine open+close against one cold 16 MiB chunk read of the same file.

Run from the repository root as root (to drop caches): `python benches/open_cost.py`.
It is the measurement behind one file per chunk record in the L2 tier.
"""

import os
import time

from bsr_io import Engine
from bsr_io.cli.fio import drop_caches

CHUNK = 16_408_576  # one deepseek-v4-flash chunk
PATH = "open-cost.bin"

with Engine(1, CHUNK) as engine:
    f = engine.open(PATH, create=True)
    slot = engine.lease()
    slot.set_length(CHUNK)
    engine.write(slot, f, 0)
    del slot
    f.sync()
    f.close()
    t = time.perf_counter()
    for _ in range(2000):
        engine.open(PATH).close()
    open_close = (time.perf_counter() - t) / 2000
    reads = []
    for _ in range(10):
        drop_caches()
        f = engine.open(PATH)
        t = time.perf_counter()
        slot = engine.read(f, 0, CHUNK)
        reads.append(time.perf_counter() - t)
        del slot
        f.close()
os.unlink(PATH)
read = sorted(reads)[len(reads) // 2]
print(
    f"open+close {open_close * 1e6:.1f} us; cold 16 MiB read median {read * 1e3:.2f} ms; "
    f"ratio {open_close / read * 100:.3f}%"
)
