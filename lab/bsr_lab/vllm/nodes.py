"""Two vLLM nodes on one machine, each with its own drive (vllm-multinode.md).

vLLM's own multi-node mode (`vllm serve --nnodes 2`, node 1 `--headless`) at TP=2: one
rank per node, each a `Server` (server.py). Each node's process tree runs in a mount
namespace of its own in which that node's disk directory is bound over the same
`store_dir`, so the path every rank is configured with names a different directory per
node and nothing is shared but what is bound: what a worker can list is what a
node-local drive would hold. Node 0 serves the OpenAI API on 127.0.0.1.
"""

from __future__ import annotations

import shlex
import time
from pathlib import Path
from typing import Any

from bsr_lab.vllm.harness import free_ports
from bsr_lab.vllm.server import Completion, Server

# One OpenMP core per node, the same with the connector and without it.
_CORES = ("0", "1")
_OWN_MOUNTS = ("unshare", "--mount", "--propagation", "private", "sh", "-c")


class Cluster:
    """Two nodes of one vLLM engine. `disks[n]` is node n's drive, bound at `store`;
    `env[n]` is set on node n's processes (e.g. BSR_IO_FAULTS)."""

    def __init__(
        self,
        model: str,
        work: Path,
        store: Path,
        disks: tuple[Path, Path],
        connector: dict[str, Any] | None,
        env: tuple[dict[str, str], dict[str, str]] = ({}, {}),
    ) -> None:
        self.work = work
        port = free_ports(2)  # the API's, then the ranks' rendezvous
        self.nodes = [
            Server(
                model,
                connector=connector,
                log=work / f"node{node}.log",
                args=[
                    "--tensor-parallel-size",
                    "2",
                    "--nnodes",
                    "2",
                    "--node-rank",
                    str(node),
                    "--master-addr",
                    "127.0.0.1",
                    "--master-port",
                    str(port + 1),
                    *(["--headless"] if node else []),
                ],  # fmt: skip
                prefix=_OWN_MOUNTS,
                # The node's own drive at the shared path, for this process tree only.
                setup=f"mount --bind {shlex.quote(str(disks[node]))} {shlex.quote(str(store))}",
                headless=node == 1,
                port=0 if node else port,
                threads_bind=_CORES[node],
                served_model_name="tiny",
            )
            for node in (0, 1)
        ]
        self.set_env(env)

    def set_env(self, env: tuple[dict[str, str], dict[str, str]]) -> None:
        """Each node's extra environment from its next start on."""
        for node, server in enumerate(self.nodes):
            server.env = {"VLLM_HOST_IP": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo"} | env[node]

    def start(self) -> None:
        for server in self.nodes:
            server.start()

    def wait_ready(self, timeout: float = 600.0) -> None:
        """Until node 0 answers /health, failing at once if either node exits."""
        deadline = time.monotonic() + timeout
        while True:
            for node, server in enumerate(self.nodes):
                if not server.alive():
                    raise RuntimeError(f"node {node} exited:\n{server.log_tail()}")
            try:
                self.nodes[0].wait_ready(timeout=min(5.0, max(0.1, deadline - time.monotonic())))
                return
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise

    def kill(self, node: int) -> None:
        """`kill -9` of one node's process tree."""
        self.nodes[node].kill()

    def stop(self) -> None:
        """Node 1, then node 0 (its engine waits on node 1's workers), politely first."""
        for server in reversed(self.nodes):
            server.stop(timeout=60.0)

    def log_tail(self, node: int, n: int = 6000) -> str:
        return self.nodes[node].log_tail(n)

    def complete(self, prompt: list[int], max_tokens: int = 8) -> Completion:
        """A greedy completion of a token-id prompt, over node 0's API."""
        return self.nodes[0].complete(prompt, max_tokens=max_tokens)

    def reset_prefix_cache(self) -> None:
        """Empty vLLM's own prefix cache, so that a repeat can hit only through bsr-io."""
        self.nodes[0].reset_prefix_cache()
