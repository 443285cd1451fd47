#!/usr/bin/env bash
# Install bsr-io for development into ./.venv: system tools, Python deps, the Rust extension.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v fio >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq fio >/dev/null
    else
        echo "note: fio not found; 'bsr-lab bench ssd' needs it (apt-get install fio)" >&2
    fi
fi
[ -x .venv/bin/python ] || python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q -U pip
python -m pip install -q -r requirements-dev.txt
maturin develop --release -q
# The wheel a deployment installs on every node (abi3: one build for Python 3.11+), from
# the same build: target/wheels/bsr_io-*-abi3-*.whl.
rm -f target/wheels/bsr_io-*.whl
maturin build --release -q -o target/wheels
# The lab (tests' and lab benchmarks' support, `bsr-lab`): editable, never in the wheel.
python -m pip install -q --no-deps -e lab
