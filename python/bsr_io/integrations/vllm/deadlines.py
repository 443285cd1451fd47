"""Every deadline of the connector, derived at start from vLLM's own step limit.

vLLM's multiprocess executor gives each step's RPC (`execute_model`, `sample_tokens`)
`VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS` (300 s when unset; deployments set 1,800 s and
more), then kills the whole engine. Any connector wait inside a step adds to that RPC, so:

- The connector's waits inside one step sum to at most `STEP_FRACTION` of the limit:
  `release` (start_load_kv) and the window cuts (wait_for_save) each wait at most
  `step_save_budget_s`, so 2 x `step_save_budget_s` may not exceed it; a configuration
  asking for more is refused at start.
- One record write has `write_s`: a tenth of the limit, at most `WRITE_CAP_S`.
- A hold (a finished request whose cuts have not copied their bytes: vLLM keeps its
  blocks) ends after `hold_s`, `HOLD_WRITES` writes' deadlines: a cut waits for a save
  slot only behind writes in progress, each ended by `write_s`; past it the cuts still
  waiting are skipped and counted. A queued cut's wait for a slot has the same bound.
  A hold ends sooner, after `starved_hold_s`, when every save slot is held by a write
  then: a drive that slow would hold the blocks for whole writes, and vLLM, short of
  blocks, stops admitting requests (measured with every write held 2 s: holds of 2.6 s
  at p50 took saturated throughput to 0.27x, 0.80x with this rule; bench serve
  --write-stall). Its cuts are skipped: future misses.
- Loads and finish saves are polled, never waited for in a step; their deadlines
  (`load_timeout_s`, `save_timeout_s`) default to a tenth of the limit (at most 30 s)
  and four tenths (at most 120 s): the values of a default limit.

The limit is read as vLLM reads it, in each process at the connector's start: set it
alike on every node (the engine core's is the one vLLM enforces).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from bsr_io.errors import BsrValueError

LIMIT_ENV = "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"
DEFAULT_LIMIT_S = 300  # vLLM's own default (vllm/envs.py, 0.32 to 0.34)
STEP_FRACTION = 0.1  # the connector's waits inside one step: at most this of the limit
WRITE_FRACTION, WRITE_CAP_S = 0.1, 10.0
HOLD_WRITES = 2
STARVED_HOLD_S = 0.25  # a hold with every save slot held by a write: it ends after this
LOAD_FRACTION, LOAD_CAP_S = 0.1, 30.0
SAVE_FRACTION, SAVE_CAP_S = 0.4, 120.0
GRACE_S = 2.0  # past a running job's deadline, the job table gives up on it


class LimitError(BsrValueError):
    """vLLM's step limit in the environment is not a number vLLM accepts."""


def vllm_step_limit_s(environ: Mapping[str, str] | None = None) -> float:
    """vLLM's step limit in seconds, read as vLLM reads it (`int(os.getenv(NAME,
    "300"))`); LimitError for a value vLLM itself would fail on."""
    env = os.environ if environ is None else environ
    text = env.get(LIMIT_ENV, str(DEFAULT_LIMIT_S))
    try:
        limit = int(text)
    except ValueError:
        raise LimitError(f"{LIMIT_ENV}={text!r} is not a whole number of seconds") from None
    if limit <= 0:
        raise LimitError(f"{LIMIT_ENV}={text!r}: vLLM's step limit must be > 0 seconds")
    return float(limit)


@dataclass(frozen=True)
class Deadlines:
    limit_s: float  # vLLM's step limit
    step_s: float  # the most the connector may wait inside one step, all waits together
    write_s: float  # one record's write
    hold_s: float  # a hold, and a queued cut's wait for a save slot
    load_s: float  # a load, from its submission
    save_s: float  # a finish save, from its submission
    grace_s: float = GRACE_S
    starved_hold_s: float = STARVED_HOLD_S  # a hold while no save slot is free

    @property
    def cut_s(self) -> float:
        """The longest a cut may take from its order to its end: a slot, then its write."""
        return self.hold_s + self.write_s

    @classmethod
    def derive(
        cls, limit_s: float, load_timeout_s: float | None, save_timeout_s: float | None
    ) -> Deadlines:
        write = min(WRITE_CAP_S, WRITE_FRACTION * limit_s)
        return cls(
            limit_s=limit_s,
            step_s=STEP_FRACTION * limit_s,
            write_s=write,
            hold_s=HOLD_WRITES * write,
            load_s=load_timeout_s or min(LOAD_CAP_S, LOAD_FRACTION * limit_s),
            save_s=save_timeout_s or min(SAVE_CAP_S, SAVE_FRACTION * limit_s),
        )

    def step_waits_refused(self, step_save_budget_s: float) -> str:
        """Why waits of `step_save_budget_s` could outlast vLLM's limit ("" when not)."""
        waits = 2 * step_save_budget_s
        if waits <= self.step_s:
            return ""
        return (
            f"kv_connector_extra_config.step_save_budget_s {step_save_budget_s:g} lets one "
            f"step wait {waits:g} s (release, then the window cuts), more than "
            f"{STEP_FRACTION:g} of vLLM's step limit {LIMIT_ENV}={self.limit_s:g} s: set "
            f"step_save_budget_s to at most {self.step_s / 2:g}, or raise {LIMIT_ENV}"
        )
