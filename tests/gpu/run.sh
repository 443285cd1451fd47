#!/usr/bin/env bash
# The GPU checks from a carried wheel; builds nothing (a device machine has torch but no
# network). Here:    maturin build --release -o dist   (an abi3 wheel, ~0.5 MB)
# There:             bash tests/gpu/run.sh dist/bsr_io-*.whl
set -euo pipefail
cd "$(dirname "$0")/../.."
WHEEL=${1:?usage: tests/gpu/run.sh path/to/bsr_io-*.whl}
SITE=$(mktemp -d)
trap 'rm -rf "$SITE"' EXIT
python3 -m pip install -q --no-index --no-deps --target "$SITE" "$WHEEL"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
PYTHONPATH="$SITE" timeout 280 python3 tests/gpu/check_cuda.py
