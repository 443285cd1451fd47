"""The engine degrades step by step and says why: memlock limits drop fixed buffers,
a refused io_uring_setup falls back to the pread pool (or raises when io_uring was
asked for explicitly). Each case runs in a subprocess with real kernel limits."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

MEMLOCK_PROBE = """
import json
from bsr_io import Engine
e = Engine(4, 16 << 20, backend="io_uring")
print(json.dumps(e.features))
"""

# Use up every descriptor so io_uring_setup fails with EMFILE (a real refusal);
# mmap and threads need no descriptor, so the pread pool still starts.
NOFILE_PROBE = """
import json, os, resource
from bsr_io import BackendUnavailable, Engine
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
fds = []
try:
    while True:
        fds.append(os.open("/dev/null", os.O_RDONLY))
except OSError:
    pass
out = {}
try:
    Engine(1, 4096, backend="io_uring")
except BackendUnavailable as exc:
    out["explicit"] = [exc.errno, str(exc)]
e = Engine(1, 4096)
out["auto"] = e.backend
out["notes"] = e.features["notes"]
for fd in fds:
    os.close(fd)
print(json.dumps(out))
"""


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_memlock_limit_drops_fixed_buffers() -> None:
    """Without CAP_IPC_LOCK and with a 1 MiB memlock limit, registering a 64 MiB arena
    fails with ENOMEM: the engine keeps io_uring with plain reads and says so."""
    if shutil.which("prlimit") is None or shutil.which("setpriv") is None:
        pytest.skip("needs prlimit and setpriv")
    r = _run(
        ["prlimit", "--memlock=1048576:1048576", "setpriv", "--bounding-set=-ipc_lock"]
        + ["--inh-caps=-ipc_lock", sys.executable, "-c", MEMLOCK_PROBE]
    )
    if r.returncode != 0 and "setpriv" in r.stderr:
        pytest.skip(f"cannot drop CAP_IPC_LOCK here: {r.stderr[-200:]}")
    assert r.returncode == 0, r.stderr
    feats = json.loads(r.stdout)
    assert feats["backend"] == "io_uring"
    assert feats["fixed_buffers"] is False
    assert feats["mlock"] is False
    assert "RLIMIT_MEMLOCK" in feats["notes"] and "mlock refused" in feats["notes"]


def test_refused_io_uring_falls_back_to_pread() -> None:
    r = _run([sys.executable, "-c", NOFILE_PROBE])
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["auto"] == "pread"
    assert "io_uring unavailable" in out["notes"]
    errno_, message = out["explicit"]
    assert errno_ == 24  # EMFILE
    assert "io_uring" in message
