"""Restore traces: where a restored request's time goes inside vLLM, step by step.

With `events_path` set, each restored request leaves marks on both sides of vLLM's
asynchronous-load protocol, each with `time.monotonic()` (CLOCK_MONOTONIC: one clock
for every process of the machine, so the scheduler's and the workers' marks line up):

- scheduler side (one `trace` event per restored request, once its first token is
  sampled), each mark also with the engine step it fell in (one step per
  `build_connector_meta`): `lookup` (first `get_num_new_matched_tokens`), `answered`
  (the hit returned; `asks` counts the lookups before it that answered "ask again"),
  `sent` (the step whose metadata carries its load), `learned` (the step output whose
  `finished_recving` names it), `scheduled` (the step that schedules its forward) and
  `sampled` (that step's output: its first token);
- worker side (`trace` events, one per mark and rank): `submitted` (the step's
  metadata bound: the load queued) and `reported` (`get_transfer_results` returned
  it); the load event itself says when its lane took it and when the read ended.

The lab reads them back into segments (`bsr_lab.vllm.trace_read`); nothing here runs
when no events path is set.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from bsr_io.integrations.vllm.eventlog import append_line

log = logging.getLogger("bsr_io.vllm")

TRACE = "trace"


def append_event(path: str | None, doc: dict[str, Any]) -> None:
    """One JSON line appended to `path` from the calling thread (eventlog.py
    `append_line`); a failure is logged, never raised."""
    if not path:
        return
    try:
        append_line(path, (json.dumps(doc, default=str) + "\n").encode())
    except Exception:  # noqa: BLE001 - a trace that fails never stops the scheduler
        log.exception("bsr-io: could not write a trace event")


@dataclass
class _Marks:
    marks: dict[str, tuple[float, int]] = field(default_factory=dict)  # name -> (mono, step)
    asks: int = 0  # lookups answered "ask again" before the hit
    chunks: int = 0
    prompt_tokens: int = 0
    waits: list[float] = field(default_factory=list)  # steps begun while its load ran
    sent_idle: bool | None = None  # whether the step that sent its load computed nothing


class RestoreTrace:
    """The scheduler side's marks of its restored requests (`events_path` unset: off)."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.step = 0  # engine steps so far: one per build_connector_meta
        self._reqs: dict[str, _Marks] = {}
        self._sampling: set[str] = set()  # scheduled to their last prompt token this step

    def _mark(self, rid: str, name: str, ahead: int = 0) -> None:
        m = self._reqs.get(rid)
        if m is not None and name not in m.marks:
            m.marks[name] = (time.monotonic(), self.step + ahead)

    def lookup(self, rid: str) -> None:
        """`get_num_new_matched_tokens` entered: the first call marks `lookup`."""
        if self.path and rid not in self._reqs:
            self._reqs[rid] = _Marks()
            self._mark(rid, "lookup", ahead=1)  # in the schedule() of the next step

    def answer(self, rid: str, got: tuple[int | None, bool], chunks: int, prompt: int) -> None:
        """Its answer: None asks again; a load marks `answered`; anything else ends the
        trace (a miss, or vLLM's own cache held as much)."""
        m = self._reqs.get(rid) if self.path else None
        if m is None or "answered" in m.marks:
            return
        tokens, load = got
        if tokens is None:
            m.asks += 1
        elif load:
            self._mark(rid, "answered", ahead=1)
            m.chunks, m.prompt_tokens = chunks, prompt
        else:
            del self._reqs[rid]

    def missed(self, rid: str) -> None:
        """An allocation with no external tokens: before the load, vLLM took none after
        all; after it (the request promoted to its forward), nothing to end."""
        m = self._reqs.get(rid) if self.path else None
        if m is not None and "learned" not in m.marks:
            del self._reqs[rid]

    def failed(self, rid: str) -> None:
        """The load failed on a rank: the request is recomputed (its trace says so)."""
        if self.path:
            self._mark(rid, "failed")

    def stepped(self, loads: list[str], scheduled: list[tuple[str, int]], idle: bool) -> None:
        """`build_connector_meta`: a new step, the loads it sends, the requests it
        schedules with the tokens they reach (computed + scheduled), whether it
        computes nothing."""
        if not self.path:
            return
        self.step += 1
        now = time.monotonic()
        for w in self._reqs.values():
            if "sent" in w.marks and "learned" not in w.marks:
                w.waits.append(now)
        for rid in loads:
            self._mark(rid, "sent")
            if rid in self._reqs:
                self._reqs[rid].sent_idle = idle
        for rid, end in scheduled:
            m = self._reqs.get(rid)
            if m is None or "learned" not in m.marks or "scheduled" in m.marks:
                continue
            self._mark(rid, "scheduled")
            if end >= m.prompt_tokens:
                self._sampling.add(rid)

    def output(self, recving: Iterable[str]) -> None:
        """`update_connector_output`: the step's output, with the loads it reports."""
        if not self.path:
            return
        for rid in recving:
            self._mark(rid, "learned")
        for rid in self._sampling:
            self._mark(rid, "sampled")
            self._emit(rid)
        self._sampling.clear()

    def finished(self, rid: str) -> None:
        """The request left vLLM: vLLM ends a request in the step output that sampled its
        last token, before it hands the connector that output (a one-token request ends
        with its first), or it was aborted."""
        if not self.path:
            return
        if rid in self._sampling:
            self._sampling.discard(rid)
            self._mark(rid, "sampled")
        if rid in self._reqs:
            self._emit(rid)

    def _emit(self, rid: str) -> None:
        m = self._reqs.pop(rid)
        append_event(
            self.path,
            {
                "kind": TRACE,
                "side": "scheduler",
                "request_id": rid,
                "time": time.time(),
                "chunks": m.chunks,
                "prompt_tokens": m.prompt_tokens,
                "asks": m.asks,
                "waits": m.waits,
                "sent_idle": m.sent_idle,
                "marks": {k: {"mono": t, "step": s} for k, (t, s) in m.marks.items()},
            },
        )


def worker_mark(worker: Any, rid: str, mark: str) -> None:
    """A worker-side mark through the worker's own event sink (rank, time added)."""
    if worker.cfg.events_path:
        doc = {"kind": TRACE, "side": "worker", "request_id": rid, "mark": mark}
        worker.event(None, doc | {"mono": time.monotonic()})
