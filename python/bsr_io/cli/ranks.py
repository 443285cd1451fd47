"""Run a function on N real ranks: one process each, one gloo process group.

`launch(world_size, "module:function", kwargs)` starts `python -m bsr_io.cli.ranks`
once per rank on localhost; each joins a `torch.distributed` group (gloo),
calls `function(rank, world_size, **kwargs)` and prints its JSON-able result.
A rank that dies shows up as `{"rank": r, "exit_code": ...}`. Used by the tests,
`bsr-lab bench faults`, `bench sweep --ranks` and the demo.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from typing import IO, Any

_MARK = "BSR-IO-RANK-RESULT "


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def launch(
    world_size: int,
    target: str,
    kwargs: dict[str, Any],
    *,
    timeout_s: float = 300.0,
    env: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Results of `target` on every rank, in rank order."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    port = free_port()
    payload = json.dumps(kwargs)
    procs = []
    child_env = {**os.environ, **(env or {})}
    for rank in range(world_size):
        cmd = [
            sys.executable,
            "-m",
            "bsr_io.cli.ranks",
            target,
            str(rank),
            str(world_size),
            str(port),
            payload,
        ]
        procs.append(
            subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=child_env)
        )
    # Every child's pipes are drained from the start, concurrently: a rank that fills
    # its pipe while another is waited on would block (and, through the rank-0 exit
    # wait below, hold the others) until the timeout.
    pipes = [(_Drain(p.stdout), _Drain(p.stderr)) for p in procs]
    try:
        return _collect(procs, pipes, time.monotonic() + timeout_s)
    finally:
        # Interrupted (Ctrl-C, or a signal the caller turned into an exception): no rank
        # outlives the call, so none writes into a directory the caller then removes.
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _collect(
    procs: list[subprocess.Popen[bytes]], pipes: list[tuple[_Drain, _Drain]], deadline: float
) -> list[dict[str, Any]]:
    results = []
    for rank, (p, (out, err)) in enumerate(zip(procs, pipes, strict=True)):
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            results.append({"rank": rank, "exit_code": "timeout", "stderr": err.text()[-2000:]})
            continue
        found = [ln for ln in out.text().splitlines() if ln.startswith(_MARK)]
        if p.returncode == 0 and found:
            results.append(json.loads(found[-1][len(_MARK) :]))
        else:
            results.append({"rank": rank, "exit_code": p.returncode, "stderr": err.text()[-2000:]})
    return results


class _Drain:
    """Reads one child pipe to its end on a thread of its own."""

    def __init__(self, pipe: IO[bytes] | None) -> None:
        assert pipe is not None
        self._pipe = pipe
        self._parts: list[bytes] = []
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with self._pipe:
            while part := os.read(self._pipe.fileno(), 1 << 16):
                self._parts.append(part)

    def text(self) -> str:
        """Everything the child wrote. Its exit closes the pipe unless a grandchild
        still holds it; then only a short wait, and what came so far."""
        self._thread.join(timeout=5.0)
        return b"".join(self._parts).decode(errors="replace")


def _main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bsr_io.cli.ranks")
    ap.add_argument("target")
    ap.add_argument("rank", type=int)
    ap.add_argument("world_size", type=int)
    ap.add_argument("port", type=int)
    ap.add_argument("kwargs")
    a = ap.parse_args(argv)
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{a.port}",
        rank=a.rank,
        world_size=a.world_size,
        timeout=datetime.timedelta(seconds=120),
    )
    module, name = a.target.split(":")
    fn = getattr(importlib.import_module(module), name)
    result = fn(a.rank, a.world_size, **json.loads(a.kwargs))
    print(_MARK + json.dumps(result), flush=True)
    # Rank 0 hosts the store, so it leaves last; a barrier would wait forever for a rank
    # that was killed on purpose, so this waits on the store with a deadline instead.
    from torch.distributed import distributed_c10d as c10d

    try:
        store = c10d._get_default_store()
        store.set(f"bsr-io/exit/{a.rank}", "1")
        if a.rank == 0:
            deadline = time.monotonic() + float(os.environ.get("BSR_IO_EXIT_WAIT_S", "60"))
            keys = [f"bsr-io/exit/{r}" for r in range(a.world_size)]
            while time.monotonic() < deadline and not all(store.check([k]) for k in keys):
                time.sleep(0.01)
    except Exception:  # noqa: BLE001 - rank 0 already left (a stalled-rank scenario)
        pass
    sys.stdout.flush()
    os._exit(0)  # skip process-group teardown, which can block on dead peers


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
