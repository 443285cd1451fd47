#!/usr/bin/env bash
# The static checks and Rust's tests (fmt, clippy, cargo test, ruff, mypy, stubtest), each a
# stage of its own; exit 1 if any failed. scripts/test.sh runs this beside the Python tests:
# these compile and type-check on one core (cargo -j1) while the tests mostly wait on
# I/O, deadlines and subprocesses. Needs scripts/install.sh done (.venv).
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/stages.sh
. .venv/bin/activate
stage rust-fmt cargo fmt --all --check
stage rust-clippy-no-default cargo clippy -j1 --all-targets --no-default-features -- -D warnings
stage rust-clippy cargo clippy -j1 --all-targets -- -D warnings
stage rust-test cargo test -j1 --no-default-features
stage ruff ruff check python tests benches lab
stage ruff-format ruff format --check python tests benches lab
# Types: strict on everything installed but the vLLM and SGLang integrations (checked by
# scripts/test.sh in the venvs that have them), and the engine stub against the module.
stage mypy mypy
stage stubtest python -m mypy.stubtest bsr_io._core --allowlist scripts/stubtest-allowlist.txt
finish
