"""bsr-io inside LMCache 0.5.6: a storage plugin serving chunks from bsr-io's SSD tier,
and a bounded, all-or-nothing retrieve for LMCache's engine.

Turn it on from LMCache's config (see `config.py` and docs/lmcache.md):
`storage_plugins: [bsr]` with `extra_config` keys `storage_plugin.bsr.module_path:
bsr_io.integrations.lmcache.plugin`, `storage_plugin.bsr.class_name: BsrStoragePlugin`
and `bsr.path`, `bsr.window`, ... Submodules import `lmcache` themselves.
"""
