"""Denoiser FLOPs as counted, looked up: `fixed + per_token × tokens + per_token² × tokens²` per denoiser
architecture — its class and config, so a real checkpoint of a shipped architecture finds its count — stored
in `architectures/flops.json`. The counter that writes them (torch's FlopCounterMode over one forward on the
`meta` device) is a maintenance tool, bench/flops.py (`python -m bench.flops` rewrites the file; a test
checks it against a fresh count). Where a class was not counted, the cost model estimates 2 FLOPs per
parameter per token plus attention (offload/cost.py `_flops`)."""

from __future__ import annotations

import hashlib
import json
from functools import lru_cache
from pathlib import Path

STORED = Path(__file__).with_name("architectures") / "flops.json"
IMAGE_ONLY = ("qwen-image",)  # a VAE with a time axis (Qwen-Image's), run on images only


def config_key(cls: str, config: dict) -> str:
    """A denoiser architecture: its class and its config's own keys (not `_name_or_path` and the like)."""
    own = {k: v for k, v in sorted(config.items()) if not k.startswith("_")}
    return hashlib.sha256(json.dumps([cls, own], sort_keys=True, default=str).encode()).hexdigest()[:16]


@lru_cache(maxsize=1)
def _stored() -> dict:
    return json.loads(STORED.read_text()) if STORED.exists() else {}


def counted(cls: str, config: dict | None) -> tuple[float, float, float] | None:
    """(fixed, per token, per token²) FLOPs of one forward of one image, as stored; None if not counted."""
    if not config:
        return None
    found = _stored().get(config_key(cls, dict(config)))
    return tuple(found["terms"]) if found else None
