"""What this worker's device and host offer, measured at start (a second or two on a GPU)."""

from __future__ import annotations

import time

import torch

from fleetgen.offload.devices import ASSUMED_BANDWIDTH, ASSUMED_FLOPS, host_available_bytes


def _bandwidth(device: torch.device, size: int = 256 * 2**20) -> float:
    src = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(size, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=True)  # warm up
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(4):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize(device)
    return 4 * size / (time.perf_counter() - start)


def _flops(device: torch.device, dtype: torch.dtype, n: int = 8192) -> float:
    """Matmul FLOP/s at the run dtype. Warmed up first: an idle GPU clocks low, and 8 products of
    4096³ (~1.5 ms on an H100) read as a fraction of its speed, differently per worker."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(8):
        a @ b
    torch.cuda.synchronize(device)
    return 8 * 2 * n**3 / (time.perf_counter() - start)


def probe(device: torch.device, dtype: torch.dtype) -> dict:
    """Free/total device memory, available host RAM, host→device bandwidth, matmul FLOP/s."""
    out = {"host_available_bytes": host_available_bytes()}
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        out.update(
            free_bytes=free, total_bytes=total, bandwidth=_bandwidth(device), flops=_flops(device, dtype), measured=True
        )
    else:
        out.update(free_bytes=None, total_bytes=None, bandwidth=ASSUMED_BANDWIDTH, flops=ASSUMED_FLOPS, measured=False)
    return out
