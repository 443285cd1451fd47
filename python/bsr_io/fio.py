"""fio as the reference for SSD read speed, and dropping the page cache between runs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

__all__ = ["FioResult", "drop_caches", "fio_available", "fio_read"]

GiB = 1 << 30


@dataclass(frozen=True)
class FioResult:
    gib_s: float
    bytes_read: int
    seconds: float
    command: list[str]


def fio_available() -> bool:
    return shutil.which("fio") is not None


def drop_caches() -> bool:
    """Flush dirty pages and drop the page cache. False when not allowed (not root)."""
    if os.geteuid() != 0:
        return False
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


def fio_read(
    path: str | os.PathLike[str],
    *,
    block_bytes: int = 1 << 20,
    iodepth: int = 32,
    size: int | None = None,
    timeout_s: float = 600.0,
) -> FioResult:
    """One sequential O_DIRECT read of `path` (whole file unless `size`) with fio's
    io_uring engine, fixed buffers and registered files. Returns the bandwidth."""
    exe = shutil.which("fio")
    if exe is None:
        raise FileNotFoundError("fio is not installed (Debian/Ubuntu: apt-get install fio)")
    size = os.path.getsize(path) if size is None else size
    if size <= 0:
        raise ValueError(f"nothing to read: {path} is empty")
    cmd = [
        exe,
        "--name=bsr-io-ref",
        f"--filename={os.fspath(path)}",
        "--ioengine=io_uring",
        "--direct=1",
        f"--bs={block_bytes}",
        f"--iodepth={iodepth}",
        "--fixedbufs=1",
        "--registerfiles=1",
        "--rw=read",
        f"--size={size}",
        "--numjobs=1",
        "--readonly",
        "--output-format=json",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if out.returncode != 0:
        raise RuntimeError(f"fio failed ({out.returncode}): {out.stderr.strip()[-500:]}")
    # fio may print notes before the JSON document.
    report = json.loads(out.stdout[out.stdout.index("{") :])
    read = report["jobs"][0]["read"]
    bw = float(read["bw_bytes"])
    if bw <= 0:
        raise RuntimeError(f"fio reported no bandwidth: {read}")
    seconds = read["runtime"] / 1000.0
    return FioResult(gib_s=bw / GiB, bytes_read=int(read["io_bytes"]), seconds=seconds, command=cmd)
