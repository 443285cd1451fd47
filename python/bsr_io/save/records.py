"""The one save path: records gathered from a destination through the W slots.

`save_records` extracts each record into a leased slot and writes it (checksummed,
crash-safe); `write_staged` writes records a host already copied into slots. The
`Restorer` and every integration save through them; none keeps a write loop of its own.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor, wait
from contextlib import contextmanager
from typing import TYPE_CHECKING

from bsr_io._core import Engine, Slot
from bsr_io.engine import as_tensor, give_back, lease
from bsr_io.errors import BsrValueError
from bsr_io.load.install import fused_runs, install_scope
from bsr_io.load.kvcache import Destination
from bsr_io.model.layout import KVLayout

if TYPE_CHECKING:
    from bsr_io.model.keys import ChunkKey
    from bsr_io.store import Store
    from bsr_io.tiers.base import Tier


def extract_record(dest: Destination, index: int, slot: Slot, nbytes: int) -> None:
    """Record `index` of `dest` into `slot`'s first `nbytes` bytes (its valid length
    then). A destination in plain host memory (`host_runs`, as for the fused install)
    is gathered in one call that releases the GIL once, inside its install scope; any
    other through `dest.extract`, one copy per run. If that raises, its frames (which
    hold a view of the slot) are dropped from the traceback, their text kept as a
    note: a caller keeping the exception must not keep the view, or the slot could not
    be released."""
    slot.set_length(nbytes)
    where = fused_runs(dest, index)
    if where is not None:
        with install_scope(dest):
            slot.gather(*where)
        return
    try:
        dest.extract(index, as_tensor(slot, length=nbytes))
    except BaseException as exc:
        exc.add_note("extract failed at:\n" + "".join(traceback.format_tb(exc.__traceback__)))
        raise exc.with_traceback(None) from None


def save_records(
    engine: Engine,
    tier: Tier | Store,
    keys: Sequence[ChunkKey],
    layouts: Sequence[KVLayout],
    dest: Destination,
    *,
    deadline: float,
    skip_existing: bool = True,
    width: int | None = None,
    progress: Callable[[int], object] | None = None,
    on_done: Callable[[int, BaseException | None], object] | None = None,
    pace: Callable[[], object] | None = None,
    phases: dict[str, float] | None = None,
    writers: Executor | None = None,
) -> int:
    """Store record i of `dest` (`dest.extract(i, ...)`, `layouts[i].chunk_bytes` bytes)
    as `keys[i]` in `tier`; returns records written. `width` writers each lease one slot,
    gather a record into it and write it (checksummed, crash-safe), so at most `width`
    records are staged and in flight at once; a slot returns to the ring as soon as its
    write is done, failed or not. Slot waits end at `deadline` with EngineBusy.

    `pace()`: called by a writer before each record's copy, and it waits as long as
    `pace` does: a host keeps the work off its own critical moments with it (vLLM's
    CPU worker: while a forward runs).

    `on_done(i, error)`: called once per record (error None when it is stored or was
    already held); with it, one record's failure is reported there and the others go
    on; without it, the first failure raises.

    `phases`: where the writers' time went, added to it in seconds summed over writers
    (`pace`; `slot`: waiting for one; `copy`: the gather; `write`: the tier's whole
    write), so that a slow save says which step was slow.

    `writers`: a host's long-lived writer threads, used instead of `width` new ones
    (their number is then the width, shared by the saves that run at once)."""
    if len(layouts) != len(keys):
        raise BsrValueError(f"{len(layouts)} layouts for {len(keys)} keys")
    width = engine.window if width is None else width
    clock = PhaseClock(phases)

    def write(i: int) -> int:
        if skip_existing and tier.probe([keys[i]]) == 1:
            return 0
        nbytes = layouts[i].chunk_bytes
        if pace is not None:
            with clock("pace"):
                pace()
        with clock("slot"):
            slot = lease(engine, deadline)
        try:
            with clock("copy"):
                extract_record(dest, i, slot, nbytes)
            with clock("write"):
                tier.write(keys[i], slot, layouts[i])
        finally:
            # A put abandoned at its timeout (a pool tier) may still read the slot: it
            # keeps a view, and the slot returns to the ring when that put returns.
            give_back(slot)
            del slot
        return 1

    written = _each(write, len(keys), width, on_done, progress, writers)
    dest.synchronize()
    return written


class PhaseClock:
    """Adds each `with clock(name):` block's seconds to `phases[name]`, from any writer
    thread (nothing without a dict)."""

    def __init__(self, phases: dict[str, float] | None) -> None:
        self.phases = phases
        self._lock = threading.Lock()

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.monotonic()
        try:
            yield
        finally:
            if self.phases is not None:
                with self._lock:
                    self.phases[name] = self.phases.get(name, 0.0) + time.monotonic() - t0


def write_staged(
    tier: Tier | Store,
    keys: Sequence[ChunkKey],
    layouts: Sequence[KVLayout],
    slots: Sequence[Slot],
    *,
    width: int,
    on_done: Callable[[int, BaseException | None], object] | None = None,
) -> int:
    """Write records already gathered into engine slots (`slots[i]` holds record i, its
    length set): for a host whose blocks must be copied out at once (vLLM's sliding-
    window blocks are reused from the next step on) and written later. `width` writes
    in flight; each slot goes back to the ring as soon as its own write ends, failed or
    not. Returns records written; failures as in `save_records`."""
    if not len(keys) == len(layouts) == len(slots):
        raise BsrValueError(f"{len(keys)} keys, {len(layouts)} layouts, {len(slots)} slots")
    held: list[Slot | None] = list(slots)

    def write(i: int) -> int:
        slot, held[i] = held[i], None  # this thread's slot now, and only its
        assert slot is not None
        try:
            return 1 if tier.write(keys[i], slot, layouts[i]) else 0
        finally:
            give_back(slot)
            del slot

    return _each(write, len(keys), width, on_done)


def _each(
    write: Callable[[int], int],
    n: int,
    width: int,
    on_done: Callable[[int, BaseException | None], object] | None,
    progress: Callable[[int], object] | None = None,
    writers: Executor | None = None,
) -> int:
    """`write(i)` for i < n on `width` threads (or on `writers`); the records written.
    With `on_done`, a record's failure goes there and the rest go on; without, the first
    one raises."""

    def one(i: int) -> int:
        if on_done is None:
            return write(i)
        try:
            w = write(i)
        except Exception as exc:  # noqa: BLE001 - handed to the caller's callback
            on_done(i, exc)
            return 0
        on_done(i, None)
        return w

    written = 0
    if n == 0:
        return 0
    if writers is not None:
        # Kept threads, and the caller woken once, when the last record is done: beside
        # vLLM's CPU forward every thread start, exit and wake-up here is a GIL hand-over
        # that the forward thread waits for (docs/vllm.md).
        futures = [writers.submit(one, i) for i in range(n)]
        wait(futures)
        written = sum(f.result() for f in futures)  # without on_done: the first failure
        if progress is not None:
            progress(n)
        return written
    with ThreadPoolExecutor(max_workers=min(width, n), thread_name_prefix="bsr-save") as pool:
        for w in pool.map(one, range(n)):
            written += w
            if progress is not None:
                progress(1)
    return written
