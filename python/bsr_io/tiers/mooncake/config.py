"""How to reach a Mooncake Store pool: one config shared by the API, the CLI and the plugins.

Importing this module does not import Mooncake, so a connector can read its config
(and report a bad one) before the optional package is needed.

Keys (a plain dict, `MooncakeConfig.from_dict`; in an LMCache / vLLM `extra_config`
the same keys carry the prefix `bsr.mooncake.`, `MooncakeConfig.from_extra_config`):

    master            master RPC address host:port (required)
    metadata_server   transfer-engine metadata: "http://host:port/metadata" (the
                      master's embedded HTTP server), an etcd address, or
                      "P2PHANDSHAKE" (required)
    protocol          "tcp" (default) or "rdma"
    device_name       RDMA devices ("" for tcp)
    local_hostname    this process's address as the pool's peers should reach it
                      (default 127.0.0.1: set it on a real fleet)
    bind_address      MC_TCP_BIND_ADDRESS for this process when not already set
                      (default: local_hostname); stops the transfer engine advertising
                      another interface
    timeout_s         deadline of every pool call (read, existence check, put, remove);
                      a call past it fails its chunk; keep it below the restore's timeout (10)
    transfer_timeout_s  MC_TCP_PROGRESS_TIMEOUT_SEC when not already set: how long the
                      transfer engine itself waits on a silent peer before failing (unset:
                      Mooncake's 30 s); a read past `timeout_s` keeps its slot until then
    replica_num       replicas per object (1)
    key_prefix        object names are "<key_prefix>/<namespace>/<chunk hash>" ("bsr-io")
    io_threads        worker threads for data calls, so that many pool reads in flight (2)
    io_priority       CPU priority of those threads: "low" (nice 19, the default), "idle"
                      (SCHED_IDLE) or "normal". Mooncake 0.3's client busy-polls for a
                      transfer's end in the calling thread: at normal priority each call
                      in flight takes a core from the transfer engine and the verification
    direct_reads      read a chunk straight into a host destination's blocks (no slot, no
                      copy) where the window offers it (true). Such a read is never
                      abandoned at `timeout_s`: the pool may still write those blocks, so a
                      stalled node costs Mooncake's own transfer timeout there
                      (`transfer_timeout_s`). TCP only: an RDMA pool reads only into
                      registered memory (the engine's slots)
    snapshot_s        how long one batched existence check answers a probe's per-chunk
                      questions (1.0)
    down_s            after a call past its deadline or a failed RPC, how long the tier
                      reports itself down (discovery finds nothing, reads fall back at
                      once) before it asks the pool again (5.0; 0: never marked down)
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, fields
from typing import Any

EXTRA_PREFIX = "bsr.mooncake."
IO_PRIORITIES = ("low", "idle", "normal")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
_HOSTPORT = re.compile(r"^[A-Za-z0-9_.:\-\[\]]+:\d{1,5}$")


@dataclass(frozen=True)
class MooncakeConfig:
    master: str
    metadata_server: str
    protocol: str = "tcp"
    device_name: str = ""
    local_hostname: str = "127.0.0.1"
    bind_address: str | None = None
    timeout_s: float = 10.0
    transfer_timeout_s: int | None = None
    replica_num: int = 1
    key_prefix: str = "bsr-io"
    io_threads: int = 2
    io_priority: str = "low"
    direct_reads: bool = True
    snapshot_s: float = 1.0
    down_s: float = 5.0

    def __post_init__(self) -> None:
        if not isinstance(self.master, str) or not _HOSTPORT.match(self.master):
            raise ValueError(f"mooncake master must be host:port, got {self.master!r}")
        if not self.metadata_server:
            raise ValueError(
                "mooncake metadata_server is required (e.g. http://HOST:PORT/metadata, the "
                "master's --enable_http_metadata_server)"
            )
        if self.protocol not in ("tcp", "rdma"):
            raise ValueError(f"mooncake protocol must be 'tcp' or 'rdma', got {self.protocol!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"mooncake timeout_s must be positive, got {self.timeout_s}")
        if self.transfer_timeout_s is not None and self.transfer_timeout_s < 1:
            raise ValueError(
                f"mooncake transfer_timeout_s must be at least 1 s, got {self.transfer_timeout_s}"
            )
        if self.replica_num < 1:
            raise ValueError(f"mooncake replica_num must be >= 1, got {self.replica_num}")
        if self.io_threads < 1:
            raise ValueError(f"mooncake io_threads must be >= 1, got {self.io_threads}")
        if self.io_priority not in IO_PRIORITIES:
            raise ValueError(
                f"mooncake io_priority must be one of {IO_PRIORITIES}, got {self.io_priority!r}"
            )
        if not isinstance(self.direct_reads, bool):
            raise ValueError(f"mooncake direct_reads must be a bool, got {self.direct_reads!r}")
        if not re.fullmatch(r"[A-Za-z0-9_.\-]+", self.key_prefix or ""):
            raise ValueError(
                f"mooncake key_prefix must be [A-Za-z0-9_.-]+, got {self.key_prefix!r}"
            )
        if self.snapshot_s < 0:
            raise ValueError(f"mooncake snapshot_s must be >= 0, got {self.snapshot_s}")
        if self.down_s < 0:
            raise ValueError(f"mooncake down_s must be >= 0, got {self.down_s}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MooncakeConfig:
        """From plain keys (see the module doc); ValueError names an unknown or bad key."""
        names = {f.name: f for f in fields(cls)}
        unknown = sorted(set(d) - set(names))
        if unknown:
            raise ValueError(f"unknown mooncake setting(s) {unknown}; known: {sorted(names)}")
        for need in ("master", "metadata_server"):
            if not d.get(need):
                raise ValueError(f"mooncake setting '{need}' is required")
        kw: dict[str, Any] = {}
        try:
            for k, v in d.items():
                if v is None:
                    continue
                if k in ("timeout_s", "snapshot_s", "down_s"):
                    kw[k] = float(v)
                elif k in ("transfer_timeout_s", "replica_num", "io_threads"):
                    kw[k] = int(v)
                elif k == "direct_reads":
                    kw[k] = _bool(k, v)
                else:
                    kw[k] = str(v)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"bad mooncake setting: {exc}") from None
        return cls(**kw)

    @classmethod
    def from_extra_config(
        cls, extra: dict[str, Any] | None, prefix: str = EXTRA_PREFIX
    ) -> MooncakeConfig | None:
        """The `bsr.mooncake.*` keys of an LMCache / vLLM extra_config; None when absent."""
        sub = {k[len(prefix) :]: v for k, v in (extra or {}).items() if k.startswith(prefix)}
        if not sub:
            return None
        return cls.from_dict(sub)

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    def to_extra_config(self, prefix: str = EXTRA_PREFIX) -> dict[str, Any]:
        return {prefix + k: v for k, v in self.to_dict().items()}

    def setup_dict(self) -> dict[str, Any]:
        """The dict `MooncakeDistributedStore.setup` takes: a pure client, no pool memory."""
        return {
            "local_hostname": self.local_hostname,
            "metadata_server": self.metadata_server,
            "global_segment_size": 0,  # this process contributes no memory to the pool
            "local_buffer_size": 0,  # reads and writes are zero-copy from registered memory
            "protocol": self.protocol,
            "rdma_devices": self.device_name,
            "master_server_addr": self.master,
        }

    def apply_env(self) -> None:
        """Set the transfer engine's process-wide knobs, unless the environment already has
        them (they are read once, when the first client starts)."""
        if self.protocol == "tcp":
            os.environ.setdefault("MC_TCP_BIND_ADDRESS", self.bind_address or self.local_hostname)
        if self.transfer_timeout_s is not None:
            os.environ.setdefault("MC_TCP_PROGRESS_TIMEOUT_SEC", str(self.transfer_timeout_s))


def _bool(name: str, v: Any) -> bool:
    if isinstance(v, bool):
        return v
    text = str(v).strip().lower()
    if text in _TRUE or text in _FALSE:
        return text in _TRUE
    raise ValueError(f"mooncake {name} must be true or false, got {v!r}")
