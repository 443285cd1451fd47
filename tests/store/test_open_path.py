"""Opening records under a seccomp profile that refuses `openat2` with EPERM (container
runtimes' defaults may): the engine resolves store paths by its walk instead, says so
in `features["open_path"]`, and a save and a restore complete. A real seccomp filter,
installed in a child process, makes the kernel answer EPERM; nothing is simulated."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from bsr_io import Engine

_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}  # AUDIT_ARCH_* of the filter

_CHILD = r"""
import ctypes, errno, sys

ARCH, OPENAT2 = int(sys.argv[1]), 437  # openat2 is 437 in every Linux syscall table
libc = ctypes.CDLL(None, use_errno=True)

class Insn(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8),
                ("k", ctypes.c_uint32)]

class Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(Insn))]

LD_ABS, JEQ, RET = 0x20, 0x15, 0x06
ALLOW, EPERM = 0x7FFF0000, 0x00050000 | errno.EPERM
insns = (Insn * 6)(
    Insn(LD_ABS, 0, 0, 4),  # seccomp_data.arch
    Insn(JEQ, 0, 3, ARCH),  # another ABI: allow
    Insn(LD_ABS, 0, 0, 0),  # seccomp_data.nr
    Insn(JEQ, 0, 1, OPENAT2),
    Insn(RET, 0, 0, EPERM),
    Insn(RET, 0, 0, ALLOW),
)
prog = Prog(6, insns)
assert libc.prctl(38, 1, 0, 0, 0) == 0, "PR_SET_NO_NEW_PRIVS"
assert libc.prctl(22, 2, ctypes.byref(prog), 0, 0) == 0, "PR_SET_SECCOMP"
how = (ctypes.c_uint64 * 3)()
assert libc.syscall(OPENAT2, -100, b".", how, 24) == -1
assert ctypes.get_errno() == errno.EPERM, "the filter does not refuse openat2"

from bsr_io import Engine
from bsr_io.cli.synthetic import fill_state
from bsr_io.load.kvcache import PagedKVCache
from bsr_io.model.layout import preset
from bsr_io.restore import Restorer
from bsr_io.store import Store
from bsr_io.tiers import SSDTier

layout = preset("tiny")
engine = Engine(2, layout.chunk_bytes)
print("open_path", engine.features["open_path"])
print("notes", engine.features["notes"])
tier = SSDTier(sys.argv[2], None, engine, layout=layout)
tokens, keys = fill_state(tier, layout, 4 * layout.chunk_tokens, seed=3, model="m")
r = Restorer(Store([tier]), layout, window=2, engine=engine, model="m", timeout_s=10)
plan = r.probe(tokens)
res = r.restore(plan, PagedKVCache.allocate(layout, len(tokens)))
print("outcome", res.outcome, res.reason)
"""


def test_a_store_opens_and_restores_when_seccomp_refuses_openat2(tmp_path: Path) -> None:
    arch = _ARCH.get(platform.machine())
    if arch is None:
        pytest.skip(f"no seccomp filter written for {platform.machine()}")
    run = subprocess.run(
        [sys.executable, "-c", _CHILD, str(arch), str(tmp_path / "l2")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONFAULTHANDLER": "1"},
    )
    assert run.returncode == 0, run.stderr
    lines = dict(line.split(" ", 1) for line in run.stdout.splitlines())
    assert lines["open_path"] == "walk"
    assert "openat2 refused (Operation not permitted)" in lines["notes"]
    assert lines["outcome"].startswith("complete"), lines["outcome"]


def test_openat2_is_the_path_where_the_kernel_allows_it() -> None:
    # Control for the test above: without the filter this kernel resolves with openat2.
    with Engine(1, 4096) as engine:
        assert engine.features["open_path"] == "openat2"
