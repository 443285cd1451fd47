"""bsr-io inside vLLM: an out-of-tree KV connector (asynchronous loads).

Load it by configuration, no code change in vLLM:

    --kv-transfer-config '{"kv_connector": "BsrIoConnector",
      "kv_connector_module_path": "bsr_io.integrations.vllm",
      "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
      "kv_connector_extra_config": {"store_dir": "/nvme/bsr", "window": 8}}'

Hybrid models (vLLM's hybrid allocator: sliding-window and full-attention groups, MLA,
DeepSeek-V4's groups) are restored group by group under one request-level commit. The
scheduler side finds each group's records in an in-memory catalog of the store (no I/O
on vLLM's scheduler thread); each tensor-parallel worker loads its own records through
the core's windowed, verified install into the blocks vLLM allocated and reports the
request finished, or failed, so vLLM's output aggregator recomputes a request that any
group on any worker could not restore in full. Sliding-window records are saved in the
step that computed them, full-attention records when the request finishes.
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
