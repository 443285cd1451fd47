"""The connector's settings (`kv_connector_extra_config`) and the checks made at start.

vLLM's default `kv_load_failure_policy` is "fail": a load that fails ends the request
with an error. bsr-io's rule is complete reuse or zero reuse followed by recompute, so
the connector refuses to start unless the policy is "recompute", or the user said
explicitly that errors are acceptable (`accept_load_errors`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from bsr_io.errors import BsrValueError
from bsr_io.integrations.vllm.cpus import valid_setting
from bsr_io.integrations.vllm.deadlines import Deadlines, LimitError, vllm_step_limit_s
from bsr_io.integrations.vllm.nodes import spans_nodes
from bsr_io.settings import Key, Table, at_least, not_empty, parse, positive
from bsr_io.tiers.mooncake import EXTRA_PREFIX, MooncakeConfig

DEFAULT_WINDOW = 8
DEFAULT_CHUNK_TOKENS = 256


class ConfigError(BsrValueError):
    """The vLLM configuration cannot run this connector; the message says what to change."""


def check_chunk_tokens(
    chunk_tokens: int, block_sizes: Sequence[int], alignment: int | None
) -> None:
    """ConfigError unless a chunk is whole blocks of every KV cache group and lands on
    vLLM's prefix-hit alignment; the message names the value to use."""
    need = math.lcm(*block_sizes, *([alignment] if alignment else []))
    if chunk_tokens % need:
        good = -(-chunk_tokens // need) * need
        raise ConfigError(
            f"chunk_tokens {chunk_tokens} is not a multiple of {need} (the KV cache groups' "
            f"block sizes {sorted(set(block_sizes))} and vLLM's hit alignment {alignment}): "
            f"set kv_connector_extra_config.chunk_tokens to {good}"
        )


_INT = "an int >= {}"
_POSITIVE = "a positive number"
_TEXT = "a non-empty string"
_REPLICATED = ("once", "per_rank", "auto")

KEYS = Table(
    (
        Key(
            "store_dir",
            "str",
            allowed=_TEXT,
            check=not_empty,
            missing="{label} (the SSD directory of bsr-io's store) is required",
        ),
        Key("lower_dir", "str", None, _TEXT, not_empty),
        Key("store_bytes", "int", None, _INT.format(1), at_least(1)),
        Key("window", "int", DEFAULT_WINDOW, _INT.format(1), at_least(1)),
        Key("chunk_tokens", "int", DEFAULT_CHUNK_TOKENS, _INT.format(1), at_least(1)),
        # null: derived from vLLM's step limit (deadlines.py)
        Key("load_timeout_s", "float", None, _POSITIVE, positive),
        Key("save_timeout_s", "float", None, _POSITIVE, positive),
        Key("save", "bool", True, "true or false"),
        Key("step_save_budget_s", "float", 0.05, _POSITIVE, positive),
        Key("save_in_steps", "bool", True, "true or false"),
        Key("durable_saves", "bool", False, "true or false"),
        Key("save_gate_s", "float", 0.05, "a number >= 0", at_least(0)),
        Key("rescan_s", "float", 5.0, _POSITIVE, positive),
        Key("report_batch", "int", 4096, _INT.format(1), at_least(1)),
        Key("handshake_batch", "int", 131072, _INT.format(0), at_least(0)),
        Key("hash_inline_tokens", "int", 32768, _INT.format(0), at_least(0)),
        Key("model", "str", None, _TEXT, not_empty),
        Key("events_path", "str", None, _TEXT, not_empty),
        Key("metrics_port", "int", None, _INT.format(1), at_least(1)),
        Key("accept_load_errors", "bool", False, "true or false"),
        Key("replicated", "str", "auto", '"once", "per_rank" or "auto"', _REPLICATED.__contains__),
        Key("save_nice", "int", 19, "an int from 0 to 19", lambda v: 0 <= v <= 19),
        Key("io_cpus", "str", "auto", '"auto", "inherit" or a CPU list ("1,3-5")', valid_setting),
    ),
    label="kv_connector_extra_config.{name}",
    unknown="unknown kv_connector_extra_config keys {unknown}; known: {known}",
    missing="kv_connector_extra_config.{name} is required",
    others=(EXTRA_PREFIX,),
    error=ConfigError,
)
"""The connector's `kv_connector_extra_config` keys (values as JSON gives them: no text
read as numbers); the `bsr.mooncake.*` keys are `MooncakeConfig`'s."""
_D = KEYS.default


@dataclass(frozen=True)
class ConnectorConfig:
    store_dir: str
    lower_dir: str | None = _D("lower_dir")
    # The SSD tier's cap, per TP rank: each worker counts and evicts only its own rank's
    # records (its `-w<W>r<R>` directories), so a store shared by TP ranks holds at most
    # tp x store_bytes and no rank evicts another's records.
    store_bytes: int | None = _D("store_bytes")
    window: int = _D("window")
    chunk_tokens: int = _D("chunk_tokens")
    # None: a tenth of vLLM's step limit, at most 30 s; four tenths, at most 120 s
    # (`deadlines`, which every user of a deadline reads).
    load_timeout_s: float | None = _D("load_timeout_s")
    save_timeout_s: float | None = _D("save_timeout_s")
    save: bool = _D("save")
    # Sliding-window records are cut in the step that computed them; a step waits at
    # most this long for a free save slot, then skips the record (a future miss). Twice
    # this (the release's wait too) may not exceed a tenth of vLLM's step limit.
    step_save_budget_s: float = _D("step_save_budget_s")
    # Full-attention records cut in the step that completes them (as window records
    # always are), not read at the request's finish while vLLM holds its blocks: a
    # finished request's blocks are free at once (false: the finish save, which holds
    # them until the workers report it, and never skips a record).
    save_in_steps: bool = _D("save_in_steps")
    # Each record flushed to the drive before it is named and its directory after
    # (false, the default: neither; a power loss may tear or unname a record, which its
    # checksum catches on read: a miss, never wrong bytes; on the Xeon VM a saturated
    # server ran 0.958x both references' throughput with them, 0.984x without:
    # docs/results/serve-xeon-wait.json and serve-xeon-nodurable.json).
    durable_saves: bool = _D("durable_saves")
    # On a CPU worker, how long a save's copy and its write wait for a forward to run
    # (gate.py); 0: they never wait.
    save_gate_s: float = _D("save_gate_s")
    # Each worker re-lists its own records this often and reports what changed (records
    # evicted, quarantined, deleted by hand, written by another process).
    rescan_s: float = _D("rescan_s")
    # Chunk hashes a worker reports per step, and in its handshake before serving: a
    # store of a million records is reported over several steps, none of them stalled.
    report_batch: int = _D("report_batch")
    handshake_batch: int = _D("handshake_batch")
    # A new request with more tokens than this still to hash is hashed on a thread of its
    # own, and vLLM is told to ask again next pass (a 512K-token prompt then costs the
    # scheduler thread microseconds, not the hash's milliseconds); shorter ones inline.
    hash_inline_tokens: int = _D("hash_inline_tokens")
    model: str | None = _D("model")  # identity of the weights; default: vLLM's model and revision
    events_path: str | None = _D("events_path")  # JSON lines, one per load and save outcome
    metrics_port: int | None = _D("metrics_port")  # Prometheus on 127.0.0.1:<port + TP rank>
    # Groups every TP rank holds the same bytes of (MLA): "once" stores them by rank 0
    # for every rank to read (one drive, or a file system the nodes share); "per_rank"
    # has each rank store and read its own copy (node-local drives: another node's
    # records are out of reach); "auto" is "per_rank" when the engine spans nodes, by
    # vLLM's nnodes or by the nodes the workers report (nodes.py).
    replicated: str = _D("replicated")
    # The CPUs of the connector's threads in the worker (cpus.py): "auto" keeps them off
    # the cores vLLM bound its OpenMP threads to.
    io_cpus: str = _D("io_cpus")
    # On a CPU worker, the nice value of the threads that cut and write saves (cpus.py
    # `lower_priority`): the engine core and the API server share their CPUs, and a
    # save is never waited for by a request; 0 leaves them at the worker's own.
    save_nice: int = _D("save_nice")
    # A Mooncake Store pool below the SSD tier (`bsr.mooncake.*` keys, as the LMCache
    # plugin takes them): saves write through, loads read it where the SSD tier misses.
    mooncake: MooncakeConfig | None = None
    # vLLM's step limit (VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS) as this process read it.
    vllm_limit_s: float = field(default_factory=vllm_step_limit_s)

    @cached_property
    def deadlines(self) -> Deadlines:
        """Every deadline of the connector, derived from vLLM's step limit."""
        return Deadlines.derive(self.vllm_limit_s, self.load_timeout_s, self.save_timeout_s)

    def replicate_once(self, nnodes: int, nodes: Sequence[str] = ()) -> bool:
        """Whether a replicated group is stored once (by rank 0) for every rank; `nodes`:
        the workers' reports of their node (`nodes.node_identity`)."""
        return self.replicated == "once" or (
            self.replicated == "auto" and not spans_nodes(nnodes, nodes)
        )

    @classmethod
    def from_vllm(cls, vllm_config: Any) -> ConnectorConfig:
        """Read and check the settings; ConfigError when vLLM is set up in a way the
        connector cannot honour. Everything that can be refused from the VllmConfig
        alone is refused here, so it runs at the connector's earliest hook
        (`BsrIoConnector.get_required_kvcache_layout`) as well as in its constructor."""
        kv = vllm_config.kv_transfer_config
        extra = dict(kv.kv_connector_extra_config or {})
        values = parse(KEYS, extra)
        accept_errors = values.pop("accept_load_errors")
        policy = getattr(kv, "kv_load_failure_policy", "fail")
        if policy != "recompute" and not accept_errors:
            raise ConfigError(
                f'kv_load_failure_policy is "{policy}": a failed bsr-io load would then end '
                "the request with an error instead of recomputing it. Set "
                '"kv_load_failure_policy": "recompute" in --kv-transfer-config (or set '
                "kv_connector_extra_config.accept_load_errors = true to accept errors)"
            )
        cache = vllm_config.cache_config
        if not cache.enable_prefix_caching:
            raise ConfigError(
                "prefix caching is off: vLLM would never cache restored blocks nor hand "
                "bsr-io a local hit to extend; start vLLM with --enable-prefix-caching"
            )
        chunk_tokens = values["chunk_tokens"]
        block = int(cache.block_size)
        if chunk_tokens % block:
            raise ConfigError(
                f"chunk_tokens {chunk_tokens} is not a whole number of vLLM blocks "
                f"(block_size {block}): choose a multiple of {block}"
            )
        parallel = vllm_config.parallel_config
        if parallel.pipeline_parallel_size != 1:
            raise ConfigError(
                "bsr-io's connector supports tensor parallelism only "
                "(pipeline_parallel_size must be 1)"
            )
        if parallel.decode_context_parallel_size != 1:
            raise ConfigError(
                "bsr-io's connector does not support decode context "
                "parallelism (decode_context_parallel_size must be 1)"
            )
        try:
            mooncake = MooncakeConfig.from_extra_config(extra)
        except ValueError as exc:
            raise ConfigError(f"kv_connector_extra_config {EXTRA_PREFIX}*: {exc}") from None
        try:
            limit = vllm_step_limit_s()
        except LimitError as exc:
            raise ConfigError(str(exc)) from None
        cfg = cls(**values, mooncake=mooncake, vllm_limit_s=limit)
        why = cfg.deadlines.step_waits_refused(cfg.step_save_budget_s)
        if why:
            raise ConfigError(why)
        return cfg
