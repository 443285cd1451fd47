"""What the host can give a command before it starts: memory (disk room is the scratch
policy's, bsr_io.testing.scratch)."""

from __future__ import annotations

from pathlib import Path

from bsr_io.sizes import fmt_size


def mem_available() -> int | None:
    """MemAvailable from /proc/meminfo, in bytes (None where unknown)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_memory(need_bytes: int, what: str, hint: str) -> None:
    """Refuse a run that needs more memory than is available, saying what needs it."""
    avail = mem_available()
    if avail is not None and avail < need_bytes:
        raise ValueError(
            f"not enough memory: {what} needs about {fmt_size(need_bytes)}, "
            f"{fmt_size(avail)} is available; use {hint}"
        )
