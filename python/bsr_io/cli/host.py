"""What the host can give a command before it starts: memory (disk room is the scratch
policy's, bsr_io.cli.scratch); and what a measured path took from it: CPU time and
peak resident memory."""

from __future__ import annotations

import re
import resource
from pathlib import Path

from bsr_io.model.sizes import fmt_size


def mem_available() -> int | None:
    """MemAvailable from /proc/meminfo, in bytes (None where unknown)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def huge_page_bytes(addr: int, nbytes: int) -> int | None:
    """Bytes of `[addr, addr + nbytes)` this process has on transparent huge pages
    (/proc/self/smaps), None when unreadable. A 1 MiB O_DIRECT request into 4 KiB pages
    needs 256 segments, more than a virtio disk's queue takes: it is split."""
    lo, hi = addr, addr + nbytes
    try:
        text = Path("/proc/self/smaps").read_text()
    except OSError:
        return None
    total = 0
    for block in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", text):
        m = re.match(r"([0-9a-f]+)-([0-9a-f]+)", block)
        h = re.search(r"AnonHugePages:\s+(\d+) kB", block)
        if m and h and int(m.group(1), 16) < hi and int(m.group(2), 16) > lo:
            total += int(h.group(1)) * 1024
    return min(total, nbytes)


def check_memory(need_bytes: int, what: str, hint: str) -> None:
    """Refuse a run that needs more memory than is available, saying what needs it."""
    avail = mem_available()
    if avail is not None and avail < need_bytes:
        raise ValueError(
            f"not enough memory: {what} needs about {fmt_size(need_bytes)}, "
            f"{fmt_size(avail)} is available; use {hint}"
        )


def process_cpu_s() -> float:
    """This process's user + system CPU seconds so far (every thread, the engine's too)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def process_switches() -> int:
    """This process's context switches so far, voluntary and not (every thread)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_nvcsw + ru.ru_nivcsw


def vmhwm_bytes() -> int:
    """Peak resident set of this process (VmHWM), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise OSError("VmHWM not found in /proc/self/status")


def vmhwm_reset() -> int:
    """Reset this process's peak RSS (VmHWM) to its current RSS and return it, so the
    next `vmhwm_bytes()` minus this is one phase's growth (Linux 4.0+)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return vmhwm_bytes()
