"""Integrations with serving stacks and model libraries.

Each submodule imports its framework lazily: `bsr_io.integrations.transformers`
needs `transformers`, `bsr_io.integrations.lmcache` needs `lmcache`.
"""
