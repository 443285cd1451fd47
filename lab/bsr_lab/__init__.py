"""bsr-io's lab: what tests and lab-only benchmarks use to provoke and observe.

Not installed with bsr-io (scripts/install.sh installs it in development); the package
never imports it. Its benches need a third-party stack (vLLM, LMCache, transformers
models) or the fault scenarios: `bsr-lab bench NAME`.
"""
