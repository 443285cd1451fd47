"""Who this rank is in SGLang's terms, and SGLang's page keys as bsr-io chunk keys.

MHA: each TP rank holds its own heads' shard, so its records are its own (rank over
TP x PP x attention-CP). MLA: every TP rank holds the same latent KV, so the TP ranks
share one record per page (rank over PP x CP only) and only SGLang's storage writer
(`is_storage_writer`) writes it. The host layout, the pool's class and its geometry go
into the layout fingerprint: a record written in `layer_first` order is a miss to a
`page_first` pool, never bytes in the wrong order.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from bsr_io.errors import BsrValueError
from bsr_io.model.keys import ChunkKey


@dataclass(frozen=True)
class RankIdentity:
    model: str
    rank: int
    world_size: int
    writer: bool  # this rank writes records (MLA: one writer per shared record)

    @classmethod
    def of(
        cls, storage_config: Any, model: str | None = None, *, tp_sharded: bool = False
    ) -> RankIdentity:
        """From SGLang's `HiCacheStorageConfig`; ValueError, naming the field, for what
        the backend does not support (split heads across heterogeneous TP, DCP).
        `tp_sharded`: a pool each TP rank holds its own shard of even in an MLA model
        (a Mamba state pool): its records are per TP rank, and every rank writes."""
        c = storage_config
        name = model or getattr(c, "model_name", None)
        if not name:
            raise BsrValueError(
                "no model identity: SGLang gave no model_name; set 'model' in the extra_config"
            )
        if getattr(c, "should_split_heads", False):
            raise BsrValueError(
                "HiCacheStorageConfig.should_split_heads: pages split across heterogeneous "
                "TP sizes are not supported by the bsr backend"
            )
        if getattr(c, "dcp_size", 1) != 1:
            raise BsrValueError(
                "HiCacheStorageConfig.dcp_size > 1 is not supported by the bsr backend"
            )
        tp, tp_n = int(c.tp_rank), int(c.tp_size)
        pp, pp_n = int(c.pp_rank), int(c.pp_size)
        cp, cp_n = int(getattr(c, "attn_cp_rank", 0)), int(getattr(c, "attn_cp_size", 1))
        shared = bool(c.is_mla_model) and not tp_sharded
        if shared:
            tp, tp_n = 0, 1  # one record per page, shared by every TP rank
        rank = (pp * cp_n + cp) * tp_n + tp
        writer = not shared or bool(getattr(c, "is_storage_writer", True))
        return cls(model=f"sglang:{name}", rank=rank, world_size=tp_n * pp_n * cp_n, writer=writer)

    def key(self, page_key: str, fingerprint: str) -> ChunkKey:
        return ChunkKey(self.model, self.world_size, self.rank, fingerprint, page_hash(page_key))


def page_hash(page_key: str) -> int:
    """128 bits naming SGLang's page key (its chained SHA-256 hex, or any string)."""
    digest = hashlib.blake2b(page_key.encode("utf-8"), digest_size=16, person=b"bsr-sglang-key")
    return int.from_bytes(digest.digest(), "little")
