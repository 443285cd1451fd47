"""bsr-io's SGLang HiCache backend against SGLang 0.5.23's own classes.

These run in SGLang's own virtualenv (scripts/install_sglang.sh):
`.venv-sglang/bin/python -m pytest tests/integrations/sglang`. They never skip: without
SGLang the import below fails the run. HiCache as an engine feature needs a GPU (its
host-device copy kernels ship only in the GPU builds), so these drive SGLang's real
host pools, storage config, backend factory and cache controller code on the CPU.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import sglang  # noqa: F401  - a missing SGLang must fail loudly, never skip
from pools import make_backend, mha_pool

from bsr_io.integrations.sglang.backend import BsrHiCacheStorage

# SGLang hashes page keys in a C++ extension it builds on first use with torch's
# loader, which runs `ninja` from PATH: the venv's own, when pytest runs as
# `.venv-sglang/bin/python -m pytest` without the venv activated.
os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    d = tmp_path / "store"
    d.mkdir()
    return d


@pytest.fixture(params=["page_first", "layer_first"])
def host_layout(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def backend(store_dir: Path, host_layout: str) -> Iterator[BsrHiCacheStorage]:
    b = make_backend(store_dir, mha_pool(host_layout))
    yield b
    b.close()
