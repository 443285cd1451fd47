"""Writing a command's figures as JSON (`--json PATH`)."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
from pathlib import Path
from typing import Any


def source_commit() -> str:
    """The git commit of the bsr-io source that is running ("+dirty" when it has
    uncommitted changes), or "unknown" outside a checkout: every result names it."""
    here = Path(__file__).resolve().parent
    try:
        git = ["git", "-C", str(here)]
        head = subprocess.run(
            [*git, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        )
        if head.returncode != 0:
            return "unknown"
        dirty = subprocess.run(
            [*git, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return head.stdout.strip() + ("+dirty" if dirty else "")


def machine() -> dict[str, Any]:
    """The CPU a result was measured on: absolute rates differ severalfold between the
    machines this runs on (a bf16 forward with AMX, with AVX-512 or with AVX2 alone), so
    a figure is compared only with those of the same machine, and ratios only within one
    run."""
    model, flags = "unknown", ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name.strip() == "model name" and model == "unknown":
                    model = value.strip()
                elif name.strip() == "flags" and not flags:
                    flags = value
    except OSError:
        pass
    have = set(flags.split())
    return {
        "cpu": model,
        "cpus": os.cpu_count(),
        "amx": "amx_tile" in have,
        "avx512": "avx512f" in have,
    }


def trace_path(path: str | os.PathLike[str]) -> Path:
    """Where a result's per-round trace goes beside its JSON: NAME.trace.json.gz."""
    path = Path(path)
    return path.with_name(path.name.removesuffix(".json") + ".trace.json.gz")


def write_trace(path: str | os.PathLike[str], trace: Any) -> str:
    """Write `trace` compressed beside the JSON at `path` (`trace_path`): a result keeps
    its summaries and names this file (its name, returned)."""
    gz = trace_path(path)
    gz.parent.mkdir(parents=True, exist_ok=True)
    gz.write_bytes(gzip.compress(json.dumps(trace).encode()))
    return gz.name


def write_json(path: str | os.PathLike[str] | None, doc: Any) -> None:
    """Write `doc` to `path` (parents created), with the commit it measured and the
    machine, and say so; nothing when `path` is None."""
    if path is None:
        return
    if isinstance(doc, dict):
        doc = {"machine": machine(), **doc}
        doc.setdefault("commit", source_commit())
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {path}")
