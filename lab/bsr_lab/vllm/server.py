"""`vllm serve` as a subprocess: start it, wait for it, talk to it over HTTP, stop it.

Test and bench support (the integration never imports it). One `Server` is one
`vllm serve` process tree (API server, engine core, workers) in a process group of its
own, so `stop()` and `kill()` end every process of it by the group's id, never by name.

    srv = Server(model, connector={"store_dir": ...}, log=work / "serve.log")
    srv.start()
    srv.wait_ready()
    try:
        out = srv.complete(prompt_ids, max_tokens=8)
    finally:
        srv.stop()

Parameters for other shapes (two nodes, each in its own mount namespace):

- `args`: extra CLI arguments appended after the defaults (`--nnodes 2 --node-rank 1
  --headless ...`); `base_args=False` drops the defaults (see `default_args`).
- `env`: variables set on top of this process's environment (`VLLM_HOST_IP=...`).
- `prefix`: a command prefix. If it ends in `-c` (a shell: `["unshare", "--mount",
  "--propagation", "private", "sh", "-c"]`), the vLLM command is passed as one script,
  `setup && exec vllm serve ...`, with `setup` (e.g. `mount --bind DISK STORE`) run first;
  otherwise the vLLM command's arguments are appended to it.
- `headless`: a node without the API server (`--headless` in `args`): `wait_ready` then
  only checks that it is still running; wait on node 0's API instead.
- `log`: the file that gets the process tree's stdout and stderr (vLLM's log).

Requests use token-id prompts (the lab's tiny models have no tokenizer, so the server
runs with `--skip-tokenizer-init` and answers with `token_ids`).
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
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bsr_lab.vllm.harness import BLOCK_SIZE, KV_CACHE_BYTES, eager, free_ports


def kv_transfer_config(connector: dict[str, Any], policy: str = "recompute") -> str:
    """The `--kv-transfer-config` JSON that loads bsr-io's connector (as docs/vllm.md
    shows it), with `connector` as its `kv_connector_extra_config`."""
    return json.dumps(
        {
            "kv_connector": "BsrIoConnector",
            "kv_connector_module_path": "bsr_io.integrations.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": policy,
            "kv_connector_extra_config": connector,
        }
    )


def default_args(
    max_model_len: int = 8192, block_size: int = BLOCK_SIZE, dtype: str = "bfloat16"
) -> list[str]:
    """The flags every lab server runs with, with and without the connector."""
    return [
        "--skip-tokenizer-init",
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--block-size", str(block_size),
        "--max-model-len", str(max_model_len),
        "--dtype", dtype,
        "--seed", "0",
        "--kv-cache-memory-bytes", str(KV_CACHE_BYTES),
        *(["--enforce-eager"] if eager() else []),
    ]  # fmt: skip


def vllm_exe() -> str:
    """The `vllm` entry point of this interpreter's virtualenv."""
    return str(Path(sys.executable).with_name("vllm"))


@dataclass
class Server:
    """One `vllm serve` process tree on 127.0.0.1 (see the module docstring)."""

    model: str
    connector: dict[str, Any] | None = None
    log: Path | None = None
    args: Sequence[str] = ()
    env: dict[str, str] = field(default_factory=dict)
    prefix: Sequence[str] = ()
    setup: str = ""
    headless: bool = False
    port: int = 0
    threads_bind: str | None = None
    base_args: bool = True
    max_model_len: int = 8192
    dtype: str = "bfloat16"  # the weights' and KV's; float32 where the CPU lacks AVX-512
    served_model_name: str | None = None
    policy: str = "recompute"
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None, "not started"
        return self.proc.pid

    @property
    def name(self) -> str:
        """The model name requests must give."""
        return self.served_model_name or self.model

    def command(self) -> list[str]:
        cmd = [vllm_exe(), "serve", self.model]
        if self.base_args:
            cmd += default_args(self.max_model_len, dtype=self.dtype)
        if not self.headless:
            cmd += ["--host", "127.0.0.1", "--port", str(self.port)]
        if self.served_model_name:
            cmd += ["--served-model-name", self.served_model_name]
        if self.connector is not None:
            cmd += ["--kv-transfer-config", kv_transfer_config(self.connector, self.policy)]
        cmd += list(self.args)
        if not self.prefix:
            assert not self.setup, "setup needs a shell prefix ending in -c"
            return cmd
        if self.prefix[-1] == "-c":
            script = f"exec {shlex.join(cmd)}"
            if self.setup:
                script = f"{self.setup} && {script}"
            return [*self.prefix, script]
        return [*self.prefix, *cmd]

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env["VLLM_SERVER_DEV_MODE"] = "1"  # POST /reset_prefix_cache
        if self.threads_bind is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.threads_bind
        env.update(self.env)
        return env

    def start(self) -> None:
        """Start the process tree (again after `stop`/`kill`: same port, same store)."""
        assert self.proc is None or self.proc.poll() is not None, "already running"
        if not self.port and not self.headless:
            self.port = free_ports(1)
        self.starts += 1
        out = open(self.log, "ab") if self.log else subprocess.DEVNULL  # noqa: SIM115
        try:
            self.proc = subprocess.Popen(
                self.command(),
                env=self.environment(),
                stdout=out,
                stderr=subprocess.STDOUT,
                # Its own process group (stopped as one), in the caller's session. A
                # session of its own is a scheduling group of its own (the kernel's
                # autogroup): on one machine, node 1's connector threads then sit on
                # node 0's OpenMP core as another group, and were measured runnable
                # but unscheduled for up to 26 s while node 0's worker spun there
                # (a load past its deadline; issue 50, test_two_nodes).
                process_group=0,
            )
        finally:
            if not isinstance(out, int):
                out.close()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self, timeout: float = 600.0) -> float:
        """Wait for /health (or, headless, for the process to stay up); seconds waited."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if not self.alive():
                code = self.proc.returncode if self.proc else None
                raise RuntimeError(f"vllm serve exited ({code}):\n{self.log_tail()}")
            if self.headless:
                return time.monotonic() - t0
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"vllm serve not ready in {timeout:.0f} s:\n{self.log_tail()}")

    def _signal(self, sig: int) -> None:
        if self.alive():
            assert self.proc is not None
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def _wait_group(self, timeout: float) -> bool:
        """Wait until no process of the group is left (workers outlive the API server)."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.proc.poll()
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                return True
            time.sleep(0.2)
        return False

    def stop(self, timeout: float = 60.0) -> None:
        """SIGTERM to the group (vLLM shuts down cleanly), SIGKILL after `timeout`."""
        if self.proc is None:
            return
        self._signal(signal.SIGTERM)
        if not self._wait_group(timeout):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._wait_group(30.0)
        self.proc.wait()

    def kill(self) -> None:
        """`kill -9` of every process of the tree at once (a crash: nothing flushes)."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._wait_group(30.0)
        self.proc.wait()

    def group_pids(self) -> list[int]:
        """The processes of the server's process group, from /proc."""
        out = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    # pgrp is the 3rd field after the parenthesised command name.
                    if int(f.read().rsplit(")", 1)[1].split()[2]) == self.pid:
                        out.append(int(entry))
            except (OSError, ValueError, IndexError):  # it exited while read
                continue
        return out

    def usage(self) -> dict[str, float]:
        """The process tree's open files, threads and RSS (MiB), summed over the
        processes of its group, from /proc (a process that exits while read is skipped)."""
        procs = fds = threads = 0
        rss_kib = 0
        for entry in map(str, self.group_pids()):
            try:
                n_fds = len(os.listdir(f"/proc/{entry}/fd"))
                with open(f"/proc/{entry}/status") as f:
                    status = dict(line.split(":", 1) for line in f if ":" in line)
            except (OSError, ValueError, IndexError):
                continue
            procs += 1
            fds += n_fds
            threads += int(status["Threads"])
            rss_kib += int(status.get("VmRSS", "0 kB").split()[0])
        return {"procs": procs, "fds": fds, "threads": threads, "rss_mib": rss_kib / 1024}

    def log_tail(self, n: int = 6000) -> str:
        if self.log is None or not self.log.exists():
            return ""
        return self.log.read_bytes()[-n:].decode(errors="replace")

    # -- HTTP -------------------------------------------------------------------------
    def post(self, path: str, body: dict[str, Any] | None = None, timeout: float = 300.0) -> Any:
        data = json.dumps(body).encode() if body is not None else b""
        req = urllib.request.Request(
            self.url + path, data=data, method="POST", headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                raw = r.read()
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"POST {path}: {e.code} {e.read()[:500]!r}") from None
        return json.loads(raw) if raw else None

    def body(self, prompt: list[int], max_tokens: int, **extra: Any) -> dict[str, Any]:
        return {
            "model": self.name,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "return_token_ids": True,
            **extra,
        }

    def complete(self, prompt: list[int], max_tokens: int = 8, **extra: Any) -> Completion:
        """One greedy completion of a token-id prompt."""
        t0 = time.perf_counter()
        r = self.post("/v1/completions", self.body(prompt, max_tokens, **extra))
        dt = time.perf_counter() - t0
        details = r["usage"].get("prompt_tokens_details") or {}
        return Completion(
            list(r["choices"][0]["token_ids"]), details.get("cached_tokens"), r["id"], dt
        )

    def stream(
        self, prompt: list[int], max_tokens: int = 8, timeout: float = 600.0, **extra: Any
    ) -> Generator[Any, None, None]:
        """A streamed greedy completion: yields each server-sent event's JSON. Closing the
        generator early, or `timeout` s without data (TimeoutError), closes the connection
        (vLLM aborts the request)."""
        body = self.body(prompt, max_tokens, stream=True, **extra)
        body["stream_options"] = {"include_usage": True}
        req = urllib.request.Request(
            self.url + "/v1/completions",
            data=json.dumps(body).encode(),
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=timeout) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    return
                yield json.loads(payload)

    def streamed(
        self, prompt: list[int], max_tokens: int, abort: bool = False, **extra: Any
    ) -> Streamed | None:
        """A streamed completion, gathered: its tokens, their top log-probs (with
        `logprobs=N` in `extra`) and the cached prompt tokens. `abort`: close the
        connection after the first tokens (vLLM aborts the request; None then)."""
        out = Streamed([], [], 0)
        gen = self.stream(prompt, max_tokens, **extra)
        try:
            for ev in gen:
                for c in ev.get("choices", []):
                    out.tokens += c.get("token_ids") or []
                    out.tops += top_logprobs(c)
                details = (ev.get("usage") or {}).get("prompt_tokens_details") or {}
                out.cached = details.get("cached_tokens", out.cached) or 0
                if abort and out.tokens:
                    return None
        finally:
            gen.close()
        return out

    def reset_prefix_cache(self, timeout: float = 120.0) -> None:
        """Drop vLLM's own prefix cache (VLLM_SERVER_DEV_MODE), so a repeat can only hit
        through the connector."""
        deadline = time.monotonic() + timeout
        while True:
            r = self.post("/reset_prefix_cache")
            if not isinstance(r, dict) or r.get("success", True):
                return
            if time.monotonic() > deadline:
                raise TimeoutError("vLLM's prefix cache could not be reset (blocks held)")
            time.sleep(0.2)

    def metrics(self) -> dict[str, float]:
        """vLLM's Prometheus samples, name{labels} -> value."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out


def top_logprobs(choice: dict[str, Any]) -> list[dict[int, float]]:
    """Per token of a completion choice: its top log-probs, token id -> log-prob (vLLM
    names the ids "token_ID" with token ids returned)."""
    lp = choice.get("logprobs") or {}
    return [{int(k[1:]): v for k, v in t.items()} for t in lp.get("top_logprobs") or []]


@dataclass
class Streamed:
    tokens: list[int]
    tops: list[dict[int, float]]  # per token: its top log-probs, token id -> log-prob
    cached: int  # prompt tokens served from a cache (vLLM's own or the connector)


@dataclass
class Completion:
    tokens: list[int]
    cached: int | None  # prompt tokens served from a cache (vLLM's own or the connector)
    request_id: str
    seconds: float
