"""A GPU connector for LMCache 0.5.6 over CPU tensors.

LMCache's vLLM connectors move KV through CUDA kernels (`lmcache.cuda_ops`), which do
not load without a GPU. This class implements LMCache's own `GPUConnectorInterface`
over a paged KV cache held in CPU tensors, so LMCache's real engine, storage manager
and backends can run store and retrieve end to end on a CPU-only machine. It is a
stand-in for the GPU only; everything above it is the real `lmcache` package.

Layout, like vLLM's flash-attention cache: one tensor per layer, shaped
`[2, num_blocks, block_size, num_kv_heads, head_size]`, addressed by a per-token
`slot_mapping` (`block_id * block_size + offset`). Memory objects are LMCache's
`KV_2LTD` chunks, `[2, num_layers, num_tokens, num_kv_heads * head_size]`.
"""

from __future__ import annotations

import threading

import torch
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
from lmcache.v1.memory_management import MemoryFormat, MemoryObj


def _whole_blocks(slots: torch.Tensor, block_size: int) -> torch.Tensor | None:
    """Block ids when `slots` covers whole blocks, each in order; else None."""
    n = len(slots)
    if n == 0 or n % block_size:
        return None
    runs = slots.view(-1, block_size)
    first = runs[:, 0]
    if bool((first % block_size).any()) or not torch.equal(
        runs, first[:, None] + torch.arange(block_size)
    ):
        return None
    return first // block_size


class CPUPagedConnector(GPUConnectorInterface):
    """Copies LMCache memory objects to and from paged KV caches in CPU memory.

    kwargs on every call, as vLLM's adapter passes them: `kvcaches` (list of per-layer
    tensors) and `slot_mapping` (slots for the whole token sequence); optional
    `vllm_cached_tokens` (leading tokens the destination already holds: not written).
    It records what each `batched_to_gpu` call was handed, so tests and benchmarks can
    check how much staged state a retrieve held at once.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_size: int) -> None:
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.hidden = num_kv_heads * head_size
        self.kvcaches: list[torch.Tensor] | None = None
        self._lock = threading.Lock()
        self.reset_stats()

    def reset_stats(self) -> None:
        with self._lock:
            self.to_gpu_calls = 0
            self.to_gpu_chunks = 0
            self.max_batch_objs = 0
            self.max_batch_bytes = 0

    @staticmethod
    def make_kvcaches(
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        dtype: torch.dtype = torch.bfloat16,
    ) -> list[torch.Tensor]:
        shape = (2, num_blocks, block_size, num_kv_heads, head_size)
        return [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)]

    # One layer's cache seen as [2, slots, hidden] so a slot_mapping indexes tokens.
    def _flat(self, layer: torch.Tensor) -> torch.Tensor:
        return layer.view(2, -1, self.hidden)

    def _caches(self, kwargs) -> list[torch.Tensor]:
        caches = kwargs.get("kvcaches", self.kvcaches)
        if caches is None:
            raise ValueError("'kvcaches' must be passed to the connector")
        if len(caches) != self.num_layers:
            raise ValueError(f"expected {self.num_layers} layer caches, got {len(caches)}")
        self.kvcaches = caches
        return caches

    @staticmethod
    def _slots(kwargs, start: int, end: int) -> torch.Tensor:
        if "slot_mapping" not in kwargs:
            raise ValueError("'slot_mapping' must be passed to the connector")
        slots = torch.as_tensor(kwargs["slot_mapping"], dtype=torch.long)[start:end]
        if len(slots) != end - start:
            raise ValueError(f"slot_mapping does not cover tokens [{start}, {end})")
        return slots

    def _check(self, memory_obj: MemoryObj, start: int, end: int) -> torch.Tensor:
        if memory_obj.metadata.fmt != MemoryFormat.KV_2LTD:
            raise ValueError(f"expected a KV_2LTD memory object, got {memory_obj.metadata.fmt}")
        t = memory_obj.tensor
        want = (2, self.num_layers, end - start, self.hidden)
        if t is None or tuple(t.shape) != want:
            got = None if t is None else tuple(t.shape)
            raise ValueError(f"memory object shape {got} does not match {want}")
        return t

    def _rows(self, cache: torch.Tensor, slots: torch.Tensor):
        """(per-kv row views of `cache` as 8-byte words, row ids) for `slots`: whole pages
        when the slots cover them, else single tokens. index_copy_/index_select along dim 0
        on words are row memcpys; along other dims, or on bf16, CPU torch is far slower."""
        blocks = _whole_blocks(slots, cache.shape[2])
        if blocks is not None:
            rows, idx = cache.view(2, cache.shape[1], -1), blocks
        else:
            rows, idx = self._flat(cache), slots
        word = torch.int64 if (rows.shape[-1] * rows.element_size()) % 8 == 0 else torch.uint8
        return [rows[kv].view(word) for kv in range(2)], idx, word

    def to_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs) -> None:
        t = self._check(memory_obj, start, end)
        caches = self._caches(kwargs)
        # Tokens the destination already holds are left alone, as vLLM's connector does.
        skip = min(end - start, max(0, int(kwargs.get("vllm_cached_tokens", 0)) - start))
        slots = self._slots(kwargs, start, end)[skip:]
        if len(slots) == 0:
            return
        for layer, cache in enumerate(caches):
            rows, idx, word = self._rows(cache, slots)
            for kv in range(2):
                src = t[kv, layer, skip:].to(cache.dtype).contiguous().view(word)
                rows[kv].index_copy_(0, idx, src.view(len(idx), -1))

    def from_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs) -> None:
        t = self._check(memory_obj, start, end)
        caches = self._caches(kwargs)
        slots = self._slots(kwargs, start, end)
        for layer, cache in enumerate(caches):
            if cache.dtype != t.dtype:
                raise ValueError(f"KV cache is {cache.dtype}, the memory object {t.dtype}")
            rows, idx, word = self._rows(cache, slots)
            for kv in range(2):
                got = rows[kv].index_select(0, idx)
                t[kv, layer].view(word).view(len(idx), -1).copy_(got)

    def batched_to_gpu(self, memory_objs=None, starts=None, ends=None, **kwargs) -> None:
        objs = list(memory_objs or [])
        with self._lock:
            self.to_gpu_calls += 1
            self.to_gpu_chunks += len(objs)
            self.max_batch_objs = max(self.max_batch_objs, len(objs))
            self.max_batch_bytes = max(self.max_batch_bytes, sum(o.get_size() for o in objs))
        for obj, start, end in zip(objs, starts, ends, strict=True):
            self.to_gpu(obj, start, end, **kwargs)

    def batched_from_gpu(self, memory_objs, starts, ends, **kwargs) -> None:
        for obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(obj, start, end, **kwargs)

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.num_layers, num_tokens, self.hidden])
