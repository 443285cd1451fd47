"""bsr-io's LMCache config: the `extra_config` keys that turn it on, and their knobs.

LMCache loads a storage plugin from `storage_plugins: [<name>]` plus
`extra_config["storage_plugin.<name>.module_path" / ".class_name"]`. bsr-io's own
knobs live in the same `extra_config` under `bsr.`:

    bsr.path             directory of the SSD tier (required)
    bsr.capacity         SSD tier capacity: bytes or a size such as "64GiB" (default: no cap)
    bsr.window           W, chunks staged at once by the bounded retrieve and the plugin (32)
    bsr.bounded_retrieve replace this engine's retrieve with the bounded one (true)
    bsr.agreement        "none" or "world": agree on commit across torch.distributed's
                         world (the tensor-parallel ranks) before reporting reuse ("none")
    bsr.timeout_s        how long a rank waits for its peers' votes (30)
    bsr.io_backend       engine backend: "auto", "io_uring", "io_uring_plain", "pread"
    bsr.queue_depth      io_uring queue depth (32)
    bsr.mooncake.*       a Mooncake Store pool as L3 under the SSD tier: master,
                         metadata_server, protocol, timeout_s... (bsr_io.tiers.mooncake_config)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from bsr_io.model.sizes import parse_size
from bsr_io.tiers.mooncake_config import MooncakeConfig

PLUGIN_NAME = "bsr"
MODULE_PATH = "bsr_io.integrations.lmcache.plugin"
CLASS_NAME = "BsrStoragePlugin"


def _bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    s = str(v).strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {v!r}")


def _size(v: Any) -> int:
    return v if isinstance(v, int) else parse_size(str(v))


@dataclass(frozen=True)
class Settings:
    path: str
    capacity: int | None = None
    window: int = 32
    bounded_retrieve: bool = True
    agreement: str = "none"
    timeout_s: float = 30.0
    io_backend: str = "auto"
    queue_depth: int = 32
    mooncake: MooncakeConfig | None = None  # a pool as L3 below the SSD tier

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> Settings:
        """Read `bsr.*` keys; ValueError naming the key when one is missing or bad."""
        extra = extra or {}
        if not extra.get("bsr.path"):
            raise ValueError("extra_config needs 'bsr.path' (the SSD tier's directory)")
        try:
            s = cls(
                path=str(extra["bsr.path"]),
                capacity=_size(extra["bsr.capacity"]) if extra.get("bsr.capacity") else None,
                window=int(extra.get("bsr.window", cls.window)),
                bounded_retrieve=_bool(extra.get("bsr.bounded_retrieve", cls.bounded_retrieve)),
                agreement=str(extra.get("bsr.agreement", cls.agreement)).lower(),
                timeout_s=float(extra.get("bsr.timeout_s", cls.timeout_s)),
                io_backend=str(extra.get("bsr.io_backend", cls.io_backend)),
                queue_depth=int(extra.get("bsr.queue_depth", cls.queue_depth)),
                mooncake=MooncakeConfig.from_extra_config(extra),
            )
        except (TypeError, ValueError) as exc:
            raise ValueError(f"bad bsr.* setting in extra_config: {exc}") from None
        if s.window < 1:
            raise ValueError(f"bsr.window must be at least 1, got {s.window}")
        if s.agreement not in ("none", "world"):
            raise ValueError(f"bsr.agreement must be 'none' or 'world', got {s.agreement!r}")
        if s.timeout_s <= 0:
            raise ValueError(f"bsr.timeout_s must be positive, got {s.timeout_s}")
        return s


def lmcache_settings(
    path: str | os.PathLike[str],
    *,
    window: int = 32,
    capacity: int | str | None = None,
    name: str = PLUGIN_NAME,
    **bsr: Any,
) -> dict[str, Any]:
    """LMCache config keys (the top-level dict of a YAML config) that turn bsr-io on."""
    extra: dict[str, Any] = {
        f"storage_plugin.{name}.module_path": MODULE_PATH,
        f"storage_plugin.{name}.class_name": CLASS_NAME,
        "bsr.path": str(path),
        "bsr.window": window,
    }
    if capacity is not None:
        extra["bsr.capacity"] = capacity
    extra.update({f"bsr.{k}": v for k, v in bsr.items()})
    return {"storage_plugins": [name], "extra_config": extra}
