"""One conformance case in a process of its own (cases.py `run_child`).

    python child.py CASE TMP (--seccomp|--plain) MODULE_DIR MODULE FACTORY

`--seccomp`: first a real seccomp filter that answers openat2 with EPERM (as some
container runtimes' default profiles do), checked to refuse it; then the adapter's
factory `MODULE.FACTORY` (imported from MODULE_DIR) runs the case.
"""

from __future__ import annotations

import ctypes
import errno
import importlib
import platform
import sys
from pathlib import Path

OPENAT2 = 437  # the same number in every Linux syscall table
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}


class _Insn(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_uint16),
        ("jt", ctypes.c_uint8),
        ("jf", ctypes.c_uint8),
        ("k", ctypes.c_uint32),
    ]


class _Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(_Insn))]


def refuse_openat2() -> None:
    """Install a classic BPF seccomp filter: openat2 fails EPERM, every other call runs."""
    arch = AUDIT_ARCH[platform.machine()]
    load, jeq, ret = 0x20, 0x15, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_RET|K
    allow, eperm = 0x7FFF0000, 0x00050000 | errno.EPERM
    insns = (_Insn * 6)(
        _Insn(load, 0, 0, 4),  # seccomp_data.arch
        _Insn(jeq, 0, 3, arch),
        _Insn(load, 0, 0, 0),  # seccomp_data.nr
        _Insn(jeq, 0, 1, OPENAT2),
        _Insn(ret, 0, 0, eperm),
        _Insn(ret, 0, 0, allow),
    )
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(38, 1, 0, 0, 0) == 0, "PR_SET_NO_NEW_PRIVS"
    assert libc.prctl(22, 2, ctypes.byref(_Prog(6, insns)), 0, 0) == 0, "PR_SET_SECCOMP"
    how = (ctypes.c_uint64 * 3)()
    assert libc.syscall(OPENAT2, -100, b".", how, 24) == -1
    assert ctypes.get_errno() == errno.EPERM, "the filter does not refuse openat2"


def main() -> None:
    case, tmp, mode, module_dir, module, factory = sys.argv[1:7]
    here = Path(__file__).resolve().parent
    for p in (module_dir, str(here.parent), str(here.parents[1] / "lab")):
        sys.path.insert(0, p)
    if mode == "--seccomp":
        refuse_openat2()
    from conformance.cases import BY_NAME

    make = getattr(importlib.import_module(module), factory)
    BY_NAME[case].run(make, Path(tmp))
    print("passed", case)


if __name__ == "__main__":
    main()
