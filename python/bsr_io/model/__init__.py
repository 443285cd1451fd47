"""The model of the data: chunk keys and prefix hashes, KV layouts, records, sizes."""
