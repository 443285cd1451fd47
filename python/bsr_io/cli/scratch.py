"""Where the demo, the benchmarks and the test helpers put their files: one policy.

- `--dir` given: that directory (created if missing) is the base;
- otherwise the first writable directory on disk among $TMPDIR, the system temp
  directory and /var/tmp. Never the current directory (a command run from a source
  tree must not fill it);
- never a filesystem in memory (tmpfs...) unless the caller asks for one (`memory=True`,
  `bench ceiling`, whose point is a RAM-backed source): in memory the I/O figures mean
  nothing and O_DIRECT is refused;
- a fresh directory is made under the base, and refused with the bytes needed when
  the base lacks room for the state.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bsr_io.model.sizes import fmt_size

MEMORY_FS = frozenset({"tmpfs", "ramfs", "devtmpfs", "hugetlbfs"})
# Neither in memory nor a disk to measure: refused by default, never taken for RAM.
_NOT_A_DISK = frozenset({"squashfs", "overlay"})
DISK_FALLBACKS: tuple[str, ...] = ("/var/tmp",)
MEMORY_DEFAULT = "/dev/shm"


def fs_type(path: Path) -> str:
    """Filesystem type of the mount holding `path` (from /proc/mounts; '' if unknown)."""
    path = path.resolve()
    best, kind = "", ""
    try:
        lines = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return ""
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        mnt = parts[1].replace("\\040", " ")
        if (path == Path(mnt) or Path(mnt) in path.parents) and len(mnt) >= len(best):
            best, kind = mnt, parts[2]
    return kind


def _fits(path: Path, memory: bool) -> bool:
    kind = fs_type(path)
    return kind in MEMORY_FS if memory else kind not in MEMORY_FS | _NOT_A_DISK


def scratch_base(explicit: Path | None, *, memory: bool = False) -> Path:
    """The directory under which scratch directories are made (see the module's notes)."""
    if explicit is not None:
        explicit.mkdir(parents=True, exist_ok=True)
        if not _fits(explicit, memory):
            kind = fs_type(explicit) or "an unknown filesystem"
            if memory:
                raise ValueError(
                    f"--dir {explicit} is on {kind}, not in memory: this needs a RAM-backed "
                    f"directory (a tmpfs, e.g. {MEMORY_DEFAULT})"
                )
            raise ValueError(
                f"--dir {explicit} is on {kind}, "
                f"{'in memory' if kind in MEMORY_FS else 'not a local disk'}: "
                "choose a directory on disk"
            )
        return explicit
    if memory:
        candidates: list[str | None] = [MEMORY_DEFAULT]
    else:
        candidates = [os.environ.get("TMPDIR"), tempfile.gettempdir(), *DISK_FALLBACKS]
    for c in candidates:
        if c and os.path.isdir(c) and os.access(c, os.W_OK) and _fits(Path(c), memory):
            return Path(c)
    where = "in memory" if memory else "on disk"
    raise ValueError(
        f"no writable directory {where} among {', '.join(c for c in candidates if c)}; pass --dir"
    )


def check_room(base: Path, need_bytes: int, what: str = "the state", hint: str = "") -> None:
    """Refuse, before anything is written, a base whose filesystem lacks `need_bytes`."""
    free = shutil.disk_usage(base).free
    if free < need_bytes:
        raise ValueError(
            f"not enough free space in {base}: {what} needs {fmt_size(need_bytes)} "
            f"({need_bytes:,} bytes), {fmt_size(free)} is free"
            + (f"; {hint}" if hint else "; pass --dir on a larger disk")
        )


def make_scratch(
    explicit: Path | None,
    prefix: str,
    *,
    need_bytes: int = 0,
    what: str = "the state",
    hint: str = "",
    memory: bool = False,
) -> Path:
    """A new directory named `prefix`... under `scratch_base(explicit)`, with room for
    `need_bytes`; the caller removes it."""
    base = scratch_base(explicit, memory=memory)
    check_room(base, need_bytes, what, hint)
    return Path(tempfile.mkdtemp(prefix=prefix, dir=base))


@contextmanager
def scratch_dir(
    explicit: Path | None,
    prefix: str,
    *,
    need_bytes: int = 0,
    what: str = "the state",
    hint: str = "",
    memory: bool = False,
    keep: bool = False,
) -> Iterator[Path]:
    """`make_scratch`, removed on the way out unless `keep`."""
    root = make_scratch(
        explicit, prefix, need_bytes=need_bytes, what=what, hint=hint, memory=memory
    )
    try:
        yield root
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)
