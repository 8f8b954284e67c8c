"""What this worker's device and host offer, measured at start (a second or two on a GPU).

Two readings of the device. The generic ones (`flops`: an 8192³ matmul; `bandwidth`: a 256 MiB pinned
copy) are what the fitted speed model (offload/speed.py) was fitted against, so the plans use them.
The model's own (`model`: a matmul of the denoiser's width over its tokens at the job's size, and
pinned copies of the sizes its offloaded groups move, a block and a leaf layer) are recorded beside
them, so that each GPU run adds the rows a fit on the model's own shapes needs (bench/fit_speed.py)."""

from __future__ import annotations

import statistics
import time

import torch

from fleetgen.offload.devices import ASSUMED_BANDWIDTH, ASSUMED_FLOPS, host_available_bytes

MAX_COPY = 1 << 30  # a copy probed at a group's size, at most this (a 5 GiB block would take a while)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _bandwidth(device: torch.device, size: int = 256 * 2**20) -> float:
    """Bytes/s of a pinned host→device copy of `size` bytes (4 timed after one warm-up)."""
    src = torch.empty(size, dtype=torch.uint8, pin_memory=device.type == "cuda")
    dst = torch.empty(size, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=True)  # warm up
    _sync(device)
    start = time.perf_counter()
    for _ in range(4):
        dst.copy_(src, non_blocking=True)
    _sync(device)
    return 4 * size / (time.perf_counter() - start)


def _flops(device: torch.device, dtype: torch.dtype, m: int = 8192, k: int = 8192, n: int = 8192) -> float:
    """Matmul FLOP/s at the run dtype, of (m × k) @ (k × n). Warmed up first: an idle GPU clocks low, and
    8 products of 4096³ (~1.5 ms on an H100) read as a fraction of its speed, differently per worker."""
    a = torch.randn(m, k, device=device, dtype=dtype)
    b = torch.randn(k, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    _sync(device)
    start = time.perf_counter()
    for _ in range(8):
        a @ b
    _sync(device)
    return 8 * 2 * m * k * n / (time.perf_counter() - start)


def model_shapes(profile, width: int, height: int, frames: int = 0) -> dict | None:
    """The shapes the model's own work runs at: `matmul` (tokens, width, width) of its largest denoiser
    (its image tokens at this size), `block` and `leaf` the bytes one offloaded group moves at block
    level (the median block) and at leaf level (the mean leaf layer); None without a denoiser."""
    denoisers = [c for c in profile.components.values() if c.per_step]
    if not denoisers:
        return None
    c = max(denoisers, key=lambda c: c.bytes)
    tokens = profile.image_tokens(width, height, frames)
    width_ = max(c.hidden, 1)
    return {
        "matmul": [tokens, width_, width_],
        "block": int(statistics.median(c.blocks)) if c.blocks else c.bytes,
        "leaf": (c.bytes - c.non_leaf) // max(c.leaves, 1),
    }


def probe(device: torch.device, dtype: torch.dtype, shapes: dict | None = None) -> dict:
    """Free/total device memory, available host RAM, host→device bandwidth, matmul FLOP/s; on CUDA with
    `shapes` (`model_shapes`) the same at the model's own shapes, under `model`."""
    out = {"host_available_bytes": host_available_bytes()}
    if device.type != "cuda":
        out.update(free_bytes=None, total_bytes=None, bandwidth=ASSUMED_BANDWIDTH, flops=ASSUMED_FLOPS, measured=False)
        return out
    free, total = torch.cuda.mem_get_info(device)
    out.update(
        free_bytes=free, total_bytes=total, bandwidth=_bandwidth(device), flops=_flops(device, dtype), measured=True
    )
    if shapes:
        out["model"] = measure_shapes(device, dtype, shapes)
    return out


def measure_shapes(device: torch.device, dtype: torch.dtype, shapes: dict) -> dict:
    """The device's rates at the model's own shapes (`model_shapes`): matmul FLOP/s, and pinned copy
    bytes/s at a block's and a leaf layer's size."""
    m, k, n = shapes["matmul"]
    return {
        "shapes": shapes,
        "flops": _flops(device, dtype, m, k, n),
        "block_bandwidth": _bandwidth(device, max(min(shapes["block"], MAX_COPY), 1)),
        "leaf_bandwidth": _bandwidth(device, max(min(shapes["leaf"], MAX_COPY), 1)),
    }
