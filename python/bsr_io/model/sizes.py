"""Byte sizes: the binary units, and parsing and printing sizes as configs and the CLI
take them (16MiB, 2GiB, 4096)."""

from __future__ import annotations

from bsr_io.errors import BsrValueError

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1 << 10,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1 << 20,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1 << 30,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1 << 40,
}


def parse_size(text: str) -> int:
    s = text.strip().lower().replace("_", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num) :]
    if not num or unit not in _UNITS:
        raise BsrValueError(f"cannot read size {text!r}: use a number with B, KiB, MiB, GiB or TiB")
    value = float(num) * _UNITS[unit]
    if value < 0 or value != int(value):
        raise BsrValueError(f"size {text!r} must be a whole, non-negative number of bytes")
    return int(value)


def fmt_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
