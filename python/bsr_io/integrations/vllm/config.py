"""The connector's settings (`kv_connector_extra_config`) and the checks made at start.

vLLM's default `kv_load_failure_policy` is "fail": a load that fails ends the request
with an error. bsr-io's rule is complete reuse or zero reuse followed by recompute, so
the connector refuses to start unless the policy is "recompute", or the user said
explicitly that errors are acceptable (`accept_load_errors`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, overload

from bsr_io.tiers.mooncake_config import EXTRA_PREFIX, MooncakeConfig

DEFAULT_WINDOW = 8
DEFAULT_CHUNK_TOKENS = 256


class ConfigError(ValueError):
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


@overload
def _int(extra: dict[str, Any], name: str, default: int, minimum: int = 1) -> int: ...
@overload
def _int(extra: dict[str, Any], name: str, default: None, minimum: int = 1) -> int | None: ...
def _int(extra: dict[str, Any], name: str, default: int | None, minimum: int = 1) -> int | None:
    value = extra.get(name, default)
    if value is None and default is None:
        return None  # optional and not set (an explicit null where a default exists is refused)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(
            f"kv_connector_extra_config.{name} must be an int >= {minimum}, got {value!r}"
        )
    return value


def _float(extra: dict[str, Any], name: str, default: float) -> float:
    value = extra.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError(
            f"kv_connector_extra_config.{name} must be a positive number, got {value!r}"
        )
    return float(value)


@dataclass(frozen=True)
class ConnectorConfig:
    store_dir: str
    lower_dir: str | None = None
    # The SSD tier's cap, per TP rank: each worker counts and evicts only its own rank's
    # records (its `-w<W>r<R>` directories), so a store shared by TP ranks holds at most
    # tp x store_bytes and no rank evicts another's records.
    store_bytes: int | None = None
    window: int = DEFAULT_WINDOW
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    load_timeout_s: float = 30.0
    save_timeout_s: float = 120.0
    save: bool = True
    # Sliding-window records are cut in the step that computed them; a step waits at
    # most this long for a free save slot, then skips the record (a future miss).
    step_save_budget_s: float = 0.05
    rescan_s: float = 5.0  # the scheduler re-lists the store for records others wrote
    # A new request with more tokens than this still to hash is hashed on a thread of its
    # own, and vLLM is told to ask again next pass (a 512K-token prompt then costs the
    # scheduler thread microseconds, not the hash's milliseconds); shorter ones inline.
    hash_inline_tokens: int = 32768
    model: str | None = None  # identity of the weights; default: vLLM's model and revision
    events_path: str | None = None  # JSON lines, one per load and save outcome
    metrics_port: int | None = None  # Prometheus on 127.0.0.1:<port + TP rank>
    # A Mooncake Store pool below the SSD tier (`bsr.mooncake.*` keys, as the LMCache
    # plugin takes them): saves write through, loads read it where the SSD tier misses.
    mooncake: MooncakeConfig | None = None

    @classmethod
    def from_vllm(cls, vllm_config: Any) -> ConnectorConfig:
        """Read and check the settings; ConfigError when vLLM is set up in a way the
        connector cannot honour. Everything that can be refused from the VllmConfig
        alone is refused here, so it runs at the connector's earliest hook
        (`BsrIoConnector.get_required_kvcache_layout`) as well as in its constructor."""
        kv = vllm_config.kv_transfer_config
        extra = dict(kv.kv_connector_extra_config or {})
        known = (set(cls.__dataclass_fields__) - {"mooncake"}) | {"accept_load_errors"}
        unknown = sorted(k for k in set(extra) - known if not k.startswith(EXTRA_PREFIX))
        if unknown:
            raise ConfigError(
                f"unknown kv_connector_extra_config keys {unknown}; known: {sorted(known)}"
            )
        policy = getattr(kv, "kv_load_failure_policy", "fail")
        if policy != "recompute" and not extra.get("accept_load_errors", False):
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
        store_dir = extra.get("store_dir")
        if not isinstance(store_dir, str) or not store_dir:
            raise ConfigError(
                "kv_connector_extra_config.store_dir (the SSD directory of "
                "bsr-io's store) is required"
            )
        chunk_tokens = _int(extra, "chunk_tokens", DEFAULT_CHUNK_TOKENS)
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
        lower = extra.get("lower_dir")
        model = extra.get("model")
        events = extra.get("events_path")
        for name, value in (("lower_dir", lower), ("model", model), ("events_path", events)):
            if value is not None and (not isinstance(value, str) or not value):
                raise ConfigError(
                    f"kv_connector_extra_config.{name} must be a non-empty string, got {value!r}"
                )
        save = extra.get("save", True)
        if not isinstance(save, bool):
            raise ConfigError(f"kv_connector_extra_config.save must be true or false, got {save!r}")
        return cls(
            store_dir=store_dir,
            lower_dir=lower,
            store_bytes=_int(extra, "store_bytes", None),
            window=_int(extra, "window", DEFAULT_WINDOW),
            chunk_tokens=chunk_tokens,
            load_timeout_s=_float(extra, "load_timeout_s", 30.0),
            save_timeout_s=_float(extra, "save_timeout_s", 120.0),
            step_save_budget_s=_float(extra, "step_save_budget_s", 0.05),
            rescan_s=_float(extra, "rescan_s", 5.0),
            hash_inline_tokens=_int(extra, "hash_inline_tokens", 32768, minimum=0),
            save=save,
            model=model,
            events_path=events,
            metrics_port=_int(extra, "metrics_port", None),
            mooncake=mooncake,
        )
