"""Save a real model's KV cache, restore it through the windowed install, continue generating.

Faults are real damage to the stored records (a flipped payload byte; a record file
removed after the probe, as a concurrent eviction would), not test doubles.
"""

import copy
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from bsr_io import Engine, Restorer, SSDTier, Store  # noqa: E402
from bsr_io.integrations.hf_compat import kv_tensors, new_cache  # noqa: E402
from bsr_io.integrations.transformers import (  # noqa: E402
    continue_greedy,
    kv_layout,
    prefill,
    restore_prefix,
    save_prefix,
)
from bsr_lab.tiny_models import tiny_model  # noqa: E402

CT = 16  # chunk tokens
SUFFIX = 5
STEPS = 6
MAX_W = 8


def _tokens(n, seed=11):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))


class Setup:
    """A model, its layout, an L2 store on disk and restorers of several windows."""

    def __init__(self, root, family, dtype=torch.float32):
        self.model = tiny_model(family, dtype=dtype)
        self.layout = kv_layout(self.model.config, chunk_tokens=CT, dtype=dtype)
        self.engine = Engine(MAX_W, self.layout.chunk_bytes)
        self.tier = SSDTier(root, None, self.engine, layout=self.layout)
        self.store = Store([self.tier])

    def restorer(self, window):
        return Restorer(self.store, self.layout, window=window, engine=self.engine, model="tiny")

    def original(self, ids):
        """The prefix cache as first computed, and the continuation it gives."""
        cache, _ = prefill(self.model, ids, chunk_tokens=CT)
        return cache

    def record_path(self, ids, chunk):
        return self.tier.path_of(self.restorer(1).keys(ids.tolist())[chunk])


def _continue(model, cache, suffix):
    return continue_greedy(model, copy.deepcopy(cache), suffix, STEPS)


@pytest.mark.parametrize(
    "family,dtype",
    [
        ("llama", torch.float32),
        ("qwen3", torch.float32),
        ("llama", torch.bfloat16),
        ("deepseek_v3", torch.float32),  # MLA: the latent and rotary key per layer
    ],
)
@pytest.mark.parametrize("prefix", [3 * CT, 3 * CT + 11, 5 * CT + 9])
def test_restored_continuation_is_bit_identical(tmp_path, family, dtype, prefix):
    s = Setup(tmp_path, family, dtype)
    ids = _tokens(prefix + SUFFIX)
    prompt, suffix = ids[:prefix], ids[prefix:]
    original = s.original(prompt)
    ref_tokens, ref_logits = _continue(s.model, original, suffix)
    assert save_prefix(s.restorer(2), prompt, original) == prefix // CT

    chunks = prefix // CT
    for window in (1, 2, MAX_W):  # W=1, W < chunks, W > chunks
        cache, res = restore_prefix(s.restorer(window), s.model, prompt)
        assert res.outcome == "complete", res.reason
        assert res.committed_chunks == chunks and res.committed_tokens == chunks * CT
        assert res.bytes_read == {"L2": chunks * s.layout.chunk_bytes}
        # The window fills (the engine has MAX_W slots, more than W=1 and W=2).
        assert res.rws_peak_bytes == min(window, chunks) * s.engine.slot_bytes
        assert cache.get_seq_length() == prefix
        for (k0, v0), (k1, v1) in zip(kv_tensors(original), kv_tensors(cache), strict=True):
            assert torch.equal(k0, k1) and torch.equal(v0, v1)
        tokens, logits = continue_greedy(s.model, cache, suffix, STEPS)
        assert torch.equal(logits, ref_logits), f"W={window}"
        assert tokens == ref_tokens


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral", "deepseek_v3"])
def test_restore_agrees_with_one_pass_recompute(tmp_path, family):
    s = Setup(tmp_path, family)
    prefix = 4 * CT + 7
    ids = _tokens(prefix + SUFFIX, seed=12)
    prompt, suffix = ids[:prefix], ids[prefix:]
    save_prefix(s.restorer(2), prompt, s.original(prompt))

    cache, res = restore_prefix(s.restorer(2), s.model, prompt)
    assert res.outcome == "complete"
    tokens, logits = continue_greedy(s.model, cache, suffix, STEPS)
    # One forward over prefix + suffix, then greedy decoding: no cache reuse at all.
    full_tokens, full_logits = continue_greedy(s.model, new_cache(s.model), ids, STEPS)
    assert tokens == full_tokens
    torch.testing.assert_close(logits, full_logits[prefix:], rtol=1e-4, atol=1e-4)


def _flip_payload_byte(path):
    with open(path, "r+b") as f:  # in place: same inode, header untouched
        f.seek(-1, os.SEEK_END)
        b = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([b[0] ^ 0x5A]))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("fault", ["corrupt", "missing"])
def test_damaged_chunk_gives_zero_then_recompute_same_tokens(tmp_path, family, fault):
    s = Setup(tmp_path, family)
    prefix = 5 * CT + 3
    ids = _tokens(prefix + SUFFIX, seed=13)
    prompt, suffix = ids[:prefix], ids[prefix:]
    original = s.original(prompt)
    ref_tokens, ref_logits = _continue(s.model, original, suffix)
    save_prefix(s.restorer(2), prompt, original)

    r = s.restorer(2)
    plan = r.probe(prompt.tolist())
    assert plan.hit_chunks == 5
    path = s.record_path(prompt, 3)
    if fault == "corrupt":
        _flip_payload_byte(path)
    else:
        os.unlink(path)  # gone between probe and read
    cache, res = restore_prefix(r, s.model, prompt, plan=plan)
    assert res.outcome == "zero" and res.committed_tokens == 0
    assert res.reason
    assert cache.get_seq_length() == prefix  # recomputed
    tokens, logits = continue_greedy(s.model, cache, suffix, STEPS)
    assert tokens == ref_tokens
    assert torch.equal(logits, ref_logits)  # the same chunk-aligned computation
    # The damaged record is never advertised again: the next probe stops before it.
    assert r.probe(prompt.tolist()).hit_chunks == 3


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_l1_read_error_falls_back_to_l2_and_still_restores(tmp_path, family):
    """An I/O error in L1 (injected by the faults test double) is served from L2."""
    from bsr_io import MemoryTier
    from bsr_io.faults import Fault, FaultPlan, bind

    s = Setup(tmp_path, family)
    l1 = MemoryTier(16 * s.layout.chunk_bytes, layout=s.layout)
    s.store = Store(FaultPlan([Fault("error", tier="L1", chunks=[2])]).wrap_all([l1, s.tier]))
    prefix = 4 * CT + 2
    ids = _tokens(prefix + SUFFIX, seed=15)
    prompt, suffix = ids[:prefix], ids[prefix:]
    bind(s.store.tiers, s.restorer(2).keys(prompt.tolist()))  # chunks=[2] is this prompt's
    original = s.original(prompt)
    ref_tokens, ref_logits = _continue(s.model, original, suffix)
    save_prefix(s.restorer(2), prompt, original)  # written through to L1 and L2

    cache, res = restore_prefix(s.restorer(2), s.model, prompt)
    assert res.outcome == "complete" and res.committed_chunks == 4
    assert res.source_tiers == ["L1", "L1", "L2", "L1"]
    assert len(res.fallbacks) == 1
    tokens, logits = continue_greedy(s.model, cache, suffix, STEPS)
    assert tokens == ref_tokens
    assert torch.equal(logits, ref_logits)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_restore_into_a_cuda_cache(tmp_path):
    s = Setup(tmp_path, "llama", torch.bfloat16)
    s.model.to("cuda")
    prefix = 4 * CT + 5
    ids = _tokens(prefix + SUFFIX, seed=14).cuda()
    prompt, suffix = ids[:prefix], ids[prefix:]
    original = s.original(prompt)
    ref_tokens, ref_logits = _continue(s.model, original, suffix)
    save_prefix(s.restorer(2), prompt, original)
    cache, res = restore_prefix(s.restorer(2), s.model, prompt)
    assert res.outcome == "complete" and res.committed_chunks == 4
    tokens, logits = continue_greedy(s.model, cache, suffix, STEPS)
    assert tokens == ref_tokens
    assert torch.equal(logits, ref_logits)
