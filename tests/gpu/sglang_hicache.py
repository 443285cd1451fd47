"""SGLang's engine with bsr-io as HiCache's storage tier, on a GPU: `python
tests/gpu/sglang_hicache.py` where sglang 0.5.23 (its GPU build) and bsr-io are
installed. Exit 0 when every check passed, 2 when there is no GPU or no SGLang here.

A tiny Llama (2 layers, random weights: `--load-format dummy`, token ids in, token ids
out, so no download and no tokenizer) is served twice on 127.0.0.1:
- with `--hicache-storage-backend dynamic` and bsr-io's backend: a long prompt, then
  `/flush_cache` (the GPU and host tiers are emptied, storage is not), then the same
  prompt: its prefix must come back as cached tokens, restored from storage, and the
  greedy output must be the first run's;
- without HiCache: the same prompt's greedy output must be the same again.
Not run yet: this project's machines have no GPU (docs/sglang.md).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

PAGE, PROMPT, NEW = 64, 4096, 16
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 32000,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _post(url: str, doc: dict | None = None, timeout: float = 120) -> dict:
    data = json.dumps(doc or {}).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        body = r.read()
    return json.loads(body) if body.strip().startswith(b"{") else {}


def _serve(model: Path, extra: list[str], log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = _port()
    cmd = [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(model),
        "--load-format",
        "dummy",
        "--skip-tokenizer-init",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--page-size",
        str(PAGE),
        "--mem-fraction-static",
        "0.3",
        "--disable-cuda-graph",
        "--enable-cache-report",
        "--random-seed",
        "0",
        *extra,
    ]
    proc = subprocess.Popen(
        cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}:\n{_tail(log)}")
        try:
            urllib.request.urlopen(f"{base}/health", timeout=5)
            return proc, base
        except OSError:
            time.sleep(2)
    _stop(proc)
    raise RuntimeError(f"server not ready in 240 s:\n{_tail(log)}")


def _tail(log: Path, lines: int = 40) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def _stop(proc: subprocess.Popen[bytes]) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def _generate(base: str, ids: list[int]) -> tuple[list[int], int]:
    out = _post(
        f"{base}/generate",
        {
            "input_ids": ids,
            "sampling_params": {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True},
        },
    )
    return out["output_ids"], int(out["meta_info"].get("cached_tokens", 0))


def main() -> int:
    try:
        import sglang  # noqa: F401
        import torch
    except ImportError as exc:
        print(f"no SGLang here ({exc}): nothing to check")
        return 2
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 2
    root = Path(tempfile.mkdtemp(prefix="bsr-sglang-gpu-"))
    model, store = root / "model", root / "store"
    model.mkdir()
    store.mkdir()
    (model / "config.json").write_text(json.dumps(CONFIG))
    ids = [(7 * i + 3) % 30000 + 10 for i in range(PROMPT)]
    extra = {
        "backend_name": "bsr",
        "module_path": "bsr_io.integrations.sglang.backend",
        "class_name": "BsrHiCacheStorage",
        "interface_v1": 1,
        "store_dir": str(store),
    }
    failures = []
    try:
        proc, base = _serve(
            model,
            [
                "--enable-hierarchical-cache",
                "--hicache-ratio",
                "2",
                "--hicache-storage-backend",
                "dynamic",
                "--hicache-storage-prefetch-policy",
                "wait_complete",
                "--hicache-storage-backend-extra-config",
                json.dumps(extra),
            ],
            root / "bsr.log",
        )
        try:
            first, _ = _generate(base, ids)
            time.sleep(5)  # the backup to storage is asynchronous
            _post(f"{base}/flush_cache")
            second, cached = _generate(base, ids)
        finally:
            _stop(proc)
        records = len(list(store.rglob("*.chunk")))
        print(f"storage: {records} records; second run cached_tokens={cached}")
        if records < PROMPT // PAGE - 1:
            failures.append(f"only {records} pages stored")
        if cached < PROMPT - PAGE:
            failures.append(f"restore not reported as a hit: cached_tokens={cached}")
        if second != first:
            failures.append("output after the restore differs from the first run's")
        proc, base = _serve(model, [], root / "plain.log")
        try:
            plain, _ = _generate(base, ids)
        finally:
            _stop(proc)
        if plain != first:
            failures.append("output with the storage tier differs from the plain engine's")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for f in failures:
        print("FAIL:", f)
    print("ok" if not failures else f"{len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
