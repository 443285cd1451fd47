"""The one settings loader (bsr_io.settings) on a table of its own, and on the three
tables that use it: every error names the key and what it allows; nothing unknown,
missing or mistyped passes."""

from __future__ import annotations

import pytest

from bsr_io.settings import REQUIRED, Key, Table, at_least, parse, positive, validate


class SettingError(ValueError):
    pass


TABLE = Table(
    keys=(
        Key("dir", "str", REQUIRED, "a directory"),
        Key("window", "int", 8, "an int >= 1", check=at_least(1)),
        Key("timeout_s", "float", 30.0, "a number > 0", check=positive),
        Key("size", "size", 1 << 30, "a size"),
        Key("fsync", "bool", True, "true or false"),
        Key("mode", "str", "fast", "fast or safe", choices=("fast", "safe"), fold=True),
    ),
    label="x.{name}",
    unknown="unknown keys {unknown}; known: {known}",
    missing="{label} is required",
    prefix="x.",
    others=("pool.",),
    error=SettingError,
)
TEXT = Table(**{**TABLE.__dict__, "text": True})


def test_defaults_fill_in_and_foreign_keys_are_left_alone():
    got = parse(TABLE, {"x.dir": "/d", "other": 1, "x.pool.master": "h:1"})
    assert got == {
        "dir": "/d",
        "window": 8,
        "timeout_s": 30.0,
        "size": 1 << 30,
        "fsync": True,
        "mode": "fast",
    }


def test_unknown_and_missing_keys_are_named():
    with pytest.raises(SettingError, match=r"unknown keys \['x.windows'\].*'x.window'"):
        parse(TABLE, {"x.dir": "/d", "x.windows": 4})
    with pytest.raises(SettingError, match="x.dir is required"):
        parse(TABLE, {"x.window": 4})
    with pytest.raises(SettingError, match="x.dir is required"):
        parse(TABLE, {"x.dir": ""})


@pytest.mark.parametrize(
    "key, value, allowed",
    [
        ("window", 0, "an int >= 1"),
        ("window", 2.5, "an int >= 1"),
        ("window", True, "an int >= 1"),  # a bool is no number here
        ("window", "4", "an int >= 1"),  # text only where the table reads text
        ("timeout_s", -1, "a number > 0"),
        ("timeout_s", 0, "a number > 0"),
        ("fsync", "false", "true or false"),
        ("mode", "turbo", "fast or safe"),
    ],
)
def test_each_bad_value_names_its_key_and_what_it_allows(key, value, allowed):
    with pytest.raises(SettingError) as err:
        parse(TABLE, {"x.dir": "/d", f"x.{key}": value})
    assert str(err.value) == f"x.{key} must be {allowed}, got {value!r}"


def test_a_text_table_reads_text_as_each_key_type():
    got = parse(
        TEXT,
        {
            "x.dir": "/d",
            "x.window": "4",
            "x.timeout_s": "2.5",
            "x.size": "64MiB",
            "x.fsync": "off",
            "x.mode": "SAFE",
        },
    )
    assert (got["window"], got["timeout_s"], got["size"]) == (4, 2.5, 64 << 20)
    assert got["fsync"] is False and got["mode"] == "safe"
    with pytest.raises(SettingError, match=r"x.window must be an int >= 1, got '4x'"):
        parse(TEXT, {"x.dir": "/d", "x.window": "4x"})


def test_validate_checks_typed_values_with_the_same_messages():
    good = parse(TABLE, {"x.dir": "/d"})
    validate(TABLE, good)
    with pytest.raises(SettingError, match="x.window must be an int >= 1, got -3"):
        validate(TABLE, {**good, "window": -3})


def test_the_three_integrations_refuse_through_the_loader():
    """Each integration's table is the loader's: an unknown key and a bad value are
    refused naming the key (LMCache's `bsr.*` keys, Mooncake's pool keys, vLLM's)."""
    from bsr_io.integrations.lmcache.config import KEYS as LMCACHE
    from bsr_io.tiers.mooncake.config import KEYS as MOONCAKE

    for table in (LMCACHE, MOONCAKE):
        assert isinstance(table, Table) and table.keys
        bogus = table.prefix + "no_such_key"
        with pytest.raises(ValueError, match="no_such_key"):
            parse(table, {bogus: 1})
