"""A Mooncake Store pool on loopback: a real master and a real storage node, for tests,
`bsr-lab bench remote` and demos.

Both processes come from the installed `mooncake-transfer-engine*` package, listen on
127.0.0.1 with free ports, and are stopped by PID. `MC_TCP_BIND_ADDRESS=127.0.0.1`
keeps the transfer engine from advertising another interface. Some of Mooncake's
listeners bind 0.0.0.0 whatever they are told (the master's HTTP metadata server, the
storage node's transfer listeners), so `loopback_netns()` moves the calling thread
(and every process and thread it starts afterwards) into a fresh network namespace
that has only `lo`: a misconfigured address then fails instead of leaving loopback.
"""

from __future__ import annotations

import ctypes
import fcntl
import importlib.util
import os
import shutil
import signal
import socket
import stat
import struct
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bsr_io.cli.scratch import make_scratch
from bsr_io.tiers.mooncake import MooncakeConfig

HOST = "127.0.0.1"
_CLONE_NEWNET = 0x40000000
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1


def mooncake_binaries() -> Path:
    """The package directory holding `mooncake_master` and `mooncake_client`."""
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the mooncake package is not installed: pip install 'bsr-io[mooncake]'"
        )
    pkg = Path(list(spec.submodule_search_locations)[0])
    for name in ("mooncake_master", "mooncake_client"):
        exe = pkg / name
        if not exe.is_file():
            raise FileNotFoundError(f"{exe} is missing from the mooncake package")
        if not os.access(exe, os.X_OK):
            exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return pkg


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        port: int = s.getsockname()[1]
        return port


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex((HOST, port)) == 0


def netns_possible() -> bool:
    return os.geteuid() == 0 and os.path.exists("/proc/thread-self/ns/net")


def _setns(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns to a network namespace failed: {os.strerror(err)}")


class LoopbackNetns:
    """A network namespace with only `lo` (up), made once and entered as often as needed.

    Mooncake keeps process-wide transfer-engine state, so a process's clients must all
    live in one namespace: tests enter this same one for every module."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            if libc.unshare(_CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"unshare(CLONE_NEWNET) failed: {os.strerror(err)}")
            try:
                with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                    req = struct.pack("16sH", b"lo", 0)
                    flags = struct.unpack("16sH", fcntl.ioctl(s, _SIOCGIFFLAGS, req))[1]
                    fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack("16sH", b"lo", flags | _IFF_UP))
                self.fd = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            finally:
                _setns(home)
        finally:
            os.close(home)

    @contextmanager
    def entered(self) -> Iterator[None]:
        """Run the calling thread (and what it starts meanwhile) inside the namespace."""
        home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            _setns(self.fd)
            try:
                yield
            finally:
                _setns(home)
        finally:
            os.close(home)

    def close(self) -> None:
        os.close(self.fd)


@contextmanager
def loopback_netns(ns: LoopbackNetns | None = None) -> Iterator[bool]:
    """Run the calling thread in a network namespace with only `lo` (a fresh one unless
    `ns` is given). Processes and threads started inside inherit it. Yields False (and
    changes nothing) where that is not allowed (not root); the caller then relies on
    explicit binds."""
    if ns is None:
        if not netns_possible():
            yield False
            return
        try:
            ns = LoopbackNetns()
        except OSError:
            yield False
            return
    with ns.entered():
        yield True


class LoopbackPool:
    """A master (with its HTTP metadata server) and one storage node on 127.0.0.1.

    `lease_ttl_ms` is the master's `default_kv_lease_ttl`; `client_ttl_s` how long a
    silent storage node keeps its segment. Logs go to `workdir`.
    """

    def __init__(
        self,
        segment_bytes: int = 1 << 30,
        *,
        lease_ttl_ms: int = 1000,
        client_ttl_s: int = 10,
        node_threads: int = 2,
        workdir: str | os.PathLike[str] | None = None,
        start_timeout_s: float = 30.0,
    ) -> None:
        self.bin = mooncake_binaries()
        self.segment_bytes = segment_bytes
        self.lease_ttl_ms = lease_ttl_ms
        self.client_ttl_s = client_ttl_s
        self.node_threads = node_threads
        self.start_timeout_s = start_timeout_s
        self._own_dir = workdir is None
        self.workdir = Path(workdir) if workdir else make_scratch(None, "bsr-mooncake-")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.rpc_port = self.http_port = self.metrics_port = self.node_port = 0
        self.master: subprocess.Popen[bytes] | None = None
        self.node: subprocess.Popen[bytes] | None = None
        self._logs: list[Any] = []

    # -- processes ----------------------------------------------------------------------
    def env(self) -> dict[str, str]:
        return {**os.environ, "MC_TCP_BIND_ADDRESS": HOST}

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        log = open(self.workdir / f"{name}.log", "ab")  # noqa: SIM115 - closed in stop()
        self._logs.append(log)
        return subprocess.Popen(
            [str(self.bin / name), *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self.env(),
            cwd=self.workdir,
        )

    def _wait_port(self, proc: subprocess.Popen[bytes], port: int, what: str) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while not _listening(port):
            if proc.poll() is not None:
                raise RuntimeError(f"{what} exited with {proc.returncode}; see {self.workdir}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} not listening on {HOST}:{port}; see {self.workdir}")
            time.sleep(0.05)

    def start(self) -> LoopbackPool:
        self.rpc_port, self.http_port, self.metrics_port = free_port(), free_port(), free_port()
        self.master = self._spawn(
            "mooncake_master",
            [
                f"--rpc_address={HOST}",
                f"--rpc_port={self.rpc_port}",
                "--enable_http_metadata_server=true",
                f"--http_metadata_server_host={HOST}",
                f"--http_metadata_server_port={self.http_port}",
                f"--metrics_host={HOST}",
                f"--metrics_port={self.metrics_port}",
                f"--default_kv_lease_ttl={self.lease_ttl_ms}",
                f"--client_ttl={self.client_ttl_s}",
            ],
        )
        try:
            self._wait_port(self.master, self.rpc_port, "mooncake_master")
            self._wait_port(self.master, self.http_port, "mooncake_master's metadata server")
            self.start_node()
        except BaseException:
            self.stop()
            raise
        return self

    def start_node(self) -> None:
        """Start (or restart) the storage node that holds the pool's memory."""
        self.node_port = free_port()
        self.node = self._spawn(
            "mooncake_client",
            [
                f"--host={HOST}",
                f"--port={self.node_port}",
                f"--master_server_address={HOST}:{self.rpc_port}",
                f"--metadata_server={self.metadata_server}",
                f"--global_segment_size={self.segment_bytes}",
                "--protocol=tcp",
                f"--threads={self.node_threads}",
            ],
        )
        # The node mounts its segment with the master before it starts serving.
        self._wait_port(self.node, self.node_port, "mooncake_client (storage node)")

    @property
    def master_address(self) -> str:
        return f"{HOST}:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        return f"http://{HOST}:{self.http_port}/metadata"

    def config(self, **overrides: Any) -> MooncakeConfig:
        kw: dict[str, Any] = dict(
            master=self.master_address,
            metadata_server=self.metadata_server,
            local_hostname=HOST,
            bind_address=HOST,
        )
        kw.update(overrides)
        return MooncakeConfig(**kw)

    def pids(self) -> list[int]:
        return [p.pid for p in (self.master, self.node) if p is not None and p.poll() is None]

    def signal_node(self, sig: int) -> None:
        if self.node is not None and self.node.poll() is None:
            os.kill(self.node.pid, sig)

    def stop_node(self) -> None:
        self._stop(self.node)
        self.node = None

    @staticmethod
    def _stop(proc: subprocess.Popen[bytes] | None) -> None:
        if proc is None or proc.poll() is not None:
            return
        try:
            os.kill(proc.pid, signal.SIGCONT)  # a stopped process cannot act on SIGTERM
            proc.terminate()
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
        except ProcessLookupError:
            pass

    def stop(self) -> None:
        self.stop_node()
        self._stop(self.master)
        self.master = None
        for log in self._logs:
            log.close()
        self._logs.clear()
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> LoopbackPool:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
