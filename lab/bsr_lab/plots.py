"""Figures from benchmark JSON (matplotlib, written as PNG without a display).

- `plot_sweep(doc, path)`: staging bytes against state size for BSR and the whole-plan
  baseline (the paper's figure), from the JSON of `bsr-lab bench sweep`.
- `plot_ttft(doc, path)`: restore time of the naive path, the fast path and fio, and the
  two paths' staging peaks, from the JSON of `bsr-lab bench ttft`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bsr_io.model.sizes import GiB, MiB

if TYPE_CHECKING:
    from types import ModuleType

    from matplotlib.figure import Figure

__all__ = ["plot_sweep", "plot_ttft"]


def _pyplot() -> ModuleType:
    """matplotlib.pyplot, on the Agg backend."""
    import matplotlib

    matplotlib.use("Agg", force=True)  # files only; never needs a display
    import matplotlib.pyplot as plt

    return plt


def _need(doc: Mapping[str, Any], keys: tuple[str, ...], what: str) -> None:
    if not isinstance(doc, Mapping):
        raise ValueError(f"{what}: expected a JSON object, got {type(doc).__name__}")
    missing = [k for k in keys if k not in doc]
    if missing:
        raise ValueError(f"{what}: missing {', '.join(missing)}")


def _save(fig: Figure, path: str | os.PathLike[str]) -> Path:
    out = Path(path)
    if out.suffix.lower() != ".png":
        raise ValueError(f"plots are written as PNG; {out} does not end in .png")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=130, bbox_inches="tight")
    return out


def _size_label(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.0f} MiB"


def plot_sweep(doc: Mapping[str, Any], path: str | os.PathLike[str]) -> Path:
    """Staging bytes per rank against state bytes per rank: BSR's RWS stays at the window
    while the whole-plan baseline's L1 peak grows with the state."""
    _need(doc, ("rows", "window", "chunk_bytes"), "sweep document")
    rows = sorted(doc["rows"], key=lambda r: r["state_bytes"])
    if not rows:
        raise ValueError("sweep document has no rows to plot")
    for r in rows:
        _need(r, ("state_bytes", "rws_peak_bytes", "whole_plan_l1_peak_bytes"), "sweep row")
    plt = _pyplot()
    state = [r["state_bytes"] / GiB for r in rows]
    rws = [r["rws_peak_bytes"] / GiB for r in rows]
    wp = [r["whole_plan_l1_peak_bytes"] / GiB for r in rows]
    measured = [r.get("whole_plan_measured", True) for r in rows]
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    ax.plot(state, wp, color="#c0392b", lw=2, label="whole-plan: L1 staging peak")
    ax.scatter(
        [s for s, m in zip(state, measured, strict=True) if m],
        [w for w, m in zip(wp, measured, strict=True) if m],
        color="#c0392b",
        zorder=3,
        label="whole-plan, measured",
    )
    if not all(measured):
        ax.scatter(
            [s for s, m in zip(state, measured, strict=True) if not m],
            [w for w, m in zip(wp, measured, strict=True) if not m],
            facecolors="white",
            edgecolors="#c0392b",
            zorder=3,
            label="whole-plan, L1 it needed (not run)",
        )
    wp_rss = [(s, r.get("whole_plan_vmhwm_growth_bytes")) for s, r in zip(state, rows, strict=True)]
    wp_rss = [(s, v / GiB) for s, v in wp_rss if v is not None]
    if wp_rss:
        ax.plot(
            *zip(*wp_rss, strict=True),
            color="#c0392b",
            lw=1,
            ls="--",
            marker=".",
            label="whole-plan: process peak RSS growth (VmHWM)",
        )
    ax.plot(state, rws, color="#1f6fb2", lw=2, marker="o", label="BSR: RWS peak (measured)")
    if all("vmhwm_growth_bytes" in r for r in rows):
        ax.plot(
            state,
            [r["vmhwm_growth_bytes"] / GiB for r in rows],
            color="#1f6fb2",
            lw=1,
            ls="--",
            marker=".",
            label="BSR: process peak RSS growth (VmHWM)",
        )
    bound = doc["window"] * doc["chunk_bytes"]
    ax.axhline(
        bound / GiB, color="#7f8c8d", lw=1, ls=":", label=f"W x chunk = {_size_label(bound)}"
    )
    last = rows[-1]
    if last["rws_peak_bytes"]:
        ratio = last["state_bytes"] / last["rws_peak_bytes"]
        ax.annotate(
            f"state / RWS = {ratio:.1f}x",
            xy=(state[-1], rws[-1]),
            xytext=(0, 14),
            textcoords="offset points",
            ha="right",
            color="#1f6fb2",
        )
    ax.set_xlabel("KV state per rank (GiB)")
    ax.set_ylabel("host staging per rank (GiB)")
    ranks = doc.get("ranks")
    title = f"{doc.get('layout', '')}: staging vs state, W={doc['window']}"
    if ranks:
        title += f", {ranks} rank(s)"
    ax.set_title(title)
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    out = _save(fig, path)
    plt.close(fig)
    return out


def plot_ttft(doc: Mapping[str, Any], path: str | os.PathLike[str]) -> Path:
    """Bars: seconds to a committed prefix (naive, fast) and fio reading the same bytes;
    beside them, each path's staging peak."""
    keys = ("naive_s", "fast_s", "fio_s", "rws_naive_bytes", "rws_fast_bytes", "state_bytes")
    # naive_s may be None (`--skip-naive`): then only fast and fio are drawn.
    _need(doc, keys, "ttft document")
    plt = _pyplot()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.4), gridspec_kw={"width_ratios": [4, 2]})
    bars_all = [
        ("naive\n(whole-plan,\nbuffered\nreadinto)", doc["naive_s"], "#c0392b"),
        ("whole-plan\nvia engine\n(control)", doc.get("naive_engine_s"), "#e67e22"),
        ("fast\n(BSR, engine)", doc["fast_s"], "#1f6fb2"),
        ("fio\n4 KiB pages", doc["fio_s"], "#95a5a6"),
        ("fio\nhuge pages", doc.get("fio_hugemem_s"), "#596566"),
    ]
    naive = doc["naive_s"] is not None
    names = [n for n, s, _ in bars_all if s is not None]
    secs = [s for _, s, _ in bars_all if s is not None]
    colors = [c for _, s, c in bars_all if s is not None]
    bars = ax.bar(names, secs, color=colors)
    for b, s in zip(bars, secs, strict=True):
        rate = doc["state_bytes"] / s / GiB if s else 0.0
        ax.annotate(
            f"{s:.2f} s\n{rate:.2f} GiB/s",
            xy=(b.get_x() + b.get_width() / 2, s),
            xytext=(0, 3),
            textcoords="offset points",
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_ylabel("seconds to a committed prefix (cold cache)")
    ax.set_ylim(0, max(secs) * 1.25)
    ref = doc.get("fio_hugemem_s") or doc["fio_s"]
    vs_fio = doc["fast_s"] / ref
    which = "fio huge pages" if doc.get("fio_hugemem_s") else "fio"
    if naive:
        ax.set_title(
            f"speedup naive/fast {doc['naive_s'] / doc['fast_s']:.2f}x, fast/{which} {vs_fio:.2f}",
            fontsize=9,
        )
    else:
        ax.set_title(f"fast/{which} {vs_fio:.2f} (naive path not run)", fontsize=9)
    peaks = [doc["rws_naive_bytes"] / GiB, doc["rws_fast_bytes"] / GiB]
    pb = ax2.bar(
        ["naive" if naive else "naive\n(L1 it needs)", "fast"],
        peaks,
        color=["#c0392b", "#1f6fb2"],
        hatch=["" if naive else "//", ""],
    )
    for b, p in zip(pb, peaks, strict=True):
        ax2.annotate(
            _size_label(p * GiB),
            xy=(b.get_x() + b.get_width() / 2, p),
            xytext=(0, 3),
            textcoords="offset points",
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax2.set_ylabel("host staging peak (GiB)")
    ax2.set_ylim(0, max(peaks) * 1.2)
    ax2.set_title("staging")
    tokens = doc.get("tokens")
    head = f"{doc.get('layout', '')}"
    if tokens:
        head += f", {tokens:,} tokens"
    head += f", {_size_label(doc['state_bytes'])}"
    if "window" in doc:
        head += f", W={doc['window']}"
    fig.suptitle(f"restore latency: {head}", fontsize=10)
    for a in (ax, ax2):
        a.grid(True, axis="y", alpha=0.3)
    out = _save(fig, path)
    plt.close(fig)
    return out
