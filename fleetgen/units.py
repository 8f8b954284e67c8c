"""Sizes on the command line: `24GiB`, `80GB`, `512MiB`, `1.5TiB`."""

from __future__ import annotations

import re

from fleetgen.errors import ConfigError

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")


def parse_size(text: str, option: str) -> int:
    """Bytes in `text`; a unit is required so that `24` is not read as 24 bytes."""
    m = _SIZE.fullmatch(str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS or unit in ("", "b"):
        raise ConfigError(f"`{option}` must be a size like `24GiB`, got `{text}`.")
    return int(float(m.group(1)) * _UNITS[unit])


def format_size(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 0.1 * 2**30 else f"{n / 2**20:.1f} MiB"
