"""Parsing and printing byte sizes and host:port addresses for the CLI and config."""

from __future__ import annotations

import re

from dkv.errors import ConfigError

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "kib": 2**10,
    "m": 10**6, "mb": 10**6, "mib": 2**20,
    "g": 10**9, "gb": 10**9, "gib": 2**30,
    "t": 10**12, "tb": 10**12, "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


def parse_size(text: str | int) -> int:
    """``"8GiB"`` → 8589934592. Accepts B, K/KB/KiB, M/MB/MiB, G/GB/GiB, T/TB/TiB (case-insensitive)."""
    if isinstance(text, int):
        if text < 0:
            raise ConfigError(f"size must not be negative: {text}")
        return text
    match = _SIZE_RE.match(text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ConfigError(f"cannot read size {text!r}: use e.g. 512MiB, 8GiB, 1000000")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_size(num_bytes: int) -> str:
    """Human-readable binary size: 1536 → ``"1.5 KiB"``."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def parse_address(text: str, default_port: int | None = None) -> tuple[str, int]:
    """``"host:port"`` (or ``"[v6]:port"``) → ``(host, port)``; ``ConfigError`` if malformed."""
    text = text.strip()
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep:
            host, port_text = text, ""
    if not port_text:
        if default_port is None:
            raise ConfigError(f"address {text!r} needs a port: HOST:PORT")
        port_text = str(default_port)
    if not host or not port_text.isdigit() or not 0 <= int(port_text) < 65536:
        raise ConfigError(f"cannot read address {text!r}: use HOST:PORT")
    return host, int(port_text)


def is_loopback(host: str) -> bool:
    """True when ``host`` names only this machine (127.0.0.0/8, ::1, localhost)."""
    return host == "localhost" or host == "::1" or host.startswith("127.")
