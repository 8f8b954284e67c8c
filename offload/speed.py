"""The speed model: what a component's forward costs on a device, in terms a measurement can be set
beside — compute (its FLOPs at an achieved share of the device's matmul rate), host→device
transfers (each group's copy at the achieved link rate plus a fixed cost per copy, so that
leaf-level's many small copies cost what they do), hidden behind compute or exposed, and fixed
overheads (per forward: kernel launches and Python; per pipeline call: the scheduler and the latents'
preparation; per image: its post-processing on the host). A component the pipeline upcasts to float32
(SDXL's VAE) computes at `FP32_SLOWDOWN` of the rate: cuDNN's convolutions run float32 as TF32 by
default, half of bf16's dense rate on the tensor cores of an A100, H100 or H200.

The shares and fixed costs are fitted to measured rows (bench/fit_speed.py, BENCHMARKS.md "The
speed model fitted"): `speed.json` beside this file holds the fit, the rows it was fitted on and its
errors. A device's own figures (`DeviceSpec.flops`, `.bandwidth`) are what a worker's probe measures
(a large matmul, a large pinned copy), or a card's datasheet figures scaled as a probe reads them
(offload/devices.py). `FLEETGEN_SPEED_MODEL=path.json` plans with another fit (a refit on new rows).
Pure: no torch."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from functools import lru_cache
from pathlib import Path

STORED = Path(__file__).with_name("speed.json")
ENV = "FLEETGEN_SPEED_MODEL"
KINDS = ("denoiser", "text", "vae")
FP32_SLOWDOWN = 2.0


@dataclass(frozen=True)
class Speed:
    """The fitted constants (defaults: the cost model's before any fit)."""

    denoiser: float = 1.0  # achieved share of the device's matmul rate by the denoiser's counted FLOPs
    text: float = 1.0  # ... by a text (or image) encoder's
    vae: float = 1.0  # ... by the VAE's (convolutions at full resolution)
    link: float = 1.0  # achieved share of the device's host→device rate by a large offloaded group's copy
    copy_seconds: float = 30e-6  # fixed cost of each group's copy (launch, synchronise)
    forward_seconds: float = 1e-3  # fixed cost of one forward of a component (kernel launches, Python)
    call_seconds: float = 0.0  # fixed cost of one pipeline call (scheduler, latents, Python)
    image_seconds: float = 0.0  # fixed cost of each image of a call (its post-processing on the host)

    def share(self, kind: str) -> float:
        return getattr(self, kind)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def of(cls, values: dict) -> Speed:
        known = {f.name for f in fields(cls)}
        return cls(**{k: float(v) for k, v in values.items() if k in known})


def kind(name: str, per_step: bool) -> str:
    """Which share a component's compute runs at: the denoiser's, the VAE's, or an encoder's."""
    return "denoiser" if per_step else "vae" if name == "vae" else "text"


@lru_cache(maxsize=8)
def _read(path: str) -> Speed:
    return Speed.of(json.loads(Path(path).read_text())["model"])


def fitted() -> Speed:
    """The fit the planner uses: `FLEETGEN_SPEED_MODEL`'s file, else the stored one, else the defaults."""
    path = os.environ.get(ENV) or (str(STORED) if STORED.exists() else "")
    return _read(path) if path else Speed()


@dataclass(frozen=True)
class Terms:
    """Predicted seconds of a component (or a plan) split as a measurement can be set beside it."""

    compute: float = 0.0
    transfer_hidden: float = 0.0  # copies overlapped with compute (streams)
    transfer_exposed: float = 0.0  # copies the compute waited for
    fixed: float = 0.0  # per-forward and per-call overheads

    @property
    def seconds(self) -> float:
        return self.compute + self.transfer_exposed + self.fixed

    def __add__(self, other: Terms) -> Terms:
        return Terms(*(a + b for a, b in zip(self.astuple(), other.astuple(), strict=True)))

    def scaled(self, k: float) -> Terms:
        return Terms(*(a * k for a in self.astuple()))

    def astuple(self) -> tuple[float, float, float, float]:
        return (self.compute, self.transfer_hidden, self.transfer_exposed, self.fixed)

    def to_dict(self) -> dict:
        return {
            "compute": self.compute,
            "transfer_hidden": self.transfer_hidden,
            "transfer_exposed": self.transfer_exposed,
            "fixed": self.fixed,
            "seconds": self.seconds,
        }
