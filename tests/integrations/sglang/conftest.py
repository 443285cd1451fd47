"""bsr-io's SGLang HiCache backend against SGLang 0.5.23's own classes.

These run in SGLang's own virtualenv (scripts/install_sglang.sh):
`.venv-sglang/bin/python -m pytest tests/integrations/sglang`. They never skip: without
SGLang the import below fails the run. HiCache as an engine feature needs a GPU (its
host-device copy kernels ship only in the GPU builds), so these drive SGLang's real
host pools, storage config, backend factory and cache controller code on the CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

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


@pytest.fixture
def run_stall_worker(store_dir: Path, tmp_path: Path) -> Callable[[str], dict[str, Any]]:
    """Runs a kernel-stall worker of this folder (stall_worker.py, hybrid_stall_worker.py:
    each says why in a process of its own) on an empty store and returns the facts it
    wrote. THP_MEM_ALLOC_ENABLE makes SGLang's host pool page-aligned, as the workers'
    O_DIRECT reads through FUSE need."""

    def run(worker: str) -> dict[str, Any]:
        out = tmp_path / "facts.json"
        done = subprocess.run(
            [sys.executable, str(Path(__file__).parent / worker), str(store_dir), str(out)],
            env={**os.environ, "THP_MEM_ALLOC_ENABLE": "1"},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-4000:]
        facts: dict[str, Any] = json.loads(out.read_text())
        return facts

    return run
