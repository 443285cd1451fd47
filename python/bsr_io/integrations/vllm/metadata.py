"""What the scheduler side tells the workers each step, and what they tell it back."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


@dataclass(frozen=True)
class RecordOrder:
    """One record: a KV cache group's pages for one chunk (full groups) or at one chunk
    boundary (window groups), with the block id behind each page (-1: leave it)."""

    group: int  # vLLM's KV cache group id
    chunk: int
    chunk_hash: int  # rank-independent; each worker makes its own key from it
    ids: tuple[int, ...]


@dataclass(frozen=True)
class Transfer:
    """One request's records to load or save."""

    request_id: str
    key_model: str
    records: tuple[RecordOrder, ...]
    committed_tokens: int = 0  # loads: what the request has computed once it completes


@dataclass
class BsrMetadata(KVConnectorMetadata):
    loads: list[Transfer] = field(default_factory=list)
    # Window-group records completed by this step: cut in wait_for_save, while their
    # blocks still hold them (vLLM frees and reuses them from the next step on).
    step_saves: list[Transfer] = field(default_factory=list)
    # Full-group records of finished requests; vLLM keeps the blocks until every
    # worker reports the request in finished_sending.
    finish_saves: list[Transfer] = field(default_factory=list)
    # key model -> chunk hashes vLLM's own prefix cache served to requests scheduled this
    # step: each worker refreshes those records' recency in its SSD tier (no I/O).
    touches: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class BsrWorkerMeta(KVConnectorWorkerMetadata):
    """Per step, from every worker (vLLM aggregates them) to the scheduler side."""

    saved: dict[str, set[int]] = field(default_factory=dict)  # record dir -> hashes stored
    unhealthy: dict[int, str] = field(default_factory=dict)  # rank -> why its I/O is stuck
    ranks: set[int] = field(default_factory=set)  # ranks that reported
    skipped_saves: int = 0  # window records dropped for want of a slot (future misses)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> BsrWorkerMeta:
        if not isinstance(other, BsrWorkerMeta):
            return self
        saved = {ns: set(h) for ns, h in self.saved.items()}
        for ns, hashes in other.saved.items():
            saved.setdefault(ns, set()).update(hashes)
        return BsrWorkerMeta(
            saved,
            {**self.unhealthy, **other.unhealthy},
            self.ranks | other.ranks,
            self.skipped_saves + other.skipped_saves,
        )
