"""`bsr-lab bench sglang`: SGLang HiCache's storage read of a long prefix into SGLang's
real host pool (MHA, page_first), three ways on the same pages, interleaved per round:

- bsr: `BsrHiCacheStorage.batch_get_v1`, SGLang's batches of 128 pages (O_DIRECT
  straight into the pool's pages, verified there);
- file: SGLang's own file backend (`HiCacheFile`) through its controller's page get
  (`_generic_page_get`, what SGLang runs for `--hicache-storage-backend file`), from
  cold page cache;
- fio: the payloads of bsr-io's record files, O_DIRECT io_uring, huge-page buffers.

`--layout hybrid` adds DeepSeek-V4's KV-derived sidecar pools (C4, C4 indexer, C128:
`sglang_hybrid.py` says what shape) beside the KV pool, read as SGLang's HiCache v2 does:
the KV through v1, every sidecar of the same pages through `batch_get_v2` (bsr: one
commit, the first page any pool fails ends every pool's prefix; file: `HiCacheFile`'s
own v2). fio reads every pool's record files two ways (a sidecar payload to its last
whole 4 KiB: the files are not padded): all pools at once in one run, a job set per pool
(`fio`), and each pool in turn (`fio_in_turn`, bytes over the runs' summed time); the
ratio to the drive is against the faster of the two.

GiB/s per round and CPU seconds per GiB of this process (every thread; fio's own CPU is
not counted). Every round's pools are zeroed first and compared with the saved bytes
after. Run it in SGLang's venv: `.venv-sglang/bin/bsr-lab bench sglang --json PATH`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from bsr_io.cli.fio import (
    HugeMem,
    drop_caches,
    fio_available,
    fio_read_payloads,
    huge_page_buffers,
)
from bsr_io.cli.host import process_cpu_s
from bsr_io.cli.report import write_json
from bsr_io.cli.scratch import scratch_dir
from bsr_io.model.record import HEADER_BYTES
from bsr_io.model.sizes import GiB, fmt_size, parse_size


def register(bench_subparsers: Any) -> None:
    p = bench_subparsers.add_parser(
        "sglang",
        help="SGLang HiCache storage reads: bsr-io's backend vs HiCacheFile vs fio",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--size", default="1GiB", help="prefix state read per round")
    p.add_argument("--page-tokens", type=int, default=64, help="SGLang's page size")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--window", type=int, default=32, help="W of the bsr backend")
    p.add_argument(
        "--layout",
        choices=("mha", "hybrid"),
        default="mha",
        help="the KV pool alone, or with DeepSeek-V4's sidecar pools (HiCache v2)",
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--fio-buffers",
        choices=("huge", "plain"),
        default="huge",
        help="fio's buffers on huge pages (reserved for the run) or on plain pages",
    )
    p.add_argument("--json", metavar="PATH", help="write the rows as JSON here")
    p.add_argument("--dir", type=Path, default=None, help="base of the scratch directory")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        import torch
        from sglang.srt.managers.cache_controller import HiCacheController, PrefetchOperation
        from sglang.srt.mem_cache.hicache_storage import (
            STORAGE_BATCH_SIZE,
            HiCacheFile,
            HiCacheStorageConfig,
            PoolTransfer,
        )
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
        from sglang.srt.mem_cache.storage import StorageBackendFactory
    except ImportError as exc:
        print(f"bench sglang needs SGLang 0.5.23 (.venv-sglang: scripts/install_sglang.sh): {exc}")
        return 2
    from bsr_io.integrations.sglang import CLASS_NAME, MODULE_PATH
    from bsr_lab.bench.sglang_hybrid import SIDECARS, item_bytes, sidecars

    page = args.page_tokens
    kv_page_bytes = 2 * page * args.layers * args.kv_heads * args.head_dim * 2  # bf16
    side_bytes = {n: args.layers * item_bytes(page, ratio, row) for n, ratio, row in SIDECARS}
    if args.layout == "mha":
        side_bytes = {}
    page_bytes = kv_page_bytes + sum(side_bytes.values())  # every pool's record of a page
    pages = max(1, parse_size(args.size) // page_bytes)
    state = pages * page_bytes
    tokens = pages * page
    print(f"{pages} pages of {fmt_size(page_bytes)} ({args.layout}): {fmt_size(state)} per round")
    device = MHATokenToKVPool(
        tokens,
        page,
        torch.bfloat16,
        args.kv_heads,
        args.head_dim,
        args.layers,
        "cpu",
        False,
        start_layer=0,
        end_layer=args.layers - 1,
    )
    pool = MHATokenToKVPoolHost(
        device.get_device_pool_infos()[0].buffer_info,
        1.0,
        0,
        page,
        "page_first",
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=device.size,
        start_layer=0,
        end_layer=args.layers - 1,
    )
    del device
    flat = pool.kv_buffer.view(-1).view(torch.uint8)
    flat.copy_(torch.randint(0, 256, (flat.numel(),), dtype=torch.uint8))
    saved = flat.clone()
    skip = kv_page_bytes // 2  # page 0 of K (and of V): SGLang's padding page, never stored
    # The sidecars (hybrid): their page 0 is SGLang's padding page too.
    sides = sidecars(page, args.layers, pages + 1) if side_bytes else []
    side_flat = {n: p.kv_buffer.view(-1) for n, p in sides}
    for v in side_flat.values():
        v.copy_(torch.randint(0, 256, (v.numel(),), dtype=torch.uint8))
    side_saved = {n: v.clone() for n, v in side_flat.items()}
    at = torch.arange(page, (pages + 1) * page)  # page 0 is SGLang's padding page
    keys = [f"{i:064x}" for i in range(1, pages + 1)]
    batches = [
        (keys[b : b + STORAGE_BATCH_SIZE], at[b * page : (b + STORAGE_BATCH_SIZE) * page])
        for b in range(0, pages, STORAGE_BATCH_SIZE)
    ]

    def transfers(ks: list[str], idx: Any) -> list[Any]:
        return [PoolTransfer(name=n, host_indices=idx, keys=ks) for n, _ in sides]

    def all_read(name: str, got: dict[str, list[bool]]) -> None:
        bad = {n: g.count(False) for n, g in got.items() if not all(g)}
        assert not bad and len(got) == len(sides), f"{name}: sidecar pages not read: {bad}"

    def config(extra: dict[str, Any]) -> Any:
        return HiCacheStorageConfig(
            tp_rank=0,
            tp_size=1,
            pp_rank=0,
            pp_size=1,
            attn_cp_rank=0,
            attn_cp_size=1,
            is_mla_model=False,
            enable_storage_metrics=False,
            is_page_first_layout=True,
            model_name="bench-sglang",
            extra_config=extra,
        )

    rows: dict[str, list[dict[str, float]]] = {"bsr": [], "file": [], "fio": [], "fio_in_turn": []}
    with scratch_dir(args.dir, "bsr-bench-sglang-", need_bytes=2 * state + (1 << 30)) as root:
        (root / "bsr").mkdir()
        extra = {
            "backend_name": "bsr",
            "module_path": MODULE_PATH,
            "class_name": CLASS_NAME,
            "interface_v1": 1,
            "store_dir": str(root / "bsr"),
            "window": args.window,
        }
        bsr = StorageBackendFactory.create_backend("dynamic", config(extra), pool)
        bsr.register_mem_pool_host(pool)
        hfile = HiCacheFile(config({"file_storage_path": str(root / "file")}))
        hfile.register_mem_pool_host(pool)
        for n, side in sides:  # as SGLang's hybrid attach does
            bsr.register_mem_host_pool_v2(side, n)
            hfile.register_mem_host_pool_v2(side, n)
        bsr.on_host_pools_registered()
        for ks, idx in batches:
            assert all(bsr.batch_set_v1(ks, idx)), "bsr: a page was not stored"
            data = [pool.get_data_page(int(idx[i * page])) for i in range(len(ks))]
            assert hfile.batch_set(ks, data), "HiCacheFile: a page was not stored"
            if sides:
                all_read("bsr set", bsr.batch_set_v2(transfers(ks, idx)))
                all_read("HiCacheFile set", hfile.batch_set_v2(transfers(ks, idx)))
        ctl = object.__new__(HiCacheController)  # only what _generic_page_get reads
        ctl.storage_backend = hfile
        ctl.storage_host_pool = ctl.mem_pool_host = pool
        ctl.page_size = page
        chunks = root / "bsr" / "chunks"
        # Each pool's record files (its namespace) and the payload fio reads of each.
        fio_sets = [(chunks / bsr.groups["kv"].key("").namespace(), kv_page_bytes)]
        fio_sets += [
            (chunks / bsr.groups[n].key("").namespace(), b // 4096 * 4096)
            for n, b in side_bytes.items()
            if b >= 4096
        ]

        def bsr_read() -> None:
            for ks, idx in batches:
                got = bsr.batch_get_v1(ks, idx)
                assert all(got), f"bsr: {got.count(False)} pages not read"
                if sides:
                    all_read("bsr", bsr.batch_get_v2(transfers(ks, idx)))

        def file_read() -> None:
            for ks, idx in batches:
                n = ctl._generic_page_get(PrefetchOperation("bench", []), ks, idx)
                assert n == len(ks), f"HiCacheFile: {len(ks) - n} pages not read"
                if sides:
                    all_read("HiCacheFile", hfile.batch_get_v2(transfers(ks, idx)))

        def fio_read(together: bool) -> tuple[float, int]:
            """Every pool's files, at once (one fio run, a job set per pool: the drive
            sees all of them in flight) or each pool in turn (summed runtimes): seconds,
            bytes read."""
            hugemem = huge if huge.mount else None
            sets = [fio_sets] if together else [[one] for one in fio_sets]
            secs = 0.0
            for group in sets:
                res = fio_read_payloads(
                    [d for d, _ in group],
                    payload_offset=HEADER_BYTES,
                    payload_bytes=[b for _, b in group],
                    files=pages,
                    iodepth=32,
                    hugemem=hugemem,
                )
                secs += res.seconds
            return secs, sum(b for _, b in fio_sets) * pages

        have_fio = fio_available()
        plain = HugeMem(None, "plain pages asked for (--fio-buffers plain)")
        # One buffer per job: the KV's 32 requests, and with sidecars their jobs beside it.
        need = (64 if sides else 32) << 20
        huge_ctx = huge_page_buffers(need) if args.fio_buffers == "huge" else nullcontext(plain)
        with huge_ctx as huge:
            fio_note = huge.note if huge.mount is None else "huge pages (hugetlbfs)"
            for r in range(args.rounds):
                fios = ("fio", "fio_in_turn") if sides else ("fio",)
                for name in ("bsr", "file", *fios):
                    if name.startswith("fio") and not have_fio:
                        continue
                    flat.zero_()
                    for v in side_flat.values():
                        v.zero_()
                    cold = drop_caches()
                    t0, c0 = time.perf_counter(), process_cpu_s()
                    nbytes = state
                    if name.startswith("fio"):
                        secs, nbytes = fio_read(together=name == "fio")
                        cpu = None
                    else:
                        (bsr_read if name == "bsr" else file_read)()
                        secs, cpu = time.perf_counter() - t0, process_cpu_s() - c0
                        # K and V halves, past the padding page: what was read.
                        same = torch.equal(flat.view(2, -1)[:, skip:], saved.view(2, -1)[:, skip:])
                        assert same, f"{name}: the pool differs from the saved bytes"
                        for n, v in side_flat.items():
                            off = side_bytes[n]  # past the padding page
                            same = torch.equal(v[off:], side_saved[n][off:])
                            assert same, f"{name}: pool {n} differs from the saved bytes"
                    row = {
                        "round": r,
                        "gib_s": nbytes / secs / GiB,
                        "seconds": secs,
                        "cold_cache": cold,
                    }
                    if cpu is not None:
                        row["cpu_s_per_gib"] = cpu / (state / GiB)
                    rows[name].append(row)
                    print(
                        f"round {r} {name:>11}: {row['gib_s']:.2f} GiB/s"
                        + (f", {row['cpu_s_per_gib']:.3f} CPU s/GiB" if cpu is not None else "")
                    )
        bsr_stats = dict(bsr.stats)
        bsr.close()

    def med(name: str, key: str) -> float | None:
        vals = [r[key] for r in rows[name] if key in r]
        return statistics.median(vals) if vals else None

    summary = {
        n: {"gib_s": med(n, "gib_s"), "cpu_s_per_gib": med(n, "cpu_s_per_gib")}
        for n in rows
        if rows[n]
    }
    bsr_gib = summary["bsr"]["gib_s"]
    if "file" in summary and bsr_gib and summary["file"]["gib_s"]:
        summary["bsr_over_file"] = {"ratio": bsr_gib / summary["file"]["gib_s"]}
    # The drive's reference is the faster of fio's two ways (a hybrid set's pools at once,
    # or in turn): the strongest measured in the run.
    fio_best = max(
        (summary[n]["gib_s"] or 0.0 for n in ("fio", "fio_in_turn") if n in summary), default=0.0
    )
    if bsr_gib and fio_best:
        summary["bsr_over_fio"] = {"ratio": bsr_gib / fio_best}
    for k, v in summary.items():
        print(f"{k}: {v}")
    write_json(
        args.json,
        {
            "bench": "sglang",
            "sglang": __import__("sglang").__version__,
            "ran": "CPU only: SGLang's own host pool classes (MHATokenToKVPoolHost"
            + (
                ", DeepSeekV4PagedHostPool for each sidecar) over CPU tensors standing in "
                "for the device pools, of the row bytes SGLang's device pool code gives "
                "(bsr_lab.bench.sglang_hybrid)"
                if sides
                else ") over a CPU tensor standing in for the device pool"
            )
            + "; reads from the store directory's drive, page cache dropped before each",
            "pages": pages,
            "page_bytes": page_bytes,
            "pool_page_bytes": {"kv": kv_page_bytes, **side_bytes},
            "state_bytes": state,
            "page_tokens": page,
            "layout": "page_first",
            "pools": args.layout,
            "fio_payload_bytes": {str(d.name): b for d, b in fio_sets},
            "fio_buffers": fio_note,
            "window": args.window,
            "rounds": rows,
            "summary": summary,
            "bsr_backend_stats": bsr_stats,
        },
    )
    return 0
