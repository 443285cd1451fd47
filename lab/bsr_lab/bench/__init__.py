"""Lab-only benchmarks, registered under `bsr-lab bench`."""
