"""bsr-io inside vLLM: an out-of-tree KV connector (asynchronous loads).

Load it by configuration, no code change in vLLM:

    --kv-transfer-config '{"kv_connector": "BsrIoConnector",
      "kv_connector_module_path": "bsr_io.integrations.vllm",
      "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
      "kv_connector_extra_config": {"store_dir": "/nvme/bsr", "window": 8}}'

The scheduler side finds whole chunks in bsr-io's store from metadata alone; each
tensor-parallel worker streams its own chunks through its engine's W slots into the
blocks vLLM allocated and reports the request finished, or failed, so vLLM's output
aggregator recomputes a request that any worker could not restore in full. Newly
computed chunks are saved through the same slots after the request finishes.
"""

from __future__ import annotations

try:
    import vllm  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "bsr_io.integrations.vllm needs vLLM: pip install 'bsr-io[vllm]' "
        "(on a CPU-only machine: bash scripts/install_vllm.sh)"
    ) from exc

from bsr_io.integrations.vllm.connector import BsrIoConnector

__all__ = ["BsrIoConnector"]
