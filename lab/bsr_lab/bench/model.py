"""`bsr-lab bench model`: time to first token on a real transformers model, restore vs recompute.

For each prefix length: the prefix's KV cache is computed (chunk-aligned prefill),
saved to an L2 directory through bsr-io, then the first token after the prefix is
produced twice from nothing but the token ids: once by restoring the cache through
the windowed install (the tail that is not a whole chunk is recomputed) and once by
recomputing the whole prefix, the integration's fallback. The ratio is
recompute / restore in the same run. `bit_identical` compares the first-token logits
of the restored continuation with those of the original in-memory cache.
The model is a small random-weight one (no download); at this size recompute is cheap,
so the ratio understates what a real model gains.
"""

from __future__ import annotations

import copy
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

from bsr_io.cli.report import write_json
from bsr_io.cli.scratch import make_scratch
from bsr_io.model.sizes import fmt_size

DTYPES = ("float32", "bfloat16", "float16")


def register(bench_subparsers) -> None:
    p = bench_subparsers.add_parser(
        "model",
        help="TTFT on a real transformers model: restore through bsr-io vs recompute",
        description=__doc__,
    )
    p.add_argument("--json", metavar="PATH", help="write the rows as JSON here")
    p.add_argument(
        "--prefix-tokens",
        default="512,1500,4096",
        help="comma-separated prefix lengths (any, not only whole chunks)",
    )
    p.add_argument("--family", default="llama", help="llama, qwen3 or mistral")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1000)
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--window", type=int, default=4, help="W, chunks staged at once")
    p.add_argument("--repeat", type=int, default=5, help="timed runs per case; the median is kept")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (1 avoids spin-waits on a shared host)",
    )
    p.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="base of the L2 directory (default: a temp dir on disk; removed)",
    )
    p.set_defaults(func=run)


def _ttft(model, make_cache, prompt, first_input):
    """(seconds from nothing to the first token's logits, those logits, RestoreResult)."""
    from bsr_io.integrations.hf_compat import forward

    t0 = time.perf_counter()
    cache, result = make_cache(prompt)
    logits, _ = forward(model, first_input[None], cache)
    first = logits[0, -1]
    int(first.argmax())  # the token itself, so nothing is left lazy
    return time.perf_counter() - t0, first, result


def measure(model, restorer, prompt, first_input, chunk_tokens: int, repeat: int) -> dict:
    """One row: restore and recompute TTFT (median of `repeat`) for `prompt`."""
    import torch

    from bsr_io.integrations.hf_compat import forward
    from bsr_io.integrations.transformers import prefill, restore_prefix, save_prefix

    with torch.no_grad():
        original, _ = prefill(model, prompt, chunk_tokens=chunk_tokens)
        save_prefix(restorer, prompt, original)
        ref, _ = forward(model, first_input[None], copy.deepcopy(original))
        ref = ref[0, -1]

        def restored(ids):
            return restore_prefix(restorer, model, ids)

        def recomputed(ids):
            return prefill(model, ids, chunk_tokens=chunk_tokens)[0], None

        restore_s, recompute_s, identical, results = [], [], True, []
        for i in range(repeat + 1):  # run 0 warms this prefix length's shapes; not timed
            s, logits, res = _ttft(model, restored, prompt, first_input)
            results.append(res)
            identical &= bool(torch.equal(logits, ref))
            s2, _, _ = _ttft(model, recomputed, prompt, first_input)
            if i:
                restore_s.append(s)
                recompute_s.append(s2)
    res = results[-1]
    return {
        "prefix_tokens": int(prompt.numel()),
        "restored_tokens": res.committed_tokens,
        "outcome": res.outcome,
        "state_bytes": restorer.layout.state_bytes(int(prompt.numel())),
        "restore_ttft_s": statistics.median(restore_s),
        "recompute_ttft_s": statistics.median(recompute_s),
        "rws_peak_bytes": max(r.rws_peak_bytes for r in results),
        "window": restorer.window,
        "bit_identical": identical and all(r.outcome == "complete" for r in results),
    }


def table(rows: list[dict]) -> str:
    lines = [
        f"{'prefix':>7} {'restored':>8} {'state':>10} {'restore TTFT':>12} "
        f"{'recompute TTFT':>14} {'ratio':>6} {'RWS peak':>10} {'bit-identical':>13}"
    ]
    for r in rows:
        ratio = r["recompute_ttft_s"] / r["restore_ttft_s"]
        lines.append(
            f"{r['prefix_tokens']:>7} {r['restored_tokens']:>8} {fmt_size(r['state_bytes']):>10} "
            f"{r['restore_ttft_s']:>10.4f} s {r['recompute_ttft_s']:>12.4f} s {ratio:>5.1f}x "
            f"{fmt_size(r['rws_peak_bytes']):>10} {str(r['bit_identical']):>13}"
        )
    return "\n".join(lines)


def run(args) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from bsr_io import Engine, Restorer, SSDTier, Store
    from bsr_io.integrations.transformers import kv_layout
    from bsr_lab.tiny_models import tiny_model

    lengths = [int(s) for s in args.prefix_tokens.split(",") if s.strip()]
    if not lengths or min(lengths) < args.chunk_tokens:
        raise ValueError(f"every prefix must hold at least one chunk ({args.chunk_tokens} tokens)")
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    model = tiny_model(
        args.family,
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        kv_heads=args.kv_heads,
        vocab=args.vocab,
        max_tokens=max(lengths) + 8,
        dtype=dtype,
        seed=args.seed,
    )
    layout = kv_layout(model.config, chunk_tokens=args.chunk_tokens, dtype=dtype)
    root = make_scratch(args.dir, "bsr-bench-model-")
    engine = Engine(args.window, layout.chunk_bytes)
    summary = layout.describe().split(";")[0]
    print(
        f"{args.family}, {args.layers} layers, {summary}; W={args.window}; "
        f"L2 {root} ({engine.backend})",
        file=sys.stderr,
    )
    rows = []
    try:
        store = Store([SSDTier(root, None, engine, layout=layout)])
        restorer = Restorer(store, layout, window=args.window, engine=engine, model=args.family)
        gen = torch.Generator().manual_seed(args.seed + 1)
        for n in lengths:
            ids = torch.randint(0, args.vocab, (n + 1,), generator=gen)
            rows.append(measure(model, restorer, ids[:n], ids[n:], args.chunk_tokens, args.repeat))
            print(f"  {n} tokens done", file=sys.stderr, flush=True)
    finally:
        engine.close()
        shutil.rmtree(root, ignore_errors=True)
    print(table(rows))
    write_json(args.json, {"config": vars(args) | {"func": None}, "rows": rows})
    return 0 if all(r["bit_identical"] for r in rows) else 1
