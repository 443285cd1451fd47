"""Progress bars (tqdm) for steps that take more than a second, silenced by `--quiet`.

tqdm is optional (the `cli` extra): without it there are no bars, as when stderr is not
a terminal. Only the CLI imports this module; the restore API never needs tqdm.

`bar()` is for work done in this process. Work done on ranks (child processes whose
output `bsr_io.cli.ranks.launch` captures) reports through small JSON files instead: each
rank's `RankProgress` writes `<dir>/rank<r>.json`, and a `ProgressWatcher` in the
parent polls them and draws one bar per phase, summed over ranks.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Protocol

from bsr_io.model.sizes import fmt_size

__all__ = ["Bar", "ProgressWatcher", "RankProgress", "bar"]

# A bar appears only once its step has run this long; shorter steps print nothing.
DELAY_S = 1.0


class Bar(Protocol):
    """What the CLI uses of a bar: a tqdm bar, or `_NoBar` without tqdm."""

    total: float | None
    n: float

    def update(self, n: float = 1) -> object: ...

    def close(self) -> None: ...

    def __enter__(self) -> Bar: ...

    def __exit__(self, *exc: object) -> object: ...


def bar(
    total: float | None = None,
    desc: str = "",
    *,
    quiet: bool = False,
    unit: str = "B",
    **kw: Any,
) -> Bar:
    """A tqdm bar on stderr; bytes are shown in KiB/MiB/GiB. Disabled when `quiet`, when
    stderr is not a terminal (logs get no carriage-return noise), or without tqdm."""
    cls = byte_bar_class()
    if cls is None:
        return _NoBar(total)
    b: Bar = cls(  # tqdm ships no types (see pyproject.toml): typed here, at the seam
        total=total,
        desc=desc,
        unit=unit,
        disable=True if quiet else None,  # None: only when stderr is a terminal
        delay=DELAY_S,
        leave=False,
        dynamic_ncols=True,
        file=sys.stderr,
        **kw,
    )
    return b


def binary_meter(n: float, total: float | None, elapsed: float, rate: float | None) -> str:
    """A byte bar's figures as the tables print them (fmt_size: KiB, MiB, GiB):
    'done/total [elapsed<left, rate/s]' (no total: 'done [elapsed, rate/s]'). tqdm's own
    unit scaling writes 'MB' and 'G' for binary multiples, and its rate in powers of 1000."""
    if rate is None and elapsed:
        rate = n / elapsed
    speed = f"{fmt_size(round(rate))}/s" if rate else "? B/s"
    if total is None:
        return f"{fmt_size(round(n))} [{_clock(elapsed)}, {speed}]"
    left = _clock((total - n) / rate) if rate else "?"
    return f"{fmt_size(round(n))}/{fmt_size(round(total))} [{_clock(elapsed)}<{left}, {speed}]"


def _clock(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h:d}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


_BYTE_BAR: list[Any] = []  # the tqdm subclass, made on first use (tqdm is optional)


def byte_bar_class() -> Any:
    """tqdm's bar class whose bars in bytes (unit "B") show binary units (`binary_meter`);
    None without tqdm."""
    if _BYTE_BAR:
        return _BYTE_BAR[0]
    try:
        from tqdm import tqdm
    except ModuleNotFoundError:
        return None

    class ByteBar(tqdm):  # type: ignore[misc]  # tqdm is untyped (see pyproject.toml)
        @staticmethod
        def format_meter(n: float, total: float | None, elapsed: float, **kw: Any) -> str:
            if kw.get("unit") != "B":
                out: str = tqdm.format_meter(n, total, elapsed, **kw)
                return out
            desc = kw.get("prefix") or ""
            rate = kw.get("rate")
            if rate is None and elapsed:
                rate = (n - (kw.get("initial") or 0)) / elapsed
            stats = binary_meter(n, total, elapsed, rate)
            postfix = f", {kw['postfix']}" if kw.get("postfix") else ""
            if postfix:
                stats = stats[:-1] + postfix + "]"
            kw.update(unit_scale=False, byte_stats=stats)
            kw["bar_format"] = (
                "{l_bar}{bar}| {byte_stats}" if total else f"{desc}{': ' if desc else ''}{stats}"
            )
            out = tqdm.format_meter(n, total, elapsed, **kw)
            return out

    _BYTE_BAR.append(ByteBar)
    return ByteBar


class _NoBar:
    """What `bar()` gives without tqdm: counts like a bar, draws nothing."""

    def __init__(self, total: float | None = None) -> None:
        self.total = total
        self.n: float = 0

    def update(self, n: float = 1) -> None:
        self.n += n

    def close(self) -> None:
        pass

    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RankProgress:
    """Written by one rank: the current phase, its total and how much is done.

    A `RankProgress(None, rank)` does nothing, so rank code need not check."""

    def __init__(self, directory: str | os.PathLike[str] | None, rank: int) -> None:
        self.path = Path(directory) / f"rank{rank}.json" if directory else None
        self.phase_name = ""
        self.total = 0
        self.done = 0
        self.unit = "B"
        self._seq = 0
        self._last = 0.0
        self._started = time.perf_counter()
        self.durations: dict[str, float] = {}  # seconds each finished phase took

    def phase(self, name: str, total: int, unit: str = "B") -> None:
        now = time.perf_counter()
        if self.phase_name:
            self.durations[self.phase_name] = now - self._started
        self._started = now
        self.phase_name, self.total, self.done, self.unit = name, total, 0, unit
        self._seq += 1
        self._write(force=True)

    def advance(self, n: int) -> None:
        self.done = min(self.total, self.done + n)
        self._write(force=self.done == self.total)

    def finish(self) -> None:
        self.done = self.total
        self._write(force=True)

    def _write(self, force: bool = False) -> None:
        if self.path is None:
            return
        now = time.monotonic()
        if not force and now - self._last < 0.1:
            return
        self._last = now
        doc = {
            "seq": self._seq,
            "phase": self.phase_name,
            "total": self.total,
            "done": self.done,
            "unit": self.unit,
        }
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, self.path)  # readers see the old or the new document, never half


class ProgressWatcher:
    """Draws the ranks' phases as bars until stopped (a context manager)."""

    def __init__(
        self, directory: str | os.PathLike[str], world_size: int, *, quiet: bool = False
    ) -> None:
        self.dir = Path(directory)
        self.world_size = world_size
        self.quiet = quiet
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # (rank, seq) -> (phase, done, total, unit); bars by (seq, phase).
        self._seen: dict[tuple[int, int], tuple[str, int, int, str]] = {}
        self._bars: dict[tuple[int, str], Bar] = {}
        self._finished: set[tuple[int, str]] = set()

    def __enter__(self) -> ProgressWatcher:
        if not self.quiet:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._thread = threading.Thread(target=self._loop, name="bsr-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        for b in self._bars.values():
            b.close()
        self._bars.clear()

    def _read(self) -> None:
        for rank in range(self.world_size):
            try:
                doc = json.loads((self.dir / f"rank{rank}.json").read_text())
            except (OSError, ValueError):
                continue
            seq = int(doc["seq"])
            # A rank that moved on finished its earlier phases.
            for (r, s), (ph, _done, total, unit) in list(self._seen.items()):
                if r == rank and s < seq:
                    self._seen[(r, s)] = (ph, total, total, unit)
            self._seen[(rank, seq)] = (doc["phase"], doc["done"], doc["total"], doc["unit"])

    def _draw(self) -> None:
        sums: dict[tuple[int, str], list[Any]] = {}
        for (_rank, seq), (phase, done, total, unit) in self._seen.items():
            acc = sums.setdefault((seq, phase), [0, 0, unit, 0])
            acc[0] += done
            acc[1] += total
            acc[3] += 1
        for key, (done, total, unit, ranks) in sorted(sums.items()):
            if key in self._finished:
                continue
            finished = ranks == self.world_size and done >= total
            b = self._bars.get(key)
            if b is None and not finished:
                # One bar at a time: a newer phase on any rank ends the older bars.
                for old in [k for k in self._bars if k < key]:
                    self._bars.pop(old).close()
                    self._finished.add(old)
                b = self._bars[key] = bar(total, key[1], unit=unit)
            if b is not None:
                b.total = max(b.total or 0, total)
                if done > b.n:
                    b.update(done - b.n)
                if finished:
                    b.close()
                    del self._bars[key]
            if finished:
                self._finished.add(key)

    def _loop(self) -> None:
        while not self._stop.wait(0.1):
            self._read()
            self._draw()
