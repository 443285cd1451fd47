"""What the scheduler side tells the workers each step, and what they tell it back."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

Cut = tuple[str, int, int]  # a record cut in a step: (key model, group, chunk hash)


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


def cut_key(key_model: str, group: int, chunk_hash: int) -> Cut:
    """The cut of group `group`'s record of the chunk hashed `chunk_hash`."""
    return (key_model, group, chunk_hash)


def cut_of(key_model: str, r: RecordOrder) -> Cut:
    """The cut of record `r` of a request keyed under `key_model`."""
    return cut_key(key_model, r.group, r.chunk_hash)


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
    # record dir -> chunk hashes the scheduler side dropped after a failed load: each
    # worker owning the dir reports again those of them its store still holds.
    recheck: dict[str, list[int]] = field(default_factory=dict)
    # Worker ranks whose reports the scheduler side stopped trusting: they report their
    # whole store again under a new epoch.
    resync: set[int] = field(default_factory=set)
    # Requests finished or preempted since the last step: vLLM may hand their blocks to
    # others in this step, so no record of theirs is cut from them any more (cuts.py).
    released: set[str] = field(default_factory=set)
    # Requests finished since the last step whose blocks vLLM keeps (no finish save) until
    # every worker reports them in finished_sending: a cut of theirs may not have copied
    # its bytes yet (cuts.py `hold`).
    held: set[str] = field(default_factory=set)
    # The step schedules no token (an engine waiting for loads): its workers may wait
    # for the loads it submits before reporting (connector.py `get_transfer_results`).
    idle: bool = False


@dataclass
class Inventory:
    """One worker's report of what its own store holds (inventory.py): first the records
    it found at start, in bounded batches, then what changed (saves, evictions,
    quarantines, files removed by hand)."""

    epoch: int  # new at every worker start: a new one resets that rank's view
    added: dict[str, list[int]] = field(default_factory=dict)  # record dir -> hashes held
    removed: dict[str, list[int]] = field(default_factory=dict)  # record dir -> not held
    synced: bool = False  # every record found at start has been reported

    def size(self) -> int:
        return sum(map(len, self.added.values())) + sum(map(len, self.removed.values()))


@dataclass
class BsrHandshake(KVConnectorHandshakeMetadata):
    """From each worker once, before serving: its rank, its inventory's first batch, and
    its groups' fingerprints (group index -> fingerprint): only a worker sees every
    layer's own spec (vLLM hands the scheduler one layer's spec per group), so the
    record directories are named by the workers' fingerprints; and its node (nodes.py),
    by which `replicated: "auto"` decides."""

    rank: int
    inventory: Inventory
    fingerprints: dict[int, str] = field(default_factory=dict)
    node: str = ""


@dataclass
class BsrWorkerMeta(KVConnectorWorkerMetadata):
    """Per step, from every worker (vLLM aggregates them) to the scheduler side."""

    inventory: dict[int, Inventory] = field(default_factory=dict)  # worker rank -> report
    unhealthy: dict[int, str] = field(default_factory=dict)  # rank -> why its I/O is stuck
    ranks: set[int] = field(default_factory=set)  # ranks that reported
    skipped_saves: int = 0  # window records dropped for want of a slot (future misses)
    # Step cuts that ended without a record (skipped or failed), as (key model, group,
    # chunk hash): the scheduler side stops waiting for them (scheduler.py, `_cutting`).
    lost_cuts: list[Cut] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> BsrWorkerMeta:
        if not isinstance(other, BsrWorkerMeta):
            return self
        return BsrWorkerMeta(
            {**self.inventory, **other.inventory},
            {**self.unhealthy, **other.unhealthy},
            self.ranks | other.ranks,
            self.skipped_saves + other.skipped_saves,
            self.lost_cuts + other.lost_cuts,
        )
