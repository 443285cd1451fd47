"""Errors carry errno and say what was wrong; misuse gets ValueError."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import bsr_io._core
from bsr_io import (
    BsrIoError,
    Engine,
    EngineClosedError,
    FileMissingError,
    FilePermissionError,
    NoSpaceError,
)


def test_missing_file(backend: str, tmp_path: Path) -> None:
    eng = Engine(1, 4096, backend=backend)
    with pytest.raises(FileNotFoundError) as exc:
        eng.open(tmp_path / "nope")
    assert isinstance(exc.value, FileMissingError) and isinstance(exc.value, BsrIoError)
    assert exc.value.errno == errno.ENOENT
    assert exc.value.filename == str(tmp_path / "nope")


def test_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(BsrIoError) as exc:
        Engine(1, 4096).open(tmp_path)
    assert exc.value.errno == errno.EISDIR


def test_no_space(backend: str) -> None:
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    eng = Engine(1, 4096, backend=backend)
    f = eng.open("/dev/full", write=True, special=True)  # a device node: asked for
    slot = eng.lease()
    with pytest.raises(NoSpaceError) as exc:
        eng.write(slot, f, 0, 4096)
    assert exc.value.errno == errno.ENOSPC
    del slot


def test_permission_denied_for_unprivileged_user() -> None:
    """Open a 0600 root file as nobody: FilePermissionError with EACCES."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to switch to an unprivileged user")
    # The unprivileged user cannot reach the venv (under /root) nor pytest's tmp dirs:
    # give it a world-readable dir with the extension alone (its init is PyInit__core).
    work = Path(tempfile.mkdtemp(prefix="bsr-io-perm-"))
    try:
        work.chmod(0o755)
        ext = Path(bsr_io._core.__file__)
        shutil.copy(ext, work / ext.name)
        (work / ext.name).chmod(0o644)
        secret = work / "secret"
        secret.write_bytes(b"x" * 4096)
        secret.chmod(0o600)
        code = (
            "import sys; sys.path.insert(0, sys.argv[2])\n"
            "from _core import Engine, FilePermissionError\n"
            "try:\n"
            "    Engine(1, 4096).open(sys.argv[1])\n"
            "except PermissionError as e:\n"
            "    assert isinstance(e, FilePermissionError), type(e)\n"
            "    print('errno', e.errno)\n"
        )
        python = (
            Path(sys.base_prefix) / "bin" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
        )
        nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", str(python)]
        probe = subprocess.run([*nobody, "-c", "1"], capture_output=True, text=True)
        if probe.returncode != 0:
            pytest.skip(f"unprivileged user cannot run {python}: {probe.stderr[-200:]}")
        r = subprocess.run(
            [*nobody, "-c", code, str(secret), str(work)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == f"errno {errno.EACCES}"
    finally:
        shutil.rmtree(work)
    assert FilePermissionError.__bases__ == (BsrIoError, PermissionError)


def test_closed_engine_and_file(backend: str, tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"a" * 8192)
    eng = Engine(2, 8192, backend=backend)
    f = eng.open(tmp_path / "f")
    held = eng.read(f, 0, 4096)
    f.close()
    with pytest.raises(EngineClosedError) as exc:
        eng.read(f, 0, 4096)
    assert exc.value.errno == errno.EBADF
    assert f.size == 8192  # last known size stays readable
    f2 = eng.open(tmp_path / "f")
    eng.close()
    assert eng.closed
    for call in (lambda: eng.read(f2, 0, 4096), eng.lease, lambda: eng.open(tmp_path / "f")):
        with pytest.raises(EngineClosedError) as exc:
            call()
        assert exc.value.errno == errno.ESHUTDOWN
    assert bytes(held) == b"a" * 4096  # leased slots stay valid after close
    eng.close()  # idempotent


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"window": 0, "slot_bytes": 4096}, "window must be at least 1"),
        ({"window": -3, "slot_bytes": 4096}, "window must be at least 1"),
        ({"window": 1, "slot_bytes": 0}, "slot_bytes must be at least 1"),
        ({"window": 1, "slot_bytes": 4096, "queue_depth": 0}, "queue_depth"),
        ({"window": 1, "slot_bytes": 4096, "request_bytes": 1000}, "multiple of 4096"),
        ({"window": 1, "slot_bytes": 4096, "request_bytes": 0}, "request_bytes"),
        ({"window": 1, "slot_bytes": 4096, "backend": "spdk"}, "unknown backend"),
    ],
)
def test_bad_engine_arguments(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Engine(**kwargs)


def test_bad_io_arguments(backend: str, tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"a" * 8192)
    eng = Engine(1, 8192, backend=backend)
    f = eng.open(tmp_path / "f")
    with pytest.raises(ValueError, match="offset must be >= 0"):
        eng.submit_read(f, -4096, 4096)
    with pytest.raises(ValueError, match="length must be positive"):
        eng.submit_read(f, 0, 0)
    with pytest.raises(ValueError, match="exceeds slot_bytes"):
        eng.submit_read(f, 0, 8193)
    slot = eng.lease()
    with pytest.raises(ValueError, match="read-only"):
        eng.write(slot, f, 0)
    with pytest.raises(ValueError, match="exceeds the slot capacity"):
        slot.set_length(8193)
    with pytest.raises(ValueError, match="outside the slot"):
        slot.checksum(8000, 200)
    with pytest.raises(ValueError, match="outside the slot"):
        slot.fill_from(b"abc", 8190)
    with pytest.raises(ValueError, match="offset must be >= 0"):
        slot.fill_from(b"abc", -1)
    other = Engine(1, 8192, backend=backend)
    w = other.open(tmp_path / "g", create=True)
    with pytest.raises(ValueError, match="another engine"):
        other.write(slot, w, 0)
    with pytest.raises(ValueError, match="timeout"):
        other.submit_write(other.lease(), w, 0).wait(timeout=-1)
    # None of the refusals consumed a slot or touched the files.
    del slot
    assert eng.free_slots() == 1
    assert (tmp_path / "f").read_bytes() == b"a" * 8192


def test_forked_child_gets_a_clear_error(backend: str, tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"a" * 4096)
    eng = Engine(1, 4096, backend=backend)
    f = eng.open(tmp_path / "f")
    pid = os.fork()
    if pid == 0:  # child: the I/O threads are not here
        code = 1
        try:
            eng.read(f, 0, 4096)
        except ValueError as exc:
            code = 0 if "fork" in str(exc) else 2
        finally:
            eng.close()  # must not hang on threads that are not in this process
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert bytes(eng.read(f, 0, 4096)) == b"a" * 4096  # the parent is unaffected


def test_arena_too_big_for_memory() -> None:
    with pytest.raises(BsrIoError) as exc:
        Engine(1, 1 << 44)  # 16 TiB of staging on a machine with far less
    assert exc.value.errno == errno.ENOMEM


def test_fill_from_own_view(backend: str) -> None:
    eng = Engine(1, 8192, backend=backend)
    slot = eng.lease()
    slot.fill_from(bytes(range(256)) * 32)
    slot.fill_from(memoryview(slot)[0:4096], 100)  # overlapping source and target
    assert bytes(slot)[100:4196] == (bytes(range(256)) * 32)[:4096]
