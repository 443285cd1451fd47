#!/usr/bin/env bash
# mypy_integration.sh vllm|sglang: an integration's types, strict, checked against the
# host's own (vLLM and SGLang ship theirs) in its virtualenv, with the cache there. Its
# files are named here because pyproject's exclude keeps them out of the plain `mypy` run
# (their hosts are not in .venv); vLLM's also covers the lab's vLLM harness.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
vllm) dirs=(python/bsr_io/integrations/vllm lab/bsr_lab/vllm) ;;
sglang) dirs=(python/bsr_io/integrations/sglang) ;;
*)
    echo "usage: $0 vllm|sglang" >&2
    exit 2
    ;;
esac
venv=.venv-$1
mapfile -t files < <(find "${dirs[@]}" -name '*.py')
exec "$venv/bin/python" -m mypy --strict --cache-dir "$venv/mypy-cache" "${files[@]}"
