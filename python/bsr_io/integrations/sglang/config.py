"""bsr-io's keys in SGLang's `--hicache-storage-backend-extra-config` JSON.

SGLang's own keys (`backend_name`, `module_path`, `class_name`, `interface_v1`) sit
beside them and are left to SGLang; any other unknown key is refused, naming it:

    store_dir     the SSD tier's directory, or a list of them (one per drive: striped)
    lower_dir     a lower tier of plain files under the SSD tier (none)
    capacity      SSD tier capacity per directory: bytes or "64GiB" (default: no cap)
    window        W: records staged at once per batch (32)
    timeout_s     deadline of each batch's reads and slot waits (10)
    direct_reads  read records with O_DIRECT straight into the host pool's pages (true)
    io_backend    engine backend: "auto", "io_uring", "io_uring_plain", "pread"
    queue_depth   io_uring queue depth (32)
    model         model identity in keys (default: SGLang's model_name)
    rescan_s      how often this rank's records are listed again (1)
    mooncake.*    a Mooncake Store pool below the SSD tier (bsr_io.tiers.mooncake.config)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from bsr_io.settings import Key, Table, at_least, parse
from bsr_io.tiers.mooncake import MooncakeConfig


def _finite_positive(v: float) -> bool:
    return math.isfinite(v) and v > 0  # inf would pass `> 0`, then fail every get


def _named(v: str) -> bool:
    return bool(v.strip())  # "" would be taken as no value at all


SGLANG_KEYS = ("backend_name", "module_path", "class_name", "interface_v1")

KEYS = Table(
    (
        Key("store_dir", "str", missing="extra_config needs {label} (the SSD tier's directory)"),
        Key("lower_dir", "str", None, "a directory"),
        Key("capacity", "size", None, "bytes or a size such as '64GiB'", at_least(0)),
        Key("window", "int", 32, "an int >= 1", at_least(1)),
        Key("timeout_s", "float", 10.0, "a finite number > 0", _finite_positive),
        Key("direct_reads", "bool", True, "true or false"),
        Key("io_backend", "str", "auto"),
        Key("queue_depth", "int", 32, "an int >= 1", at_least(1)),
        Key("model", "str", None, "a non-empty string", _named),
        # A rank that does not write (MLA's TP followers) learns of the writer's pages
        # only from this listing, and SGLang takes the MIN over the group: each second
        # of staleness is a miss on every rank. One listing is a getdents pass over this
        # rank's directory per drive, names only, so every second costs little.
        Key("rescan_s", "float", 1.0, "a finite number > 0", _finite_positive),
    ),
    label="'{name}'",
    unknown="unknown keys in the HiCache extra_config {unknown}; bsr-io knows {known}, "
    "mooncake.* and SGLang's backend_name, module_path, class_name, interface_v1",
    missing="extra_config needs '{name}'",
    others=("mooncake.",),
    text=True,
)
_D = KEYS.default


@dataclass(frozen=True)
class Settings:
    store_dirs: tuple[str, ...]
    lower_dir: str | None = _D("lower_dir")
    capacity: int | None = _D("capacity")
    window: int = _D("window")
    timeout_s: float = _D("timeout_s")
    direct_reads: bool = _D("direct_reads")
    io_backend: str = _D("io_backend")
    queue_depth: int = _D("queue_depth")
    model: str | None = _D("model")
    rescan_s: float = _D("rescan_s")
    mooncake: MooncakeConfig | None = None

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> Settings:
        """Read bsr-io's keys; ValueError naming the key when one is unknown, missing or
        bad (raised where SGLang builds the backend, never on its I/O threads)."""
        ours = {k: v for k, v in (extra or {}).items() if k not in SGLANG_KEYS}
        dirs = ours.get("store_dir")
        if isinstance(dirs, list):
            if not dirs or not all(isinstance(d, str) and d for d in dirs):
                raise ValueError(f"'store_dir' must be a directory or a list of them, got {dirs!r}")
            ours["store_dir"] = dirs[0]  # checked as one below; all kept
        values = parse(KEYS, ours)
        store = values.pop("store_dir")
        if not values["capacity"]:
            values["capacity"] = None  # 0: no cap
        try:
            mooncake = MooncakeConfig.from_extra_config(ours, prefix="mooncake.")
        except ValueError as exc:
            raise ValueError(f"bad mooncake.* key in the HiCache extra_config: {exc}") from None
        return cls(tuple(dirs) if isinstance(dirs, list) else (store,), **values, mooncake=mooncake)
