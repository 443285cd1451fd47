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
python -m pytest -q "$@"
