#!/usr/bin/env bash
# SGLang's own virtualenv (./.venv-sglang): sglang 0.5.23 pins torch 2.14.1 and
# transformers 5.19, apart from ./.venv's. PyPI serves no CPU-only torch for Linux
# (its CPU wheels live on PyTorch's own index, which this project's machines cannot
# reach), so torch is PyPI's CUDA build, which imports without a GPU. sglang and its
# kernel wheel go in without their dependencies (flashinfer, flash-attn, DeepEP and the
# other GPU kernels are gigabytes, and nothing HiCache's storage seam imports needs
# them), then the part of sglang's own requirements that its host pools, storage
# backends and cache controller import, at sglang's pins.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
VENV=${BSR_IO_SGLANG_VENV:-.venv-sglang}
T0=$SECONDS
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
. "$VENV/bin/activate"
python -m pip install -q -U pip packaging
if ! python -c "import sglang.srt.managers.cache_controller" >/dev/null 2>&1; then
    python -m pip install -q torch==2.14.1
    python -m pip install -q --no-deps sglang==0.5.23 sglang-kernel==0.4.10
    python - <<'PY' > "$VENV/sglang-rest.txt"
from importlib.metadata import requires
from packaging.requirements import Requirement

# What sglang.srt.mem_cache (host pools, storage, the backend factory) and
# sglang.srt.managers.cache_controller import, found by importing them.
keep = {
    "numpy", "orjson", "psutil", "pybase64", "requests", "pillow", "msgspec",
    "pydantic", "pyzmq", "tqdm", "ipython", "aiohttp", "transformers", "torchvision",
    "apache-tvm-ffi", "sentencepiece", "compressed-tensors", "gguf", "fastapi", "tokenizers",
    "ninja",  # SGLang builds its page-key hash extension with it on first use
}
for spec in requires("sglang") or []:
    req = Requirement(spec)
    if req.name.lower() not in keep:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    print(str(req).split(";")[0])
PY
    # torch stays at the pin: torchvision is resolved to the build made for it.
    python -m pip install -q -r "$VENV/sglang-rest.txt" dill torch==2.14.1
fi
# bsr-io itself, built into this venv (abi3 extension), the test tools, and Mooncake
# (tests/integrations/sglang read from a real loopback pool below the SSD tier).
python -m pip install -q "maturin>=1.16,<2" "pytest>=8" "prometheus-client>=0.19" "mypy>=1.11" \
    "mooncake-transfer-engine-non-cuda==0.3.13.post1"
develop_bsr_io
python -m pip install -q --no-deps -e lab
python -c "import sglang, bsr_io._core, bsr_lab; print('sglang', sglang.__version__)"
echo "install_sglang: $((SECONDS - T0)) s"
