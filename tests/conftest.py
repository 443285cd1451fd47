"""Shared pytest fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest

from bsr_io import BackendUnavailable, Engine

ENGINE_BACKENDS = ("io_uring", "io_uring_plain", "pread")
VLLM_TESTS = Path(__file__).parent / "integrations" / "vllm"
SGLANG_TESTS = Path(__file__).parent / "integrations" / "sglang"


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """tests/integrations/vllm and tests/integrations/sglang run only in their engine's
    own venv and only when named on the command line (`.venv-vllm/bin/python -m pytest
    tests/integrations/vllm`, `.venv-sglang/bin/python -m pytest tests/integrations/sglang`);
    the main suite never collects them."""
    if collection_path not in (VLLM_TESTS, SGLANG_TESTS):
        return None
    for arg in config.args:
        if Path(arg.split("::")[0]).resolve().is_relative_to(collection_path):
            return None
    return True


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
    h = pytest.importorskip("bsr_lab.lmcache.harness")
    e = h.Engines(h.Shape())
    yield e
    e.close()
