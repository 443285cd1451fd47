"""Configuration errors raise where SGLang builds the backend, naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest
from pools import extra_config, make_backend, mha_pool, storage_config
from sglang.srt.mem_cache.storage import StorageBackendFactory


def _create(extra: dict) -> object:
    return StorageBackendFactory.create_backend("dynamic", storage_config(extra), None)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"store_dir": None}, "extra_config needs 'store_dir'"),
        ({"store_dir": "/nonexistent/bsr"}, "'store_dir' '/nonexistent/bsr' is not a directory"),
        ({"lower_dir": "/nonexistent/l3"}, "'lower_dir' '/nonexistent/l3' is not a directory"),
        ({"windw": 4}, "unknown keys in the HiCache extra_config ['windw']"),
        ({"window": 0}, "'window' must be an int >= 1, got 0"),
        ({"timeout_s": "soon"}, "'timeout_s' must be a finite number > 0, got 'soon'"),
        # inf passed a `> 0` check, then every get failed with a logged traceback.
        ({"timeout_s": float("inf")}, "'timeout_s' must be a finite number > 0, got inf"),
        ({"timeout_s": "nan"}, "'timeout_s' must be a finite number > 0, got 'nan'"),
        # An empty name was taken as none: SGLang's model_name was used silently.
        ({"model": ""}, "'model' must be a non-empty string, got ''"),
        ({"model": "  "}, "'model' must be a non-empty string, got '  '"),
        ({"direct_reads": "maybe"}, "'direct_reads' must be true or false"),
        ({"rescan_s": 0}, "'rescan_s' must be a finite number > 0, got 0"),
        ({"rescan_s": -1.0}, "'rescan_s' must be a finite number > 0, got -1.0"),
        ({"rescan_s": float("inf")}, "'rescan_s' must be a finite number > 0, got inf"),
        ({"interface_v1": 0}, '"interface_v1": 1'),
        ({"mooncake.mastr": "h:1"}, "mooncake"),
    ],
)
def test_bad_settings_name_the_key(store_dir: Path, change: dict, message: str) -> None:
    extra = extra_config(store_dir)
    for k, v in change.items():
        if v is None:
            extra.pop(k)
        else:
            extra[k] = v
    with pytest.raises(ValueError) as err:
        _create(extra)
    assert message in str(err.value)


def test_a_layout_it_cannot_read_is_refused_at_registration(store_dir: Path) -> None:
    with pytest.raises(ValueError, match="cannot read pages of host layout 'page_unified'"):
        make_backend(store_dir, mha_pool("page_unified"))


def test_striped_over_several_directories(tmp_path: Path) -> None:
    dirs = [tmp_path / "d0", tmp_path / "d1"]
    for d in dirs:
        d.mkdir()
    import torch
    from pools import fill, keys, page_bytes

    src = mha_pool("page_first")
    at = torch.arange(src.page_size, 9 * src.page_size)
    fill(src, at, seed=8)
    b = make_backend([str(d) for d in dirs], src)
    assert b.batch_set_v1(keys(8), at) == [True] * 8
    b.close()
    assert all(any(d.rglob("*.chunk")) for d in dirs)  # records on both drives
    dst = mha_pool("page_first")
    r = make_backend([str(d) for d in dirs], dst)
    assert r.batch_get_v1(keys(8), at) == [True] * 8
    assert page_bytes(dst, at) == page_bytes(src, at)
    r.close()


def test_a_sidecar_pool_without_pages_is_refused_at_registration(store_dir: Path) -> None:
    from sglang.srt.mem_cache.memory_pool_host import LogicalHostPool

    pool = mha_pool("page_first")
    b = make_backend(store_dir, pool)
    b.register_mem_host_pool_v2(pool, "kv")  # the anchor again: served once
    # A pool of indices only (no bytes) is no sidecar to store: refused, named.
    with pytest.raises(ValueError, match=r"LogicalHostPool 'swa'.*no host KV buffer"):
        b.register_mem_host_pool_v2(LogicalHostPool(64, 16, layout="page_first"), "swa")
    b.on_host_pools_registered()
    assert sorted(b.groups) == ["kv"]
    b.close()
