"""bsr-io's LMCache config: the `extra_config` keys that turn it on, and their knobs.

LMCache loads a storage plugin from `storage_plugins: [<name>]` plus
`extra_config["storage_plugin.<name>.module_path" / ".class_name"]`. bsr-io's own
knobs live in the same `extra_config` under `bsr.` (the table `KEYS`: types, defaults,
ranges; an unknown `bsr.` key is refused, LMCache's own keys are left to it):

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
                         metadata_server, protocol, timeout_s... (bsr_io.tiers.mooncake.config)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from bsr_io.errors import BsrValueError
from bsr_io.settings import Key, Table, at_least, parse, positive
from bsr_io.tiers.mooncake import MooncakeConfig

PLUGIN_NAME = "bsr"
MODULE_PATH = "bsr_io.integrations.lmcache.plugin"
CLASS_NAME = "BsrStoragePlugin"

KEYS = Table(
    (
        Key("path", "str", missing="extra_config needs '{label}' (the SSD tier's directory)"),
        Key("capacity", "size", None, "bytes or a size such as '64GiB'", at_least(0)),
        Key("window", "int", 32, "at least 1", at_least(1)),
        Key("bounded_retrieve", "bool", True, "true or false"),
        Key("agreement", "str", "none", "'none' or 'world'", choices=("none", "world"), fold=True),
        Key("timeout_s", "float", 30.0, "positive", positive),
        Key("io_backend", "str", "auto"),
        Key("queue_depth", "int", 32, "an int"),
    ),
    label="bsr.{name}",
    unknown="unknown bsr.* keys in extra_config {unknown}; known: {known} and bsr.mooncake.*",
    missing="extra_config needs 'bsr.{name}'",
    prefix="bsr.",
    others=("mooncake.",),
    text=True,
)
"""bsr-io's keys in LMCache's `extra_config` (the module doc says what each does); the
`bsr.mooncake.*` keys are `MooncakeConfig`'s."""
_D = KEYS.default


@dataclass(frozen=True)
class Settings:
    path: str
    capacity: int | None = _D("capacity")
    window: int = _D("window")
    bounded_retrieve: bool = _D("bounded_retrieve")
    agreement: str = _D("agreement")
    timeout_s: float = _D("timeout_s")
    io_backend: str = _D("io_backend")
    queue_depth: int = _D("queue_depth")
    mooncake: MooncakeConfig | None = None  # a pool as L3 below the SSD tier

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> Settings:
        """Read `bsr.*` keys; ValueError naming the key when one is unknown, missing or bad."""
        extra = extra or {}
        values = parse(KEYS, extra)
        if not values["capacity"]:
            values["capacity"] = None  # 0: no cap
        try:
            mooncake = MooncakeConfig.from_extra_config(extra)
        except ValueError as exc:
            raise BsrValueError(f"bad bsr.* setting in extra_config: {exc}") from None
        return cls(**values, mooncake=mooncake)


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
