"""How to reach a Mooncake Store pool: one config shared by the API, the CLI and the plugins.

Importing this module does not import Mooncake, so a connector can read its config
(and report a bad one) before the optional package is needed.

Keys (a plain dict, `MooncakeConfig.from_dict`; in an LMCache / vLLM `extra_config`
the same keys carry the prefix `bsr.mooncake.`, `MooncakeConfig.from_extra_config`);
their types, defaults and ranges are the table `KEYS` (`bsr_io.settings`):

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

from bsr_io.settings import REQUIRED, Key, Table, at_least, not_empty, parse, positive, validate

EXTRA_PREFIX = "bsr.mooncake."
IO_PRIORITIES = ("low", "idle", "normal")
_HOSTPORT = re.compile(r"^[A-Za-z0-9_.:\-\[\]]+:\d{1,5}$")
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")

KEYS = Table(
    (
        Key("master", "str", REQUIRED, "host:port", lambda v: bool(_HOSTPORT.match(v))),
        Key(
            "metadata_server",
            "str",
            REQUIRED,
            check=not_empty,
            message="{label} is required (e.g. http://HOST:PORT/metadata, the master's "
            "--enable_http_metadata_server)",
        ),
        Key("protocol", "str", "tcp", "'tcp' or 'rdma'", choices=("tcp", "rdma")),
        Key("device_name", "str", ""),
        Key("local_hostname", "str", "127.0.0.1"),
        Key("bind_address", "str", None),
        Key("timeout_s", "float", 10.0, "positive", positive),
        Key("transfer_timeout_s", "int", None, "at least 1 s", at_least(1)),
        Key("replica_num", "int", 1, ">= 1", at_least(1)),
        Key("key_prefix", "str", "bsr-io", "[A-Za-z0-9_.-]+", lambda v: bool(_NAME.fullmatch(v))),
        Key("io_threads", "int", 2, ">= 1", at_least(1)),
        Key("io_priority", "str", "low", f"one of {IO_PRIORITIES}", choices=IO_PRIORITIES),
        Key("direct_reads", "bool", True, "true or false"),
        Key("snapshot_s", "float", 1.0, ">= 0", at_least(0)),
        Key("down_s", "float", 5.0, ">= 0", at_least(0)),
    ),
    label="mooncake {name}",
    unknown="unknown mooncake setting(s) {unknown}; known: {known}",
    missing="mooncake setting '{name}' is required",
    text=True,
    null_is_default=True,
)
"""The keys: their types, defaults and ranges (the module doc says what each does)."""
_D = KEYS.default


@dataclass(frozen=True)
class MooncakeConfig:
    master: str
    metadata_server: str
    protocol: str = _D("protocol")
    device_name: str = _D("device_name")
    local_hostname: str = _D("local_hostname")
    bind_address: str | None = _D("bind_address")
    timeout_s: float = _D("timeout_s")
    transfer_timeout_s: int | None = _D("transfer_timeout_s")
    replica_num: int = _D("replica_num")
    key_prefix: str = _D("key_prefix")
    io_threads: int = _D("io_threads")
    io_priority: str = _D("io_priority")
    direct_reads: bool = _D("direct_reads")
    snapshot_s: float = _D("snapshot_s")
    down_s: float = _D("down_s")

    def __post_init__(self) -> None:
        validate(KEYS, {f.name: getattr(self, f.name) for f in fields(self)})

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MooncakeConfig:
        """From plain keys (see the module doc); ValueError names an unknown or bad key."""
        return cls(**parse(KEYS, d))

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
