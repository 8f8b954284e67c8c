"""GPUs as they are, for `fleetgen plan --gpu NAME`: memory, dense bf16 throughput and host link,
from the vendors' datasheets, instead of one default for every card. Workers never use this table:
each measures its own device (workers/pipeline/probe.py).

The planner's figures are what a worker's probe would read (workers/pipeline/probe.py), not peaks:
- compute: `MATMUL_SHARE` × the dense bf16 peak, the rate of one large matmul (8192³ bf16 ran at
  769-798 TFLOP/s on the H100 and H200 machines fleetgen was checked on, of 989). What share of it a
  pipeline's own work achieves is the fitted speed model's (offload/speed.py, BENCHMARKS.md "The speed
  model fitted").
- host link: `LINK_EFFICIENCY` × the PCIe x16 rate per direction (gen4 31.5 GB/s, gen5 63 GB/s):
  a large pinned host-to-device copy reaches about 80 % of it (an assumption; workers measure their
  own link, and the speed model's `link` share is fitted on top of it).
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass

from fleetgen.errors import ConfigError

GIB = 1 << 30
# Assumed where nothing can be measured (CPU workers emulating a GPU budget, `fleetgen plan` without
# `--gpu`): the planner then compares plans by bytes moved, as a PCIe-4 GPU would see them.
ASSUMED_BANDWIDTH = 20e9  # bytes/s host→device
ASSUMED_FLOPS = 100e12  # FLOP/s
MATMUL_SHARE = 0.8
LINK_EFFICIENCY = 0.8
PCIE_GEN4 = 31.5  # GB/s per direction, x16
PCIE_GEN5 = 63.0


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_gib: int  # as sold (the planner keeps its own reserve of it)
    bf16_tflops: float  # dense (no sparsity) bf16 tensor peak
    link_gbps: float  # host→device, per direction
    source: str

    @property
    def memory(self) -> int:
        return self.memory_gib * GIB

    @property
    def flops(self) -> float:
        """FLOP/s of a large bf16 matmul, as a worker's probe would measure it."""
        return self.bf16_tflops * 1e12 * MATMUL_SHARE

    @property
    def bandwidth(self) -> float:
        """Effective host→device bytes/s the planner assumes."""
        return self.link_gbps * 1e9 * LINK_EFFICIENCY


GPUS = {
    g.name: g
    for g in (
        Gpu("H200", 141, 989.0, PCIE_GEN5, "NVIDIA H200 datasheet (SXM: 1,979 TFLOPS bf16 with sparsity)"),
        Gpu("H100", 80, 989.0, PCIE_GEN5, "NVIDIA H100 datasheet, SXM5 (1,979 TFLOPS bf16 with sparsity)"),
        Gpu("H100-PCIe", 80, 756.0, PCIE_GEN5, "NVIDIA H100 datasheet, PCIe (1,513 TFLOPS bf16 with sparsity)"),
        Gpu("A100-80GB", 80, 312.0, PCIE_GEN4, "NVIDIA A100 datasheet (624 TFLOPS bf16 with sparsity)"),
        Gpu("A100-40GB", 40, 312.0, PCIE_GEN4, "NVIDIA A100 datasheet (624 TFLOPS bf16 with sparsity)"),
        Gpu("L40S", 48, 362.0, PCIE_GEN4, "NVIDIA L40S datasheet (733 TFLOPS bf16 with sparsity)"),
        Gpu("L4", 24, 121.0, PCIE_GEN4, "NVIDIA L4 datasheet (242 TFLOPS bf16 with sparsity)"),
        Gpu("A10G", 24, 70.0, PCIE_GEN4, "AWS G5 / NVIDIA A10G: 70 TFLOPS bf16 tensor (the A10 has 125)"),
        Gpu("RTX-4090", 24, 165.2, PCIE_GEN4, "NVIDIA Ada whitepaper (bf16 with fp32 accumulate; 330 sparse)"),
        Gpu("RTX-5090", 32, 209.5, PCIE_GEN5, "NVIDIA Blackwell GeForce whitepaper (bf16, fp32 accumulate)"),
    )
}


def node_copy_refusal(loaded: int, largest: int, host: int) -> str | None:
    """Why the node's copy of the weights cannot be written beside a worker's own load (None: it can): the
    writer holds its load (`loaded` bytes, 0 where `host` is what is left after it) and, while it writes, the
    largest shared component once more, within `host` bytes of RAM. The planner (jobs/planning.py) and the
    writing worker (workers/pipeline/segment.py) both ask this."""
    if loaded + largest <= host:
        return None
    from fleetgen.units import format_size

    need = format_size(loaded + largest)
    if loaded:
        return f"writing the node's copy beside the first worker's load needs {need}, more than the node's {format_size(host)}"
    return (
        f"host RAM has {format_size(host)} available and writing the node's copy beside this worker's load needs {need}"
    )


def host_available_bytes() -> int:
    """This machine's available RAM (Linux: MemAvailable)."""
    with open("/proc/meminfo") as f:
        info = dict(line.split(":", 1) for line in f)
    return int(info["MemAvailable"].split()[0]) * 1024


def _key(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


_BY_KEY = {_key(n): g for n, g in GPUS.items()} | {"h100sxm": GPUS["H100"], "h200sxm": GPUS["H200"]}
_BY_KEY |= {"4090": GPUS["RTX-4090"], "5090": GPUS["RTX-5090"], "a100": GPUS["A100-80GB"]}


def gpu(name: str) -> Gpu:
    """The card `name` names (`H100`, `h100-sxm`, `RTX 4090`, `a100-40gb`, ...), or a `ConfigError`
    listing the table with the nearest names."""
    found = _BY_KEY.get(_key(name))
    if found is not None:
        return found
    near = difflib.get_close_matches(_key(name), list(_BY_KEY), n=3, cutoff=0.5)
    hint = f" Did you mean {', '.join(_BY_KEY[k].name for k in near)}?" if near else ""
    raise ConfigError(
        f"`--gpu {name}` is not a GPU fleetgen knows ({', '.join(GPUS)}).{hint} Pass `--gpu-memory` and "
        "`--bandwidth` for another card."
    )
