"""What the scheduler side tells the workers each step."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass(frozen=True)
class Transfer:
    """One request's load or save: chunk hashes (rank-independent), and its blocks."""

    request_id: str
    key_model: str
    chunk_hashes: tuple[int, ...]
    block_ids: tuple[int, ...]  # the request's blocks covering those chunks
    first_block: int = 0  # loads: blocks below hold vLLM's local hit and are left alone


@dataclass
class BsrMetadata(KVConnectorMetadata):
    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)
