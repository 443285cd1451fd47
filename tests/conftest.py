"""Shared pytest fixtures."""

from __future__ import annotations

import pytest
from bsr_io import BackendUnavailable, Engine

ENGINE_BACKENDS = ("io_uring", "io_uring_plain", "pread")


@pytest.fixture(params=ENGINE_BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    """Each engine backend in turn; io_uring ones skip where the kernel refuses them."""
    name = request.param
    if name != "pread":
        try:
            Engine(1, 4096, backend=name).close()
        except BackendUnavailable as exc:
            pytest.skip(f"{name} unavailable here: {exc}")
    return name


@pytest.fixture
def engines():
    """LMCache engines (real lmcache 0.5.6) of the default test shape, closed afterwards."""
    h = pytest.importorskip("bsr_io.testing.lmcache.harness")
    e = h.Engines(h.Shape())
    yield e
    e.close()
