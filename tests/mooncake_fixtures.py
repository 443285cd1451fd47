"""Fixtures for the Mooncake tier's tests: a real master and storage node on loopback.

Import the fixtures into a test module (`from mooncake_fixtures import netns, pool`).
As root, the module's tests and everything they start run in a fresh network namespace
holding only `lo`, so no byte can leave loopback. In CI (CI=true) a missing mooncake
package fails the tests instead of skipping them.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import sys

import pytest

from bsr_lab.loopback_pool import (
    LoopbackNetns,
    LoopbackPool,
    loopback_netns,
    netns_possible,
)

os.environ.setdefault("GLOG_minloglevel", "2")  # Mooncake's client logs every call at INFO


def require_mooncake() -> None:
    if importlib.util.find_spec("mooncake") is not None:
        return
    why = "mooncake-transfer-engine-non-cuda is not installed (pip install 'bsr-io[mooncake]')"
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"{why}; CI must install requirements-dev.txt", pytrace=False)
    pytest.skip(why)


def _exit_before_mooncake_teardown(session: pytest.Session) -> None:
    # Mooncake 0.3.13's clients abort the interpreter at exit (std::terminate, rc 134)
    # once a pool they used is gone: leave with pytest's own status before that.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(getattr(session, "exitstatus", 1)))


@pytest.fixture(scope="session")
def _loopback_ns(request):
    """One loopback-only namespace for the whole session (None when not root)."""
    atexit.register(_exit_before_mooncake_teardown, request.session)
    ns = LoopbackNetns() if netns_possible() else None
    yield ns
    if ns is not None:
        ns.close()


@pytest.fixture(scope="module")
def netns(_loopback_ns):
    """True when the module runs in the loopback-only network namespace."""
    require_mooncake()
    if _loopback_ns is None:
        yield False
        return
    with loopback_netns(_loopback_ns) as inside:
        yield inside


def start_pool(workdir, **kw) -> LoopbackPool:
    kw.setdefault("segment_bytes", 256 << 20)
    return LoopbackPool(workdir=workdir, **kw).start()


@pytest.fixture(scope="module")
def pool(netns, tmp_path_factory):
    """A pool shared by the module's tests that do not harm it."""
    p = start_pool(tmp_path_factory.mktemp("mooncake"))
    yield p
    p.stop()


@pytest.fixture
def fresh_pool(netns, tmp_path):
    """A pool of its own, for a test that kills, stops or fills it."""
    p = start_pool(tmp_path / "pool", lease_ttl_ms=500)
    yield p
    p.stop()
