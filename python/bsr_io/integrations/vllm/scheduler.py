"""Scheduler side: discovery from metadata, load and save plans, failures become misses.

`get_num_new_matched_tokens` runs in every scheduling pass, so its answer is
memoized per request. The hit is the number of leading whole chunks whose records
exist for every tensor-parallel rank (a stat and a header read per record, no
payload), capped so that at least one prompt token is left to compute. A request
whose load failed on any rank is answered with a miss from then on: vLLM recomputes
it instead of loading and failing again every step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from bsr_io.errors import ChunkError
from bsr_io.integrations.vllm.config import ConnectorConfig
from bsr_io.integrations.vllm.identity import request_key_model
from bsr_io.integrations.vllm.metadata import BsrMetadata, Transfer
from bsr_io.keys import ChunkKey, prefix_hashes
from bsr_io.layout import KVLayout
from bsr_io.tiers.lower import LowerTier

log = logging.getLogger("bsr_io.vllm")


@dataclass
class _Lookup:
    key_model: str | None
    hashes: list[int]
    hit_chunks: int  # leading chunks present on every rank
    local_tokens: int = 0  # vLLM's own (block-aligned) hit when last asked


class SchedulerSide:
    def __init__(self, cfg: ConnectorConfig, layout: KVLayout, model: str, world_size: int,
                 block_size: int) -> None:  # fmt: skip
        self.cfg = cfg
        self.layout = layout
        self.fingerprint = layout.fingerprint()
        self.model = model
        self.world_size = world_size
        self.block_size = block_size
        self.per = cfg.chunk_tokens // block_size
        # Metadata only: file tiers stat a record and read its 4 KiB header.
        self.tiers = [LowerTier(cfg.store_dir, layout=layout, name="L2")]
        if cfg.lower_dir:
            self.tiers.append(LowerTier(cfg.lower_dir, layout=layout, name="L3"))
        self._lookups: dict[str, _Lookup] = {}
        self._failed: set[str] = set()
        self._loading: set[str] = set()
        self._loads: list[Transfer] = []
        self._saves: list[Transfer] = []

    # -- discovery ------------------------------------------------------------------------
    def _present(self, key_model: str, h: int) -> bool:
        for rank in range(self.world_size):
            key = ChunkKey(key_model, self.world_size, rank, self.fingerprint, h)
            if not any(_holds(t, key) for t in self.tiers):
                return False
        return True

    def _lookup(self, request: Any) -> _Lookup:
        found = self._lookups.get(request.request_id)
        if found is not None:
            return found
        key_model = request_key_model(self.model, request)
        hashes: list[int] = []
        hit = 0
        if key_model is not None:
            hashes = prefix_hashes(list(request.all_token_ids), self.cfg.chunk_tokens)
            while hit < len(hashes) and self._present(key_model, hashes[hit]):
                hit += 1
        found = _Lookup(key_model, hashes, hit)
        self._lookups[request.request_id] = found
        return found

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int):
        if request.request_id in self._failed:
            return 0, False
        found = self._lookup(request)
        # Leave at least one token to compute: vLLM must run the model to sample.
        usable = min(found.hit_chunks, (request.num_tokens - 1) // self.cfg.chunk_tokens)
        ext = usable * self.cfg.chunk_tokens - num_computed_tokens
        found.local_tokens = num_computed_tokens
        if ext <= 0:
            return 0, False
        return ext, True

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int):
        if num_external_tokens <= 0:
            return
        found = self._lookups[request.request_id]
        end = found.local_tokens + num_external_tokens
        n = end // self.cfg.chunk_tokens
        ids = blocks.get_block_ids()[0]
        self._loads.append(
            Transfer(
                request.request_id,
                found.key_model,
                tuple(found.hashes[:n]),
                tuple(ids[: n * self.per]),
                first_block=found.local_tokens // self.block_size,
            )
        )
        self._loading.add(request.request_id)

    def build_connector_meta(self, scheduler_output: Any) -> BsrMetadata:
        meta = BsrMetadata(self._loads, self._saves)
        self._loads, self._saves = [], []
        return meta

    def update_connector_output(self, output: Any) -> None:
        for rid in output.finished_recving or ():
            self._loading.discard(rid)
        for rid in output.failed_recving or ():
            # The next lookup for this request is a miss: it is recomputed, not reloaded.
            self._failed.add(rid)
            self._lookups.pop(rid, None)
            log.warning("bsr-io: load of request %s failed on a rank; recomputing", rid)

    # -- save ---------------------------------------------------------------------------
    def request_finished(self, request: Any, block_ids: list[int]):
        rid = request.request_id
        found = self._lookups.pop(rid, None)
        failed = rid in self._failed
        self._failed.discard(rid)
        if rid in self._loading or not self.cfg.save:
            self._loading.discard(rid)
            return False, None  # a load still owns these blocks: never read them
        key_model = found.key_model if found else request_key_model(self.model, request)
        if key_model is None:
            return False, None
        tokens = list(request.all_token_ids)[: request.num_computed_tokens]
        hashes = found.hashes if found else prefix_hashes(tokens, self.cfg.chunk_tokens)
        n = min(len(tokens) // self.cfg.chunk_tokens, len(hashes),
                len(block_ids) // self.per)  # fmt: skip
        known = 0 if (failed or found is None) else found.hit_chunks
        if n <= known:
            return False, None
        self._saves.append(
            Transfer(rid, key_model, tuple(hashes[:n]), tuple(block_ids[: n * self.per]))
        )
        return True, None  # vLLM keeps the blocks until the workers report the save done


def _holds(tier: Any, key: ChunkKey) -> bool:
    try:
        return tier.contains(key)
    except (ChunkError, OSError):
        return False  # a tier that is down holds nothing
