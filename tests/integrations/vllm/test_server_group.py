"""How the lab starts a `vllm serve` tree: a process group of its own (stopped and killed as
one), in the caller's session. A session of its own would be a scheduling group of its
own (the kernel's autogroup): with two nodes on one machine, node 1's connector threads
sit on node 0's OpenMP core, and as another group they were measured runnable but not
scheduled for up to 26 s while node 0's worker spun there, so rank 1's load outlived its
deadline (issue 50, test_two_nodes). No vLLM starts here: the tree is a shell that
sleeps before it would exec `vllm serve`.
"""

from __future__ import annotations

import os
from pathlib import Path

from bsr_lab.vllm.server import Server


def test_a_server_tree_is_a_process_group_in_the_callers_session(tmp_path: Path) -> None:
    server = Server(
        "unused-model",
        log=tmp_path / "server.log",
        prefix=("sh", "-c"),
        setup="sleep 600",  # holds the shell (and a child of it) before the exec
        headless=True,
    )
    server.start()
    try:
        assert os.getpgid(server.pid) == server.pid  # killpg reaches the whole tree
        assert os.getsid(server.pid) == os.getsid(0), "the tree has a session of its own"
    finally:
        server.stop(timeout=10.0)
    try:
        os.killpg(server.pid, 0)
        left = True
    except ProcessLookupError:
        left = False
    assert not left, "a process of the tree outlived stop()"
