"""fio as the reference for SSD read speed, and dropping the page cache between runs.

fio's default buffers are 4 KiB pages. Where the disk queue takes few segments per
request (`/sys/block/<dev>/queue/max_segments`, 254 on a virtio disk), a 1 MiB read
into such a buffer is split in two, while the engine's arena is backed by 2 MiB pages
and its requests are not: fio on plain pages is a handicapped reference. So every
bench runs fio twice: as before (`fio`) and with huge-page buffers on hugetlbfs
(`fio_hugemem`, `--iomem=mmaphuge`), which is the drive's real limit. Huge pages
are reserved for the run (root only) and the previous reservation is restored.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bsr_io.model.sizes import GiB

__all__ = [
    "FioResult",
    "HugeMem",
    "drop_caches",
    "fio_available",
    "fio_read",
    "fio_read_payloads",
    "huge_page_buffers",
]

NR_HUGEPAGES = Path("/proc/sys/vm/nr_hugepages")
_LOCK = Path(tempfile.gettempdir()) / "bsr-io-hugepages.lock"


@dataclass(frozen=True)
class FioResult:
    gib_s: float
    bytes_read: int
    seconds: float  # fio's own runtime of the job(s) (ms resolution)
    command: list[str]
    wall_s: float = 0.0  # the fio process, start to exit (open, buffer setup included)
    trace: dict[str, Any] | None = None  # with `lat_log`: what it made of fio's latency log


@dataclass(frozen=True)
class HugeMem:
    """Where fio may put huge-page buffers; `mount` is None when it cannot (see `note`)."""

    mount: str | None
    note: str = ""
    pages: int = 0  # huge pages reserved for the run (on top of what was there)

    def iomem(self, name: str) -> str | None:
        """fio's `--iomem` value for one job's buffer (None: fio's default memory)."""
        if self.mount is None:
            return None
        return f"mmaphuge:{self.mount}/bsr-io-fio-{os.getpid()}-{name}.buf"


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


def _meminfo(field: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(field + ":"):
            parts = line.split()
            return int(parts[1]) * (1024 if len(parts) > 2 else 1)
    raise OSError(f"{field} not in /proc/meminfo")


def _hugetlbfs_mount(page_bytes: int) -> str | None:
    """An existing hugetlbfs mount of the default page size, if any."""
    want = f"pagesize={page_bytes >> 20}M"
    for line in Path("/proc/mounts").read_text().splitlines():
        parts = line.split()
        if len(parts) > 3 and parts[2] == "hugetlbfs":
            opts = parts[3].split(",")
            if want in opts or not any(o.startswith("pagesize=") for o in opts):
                if os.access(parts[1], os.W_OK):
                    return parts[1]
    return None


@contextmanager
def huge_page_buffers(buffer_bytes: int) -> Iterator[HugeMem]:
    """Huge pages for `buffer_bytes` of fio buffers, for the duration of the block.

    Reserves what is missing through /proc/sys/vm/nr_hugepages, mounts hugetlbfs if no
    mount exists, and afterwards unmounts and restores the previous reservation. When
    any step is refused, yields a HugeMem whose `mount` is None and whose `note` says
    why (the caller reports fio on plain pages only)."""
    if os.geteuid() != 0:
        yield HugeMem(None, "huge pages need root (to reserve them in /proc/sys/vm/nr_hugepages)")
        return
    try:
        page = _meminfo("Hugepagesize")
    except (OSError, ValueError) as exc:
        yield HugeMem(None, f"this kernel reports no huge pages ({exc})")
        return
    # fio rounds each job's buffer up to whole pages and aligns it: slack for a few jobs.
    need = -(-buffer_bytes // page) + 8
    with open(_LOCK, "a+") as lock:
        # Another bench changing the reservation at the same time would restore it wrong.
        fcntl.flock(lock, fcntl.LOCK_EX)
        prev = int(NR_HUGEPAGES.read_text())
        mounted: str | None = None
        try:
            free = _meminfo("HugePages_Free")
            if free < need:
                try:
                    NR_HUGEPAGES.write_text(f"{prev + need - free}\n")
                except OSError as exc:
                    yield HugeMem(None, f"cannot reserve huge pages: {exc}")
                    return
                free = _meminfo("HugePages_Free")
                if free < need:
                    yield HugeMem(
                        None,
                        f"the kernel reserved only {free} of the {need} huge pages fio needs "
                        "(memory too fragmented)",
                    )
                    return
            mount = _hugetlbfs_mount(page)
            if mount is None:
                mounted = tempfile.mkdtemp(prefix="bsr-io-hugetlbfs-")
                out = subprocess.run(
                    ["mount", "-t", "hugetlbfs", "-o", f"pagesize={page >> 20}M", "none", mounted],
                    capture_output=True,
                    text=True,
                )
                if out.returncode != 0:
                    os.rmdir(mounted)
                    mounted = None
                    yield HugeMem(None, f"cannot mount hugetlbfs: {out.stderr.strip()}")
                    return
                mount = mounted
            yield HugeMem(mount, pages=max(0, int(NR_HUGEPAGES.read_text()) - prev))
        finally:
            if mounted is not None:
                for f in Path(mounted).glob(f"bsr-io-fio-{os.getpid()}-*.buf"):
                    f.unlink(missing_ok=True)
                subprocess.run(["umount", mounted], capture_output=True)
                try:
                    os.rmdir(mounted)
                except OSError:
                    pass
            if int(NR_HUGEPAGES.read_text()) != prev:
                NR_HUGEPAGES.write_text(f"{prev}\n")


def _run(
    cmd: list[str], timeout_s: float, stdin: str | None = None
) -> tuple[dict[str, Any], float]:
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, input=stdin)
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        raise RuntimeError(f"fio failed ({out.returncode}): {out.stderr.strip()[-500:]}")
    # fio may print notes before the JSON document.
    return json.loads(out.stdout[out.stdout.index("{") :]), wall


def _exe() -> str:
    exe = shutil.which("fio")
    if exe is None:
        raise FileNotFoundError("fio is not installed (Debian/Ubuntu: apt-get install fio)")
    return exe


def fio_read(
    path: str | os.PathLike[str],
    *,
    block_bytes: int = 1 << 20,
    iodepth: int = 32,
    size: int | None = None,
    timeout_s: float = 600.0,
    iomem: str | None = None,
    lat_log: Callable[[Path], dict[str, Any]] | None = None,
) -> FioResult:
    """One sequential O_DIRECT read of `path` (whole file unless `size`) with fio's
    io_uring engine, fixed buffers and registered files. `iomem`: fio's buffer memory
    (e.g. `HugeMem.iomem(...)`; None is fio's default, 4 KiB pages). `lat_log`: fio logs
    every I/O's latency beside `path`, and `lat_log(log)` summarises it (`FioResult.trace`;
    the lab's `bsr_lab.trace.fio_summary`); the log is removed afterwards."""
    size = os.path.getsize(path) if size is None else size
    if size <= 0:
        raise ValueError(f"nothing to read: {path} is empty")
    cmd = [
        _exe(),
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
    if iomem:
        cmd.append(f"--iomem={iomem}")
    prefix = None
    if lat_log is not None:
        prefix = Path(path).parent / f"bsr-io-fio-{os.getpid()}-{time.monotonic_ns()}"
        cmd += [f"--write_lat_log={prefix}", "--log_avg_msec=0"]
    try:
        report, wall = _run(cmd, timeout_s)
        trace = None
        if lat_log is not None and prefix is not None:
            trace = lat_log(Path(f"{prefix}_lat.1.log"))
            trace["iodepth_level_pct"] = report["jobs"][0].get("iodepth_level")
    finally:
        if prefix is not None:
            for kind in ("lat", "clat", "slat"):
                Path(f"{prefix}_{kind}.1.log").unlink(missing_ok=True)
    read = report["jobs"][0]["read"]
    bw = float(read["bw_bytes"])
    if bw <= 0:
        raise RuntimeError(f"fio reported no bandwidth: {read}")
    seconds = read["runtime"] / 1000.0
    return FioResult(bw / GiB, int(read["io_bytes"]), seconds, cmd, wall, trace)


def fio_read_payloads(
    directory: str | os.PathLike[str] | list[str] | list[Path],
    *,
    payload_offset: int,
    payload_bytes: int | list[int],
    files: int | list[int],
    block_bytes: int = 1 << 20,
    iodepth: int = 32,
    timeout_s: float = 3600.0,
    hugemem: HugeMem | None = None,
) -> FioResult:
    """fio reading the payload range `[payload_offset, payload_offset + payload_bytes)` of
    every file in `directory` (record files: header, then payload), O_DIRECT, io_uring.

    fio issues whole blocks only, so a payload that is not a multiple of `block_bytes` is
    read as two concurrent jobs, as the engine splits it: the whole blocks, and each
    file's tail in one request. The time is fio's measured runtime (the longest job).
    Several directories (one per rank, per drive or per pool; `files` and `payload_bytes`
    each, or one for all) are read at the same time, one set of jobs each, as ranks
    restore at the same time and a striped tier reads its drives."""
    dirs = directory if isinstance(directory, list) else [directory]
    counts = files if isinstance(files, list) else [files] * len(dirs)
    sizes = payload_bytes if isinstance(payload_bytes, list) else [payload_bytes] * len(dirs)
    if len(counts) != len(dirs) or len(sizes) != len(dirs):
        raise ValueError(
            f"{len(counts)} file counts and {len(sizes)} payload sizes for {len(dirs)} directories"
        )
    if min(sizes) <= 0 or min(counts) <= 0:
        raise ValueError("nothing to read: no payload bytes or no files")
    if payload_offset % 4096:
        raise ValueError("payload offset must be 4096-byte aligned for O_DIRECT")
    text = ""
    for d, (one_dir, nfiles, size) in enumerate(zip(dirs, counts, sizes, strict=True)):
        common = (
            f"opendir={os.fspath(one_dir)}\nioengine=io_uring\ndirect=1\nfixedbufs=1\n"
            "rw=read\nfile_service_type=sequential\n"
        )
        for name, off, bs, depth, per_file in _payload_jobs(
            payload_offset, size, block_bytes, iodepth
        ):
            mem = hugemem.iomem(f"{name}{d}") if hugemem else None
            text += (
                f"[{name}{d}]\n{common}offset={off}\nbs={bs}\niodepth={depth}\n"
                f"io_size={per_file * nfiles}\n" + (f"iomem={mem}\n" if mem else "")
            )
    cmd = [_exe(), "--readonly", "--output-format=json", "-"]
    report, wall = _run(cmd, timeout_s, stdin=text)
    nbytes = sum(int(j["read"]["io_bytes"]) for j in report["jobs"])
    seconds = max(j["read"]["runtime"] for j in report["jobs"]) / 1000.0
    want = sum(size * n for size, n in zip(sizes, counts, strict=True))
    if nbytes != want:
        raise RuntimeError(f"fio read {nbytes} bytes of the payloads' {want}: {text}")
    seconds = seconds or wall  # under a millisecond: fio reports 0, the process time stands
    return FioResult(nbytes / seconds / GiB, nbytes, seconds, [*cmd, text], wall)


def _payload_jobs(
    offset: int, payload: int, block_bytes: int, iodepth: int
) -> list[tuple[str, int, int, int, int]]:
    """(name, offset, block size, depth, bytes per file) of the jobs reading one payload:
    its whole blocks, and its tail in one request beside them."""
    body = payload // block_bytes * block_bytes
    tail = payload - body
    if tail % 4096:
        raise ValueError(f"a payload tail of {tail} bytes is not 4096-byte aligned for O_DIRECT")
    jobs = []
    tail_depth = min(2, iodepth - 1) if body and tail else 0
    if body:
        jobs.append(("body", offset, block_bytes, iodepth - tail_depth, body))
    if tail:
        jobs.append(("tail", offset + body, tail, tail_depth or iodepth, tail))
    return jobs


FIO_DEPTHS = (4, 8, 16, 32)  # the queue depths `best_depth` tries


def best_depth(
    path: str | os.PathLike[str],
    size: int,
    *,
    iomem: str | None = None,
    depths: tuple[int, ...] = FIO_DEPTHS,
    rounds: int = 2,
) -> tuple[int, dict[int, float]]:
    """The queue depth at which fio reads `size` bytes of `path` fastest (1 MiB
    requests, cold cache, depths interleaved over `rounds`), and each depth's median
    seconds. More in flight is not always faster: a drive past its parallelism only
    queues (this project's virtio drive read 1.38x faster at 8 than at 32), so a
    reference meant to be the drive's limit is taken at the depth that is."""
    times: dict[int, list[float]] = {d: [] for d in depths}
    for r in range(rounds):
        for d in depths[r % len(depths) :] + depths[: r % len(depths)]:
            drop_caches()
            res = fio_read(path, size=size, iodepth=d, iomem=iomem)
            times[d].append(res.seconds or res.wall_s)
    med = {d: statistics.median(v) for d, v in times.items()}
    return min(med, key=lambda d: med[d]), med
