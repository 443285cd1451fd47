"""Two vLLM nodes on one machine, each with its own drive (vllm-multinode.md).

vLLM's own multi-node mode (`vllm serve --nnodes 2`, node 1 `--headless`) at TP=2: one
rank per node. Each node's process tree runs in a mount namespace of its own in which
that node's disk directory is bound over the same `store_dir`, so the path every rank is
configured with names a different directory per node and nothing is shared but what is
bound: what a worker can list is what a node-local drive would hold.

Node 0 serves the OpenAI API on 127.0.0.1; requests go over HTTP with token-id prompts
(the tiny models have no tokenizer).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bsr_lab.vllm.harness import BLOCK_SIZE, free_ports


@dataclass(frozen=True)
class Reply:
    tokens: list[int]
    cached: int  # prompt tokens vLLM reports as cached (its own cache or the connector's)
    seconds: float
    request_id: str  # the response's id; vLLM's request ids (and the event log's) extend it


# One OpenMP core per node, the same with the connector and without it.
_CORES = ("0", "1")


@dataclass
class Cluster:
    """Two nodes of one vLLM engine. `disks[n]` is node n's drive, bound at `store`."""

    model: str
    work: Path
    store: Path
    disks: tuple[Path, Path]
    connector: dict[str, Any] | None
    max_model_len: int = 8192
    procs: list[subprocess.Popen[bytes] | None] = field(default_factory=lambda: [None, None])
    api_port: int = 0
    master_port: int = 0
    starts: int = 0
    env: tuple[dict[str, str], dict[str, str]] = ({}, {})  # per node, e.g. BSR_IO_FAULTS

    def _cmd(self, node: int) -> list[str]:
        vllm = str(Path(sys.executable).with_name("vllm"))
        args = [
            vllm, "serve", self.model,
            "--tensor-parallel-size", "2",
            "--nnodes", "2", "--node-rank", str(node),
            "--master-addr", "127.0.0.1", "--master-port", str(self.master_port),
            "--skip-tokenizer-init", "--enable-prefix-caching",
            "--block-size", str(BLOCK_SIZE), "--max-model-len", str(self.max_model_len),
            "--dtype", "bfloat16", "--seed", "0", "--gpu-memory-utilization", "0.08",
        ]  # fmt: skip
        if node == 0:
            args += ["--host", "127.0.0.1", "--port", str(self.api_port)]
            args += ["--enable-prompt-tokens-details", "--served-model-name", "tiny"]
        else:
            args.append("--headless")
        if self.connector is not None:
            kv = {
                "kv_connector": "BsrIoConnector",
                "kv_connector_module_path": "bsr_io.integrations.vllm",
                "kv_role": "kv_both",
                "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": self.connector,
            }
            args += ["--kv-transfer-config", json.dumps(kv)]
        # The node's own drive at the shared path, for this process tree only.
        bind = f"mount --bind {shlex.quote(str(self.disks[node]))} {shlex.quote(str(self.store))}"
        script = f"{bind} && exec {shlex.join(args)}"
        return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script]

    def _env(self, node: int) -> dict[str, str]:
        env = dict(os.environ) | self.env[node]
        env |= {
            "VLLM_HOST_IP": "127.0.0.1",
            "GLOO_SOCKET_IFNAME": "lo",
            "VLLM_CPU_OMP_THREADS_BIND": _CORES[node],
            "VLLM_SERVER_DEV_MODE": "1",  # POST /reset_prefix_cache
        }
        return env

    def start(self, nodes: tuple[int, ...] = (0, 1)) -> None:
        """Start the given nodes (a restarted node joins with the same ports)."""
        if not self.api_port:
            port = free_ports(2)
            self.api_port, self.master_port = port, port + 1
        self.starts += 1
        for node in nodes:
            assert self.procs[node] is None, f"node {node} is running"
            log = open(self.work / f"node{node}-{self.starts}.log", "wb")  # noqa: SIM115
            self.procs[node] = subprocess.Popen(
                self._cmd(node),
                env=self._env(node),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: stopped as one
            )
            log.close()

    def wait_ready(self, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for node, p in enumerate(self.procs):
                if p is not None and p.poll() is not None:
                    tail = self.log_tail(node)
                    raise RuntimeError(f"node {node} exited ({p.returncode}):\n{tail}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1.0)
        raise TimeoutError(f"the cluster did not come up in {timeout:.0f} s:\n{self.log_tail(0)}")

    def kill(self, node: int, sig: int = signal.SIGKILL) -> None:
        p = self.procs[node]
        if p is None:
            return
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            pass
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
        self._reap(p.pid)
        self.procs[node] = None

    def stop(self) -> None:
        """Both nodes, politely first (SIGTERM lets vLLM drain its saves), then by force."""
        for node in (1, 0):
            p = self.procs[node]
            if p is None:
                continue
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for node in (0, 1):
            p = self.procs[node]
            if p is None:
                continue
            try:
                p.wait(timeout=90)
            except subprocess.TimeoutExpired:
                pass
            self.kill(node)

    @staticmethod
    def _reap(pgid: int) -> None:
        """vLLM's workers are children of the node's leader; a SIGKILL of the leader
        leaves them orphaned in its group: end them too."""
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def log_tail(self, node: int, n: int = 6000) -> str:
        logs = sorted(self.work.glob(f"node{node}-*.log"), key=lambda p: p.stat().st_mtime)
        return logs[-1].read_text(errors="replace")[-n:] if logs else ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    def post(self, path: str, body: dict[str, Any] | None, timeout: float) -> dict[str, Any]:
        data = json.dumps(body or {}).encode()
        req = urllib.request.Request(
            f"{self.url}{path}", data=data, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=timeout) as r:
            text = r.read().decode()
        return json.loads(text) if text.strip().startswith("{") else {}

    def complete(self, prompt: list[int], max_tokens: int = 8, timeout: float = 600.0) -> Reply:
        """Greedy completion of a token-id prompt over HTTP."""
        t0 = time.perf_counter()
        out = self.post(
            "/v1/completions",
            {
                "model": "tiny",
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0,
                "return_token_ids": True,
            },
            timeout,
        )
        details = (out.get("usage") or {}).get("prompt_tokens_details") or {}
        return Reply(
            tokens=list(out["choices"][0]["token_ids"]),
            cached=int(details.get("cached_tokens") or 0),
            seconds=time.perf_counter() - t0,
            request_id=str(out["id"]),
        )

    def reset_prefix_cache(self, timeout: float = 120.0) -> None:
        """Empty vLLM's own prefix cache, so that a repeat can hit only through bsr-io."""
        self.post("/reset_prefix_cache", None, timeout)
