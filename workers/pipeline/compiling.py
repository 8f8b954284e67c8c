"""`--compile`: torch.compile on a fitted pipeline's denoisers, regional where the model names its
repeated blocks (diffusers' `compile_repeated_blocks`: one block class is compiled once and every
block of it reuses the graph — the full-compile speed at a fraction of the compile time), the whole
denoiser otherwise. It keeps pixels (within rounding), so it is each worker's own setting.

Order (workers/pipeline/applied.py): offloading, then the step cache, then compilation, so that the compiled
region calls through both hooks — group offloading's onload and offload are `torch.compiler.disable`d
by diffusers and become graph breaks, a skipped block is still skipped. After an OOM step-down the
worker takes compilation off, re-applies offloading and the cache, and compiles again.

Compilation is lazy: graphs are made on the first call of each shape. `dynamic=True` gives one
graph for every batch size above 1 and every image size; dynamo specialises a dimension of size 1,
so batch 1 has a graph of its own. What was compiled, how long it took and how many graphs resulted
go into `workers/<w>.json`.
"""

from __future__ import annotations

import torch

DYNAMIC = True  # one graph across batch sizes (> 1) and image sizes, instead of one per shape
RECOMPILE_LIMIT_BASE = 8  # dynamo's default graphs per code object (batch 1, the rest, guards that move)


def is_compile_error(err: BaseException) -> bool:
    """Whether a call failed in compiling (dynamo or inductor: no C++ compiler, an unsupported op),
    not in the model: then the worker runs on uncompiled and says so."""
    from torch._dynamo.exc import TorchDynamoException

    return isinstance(err, TorchDynamoException) or type(err).__module__.startswith("torch._inductor")


def _dynamo_counts() -> dict[str, float]:
    """Process-wide dynamo counters: graphs made, graph breaks, seconds compiling."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    return {
        "graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(counters["graph_break"].values()),
        "seconds": sum(compilation_time_metrics.get("_compile.compile_inner", [])),
    }


def compiled_regions(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The submodules regional compilation compiles: those of the classes the model names in
    `_repeated_blocks` (empty: the model names none)."""
    names = set(getattr(module, "_repeated_blocks", None) or ())
    return [m for m in module.modules() if type(m).__name__ in names]


class AppliedCompile:
    """Compilation on `denoisers` ({component: module}); `carried`: the one it replaces after a
    re-apply, whose counts run on."""

    def __init__(self, denoisers: dict[str, torch.nn.Module], carried: AppliedCompile | None = None, adapters: int = 0):
        # Dynamo's caches are the process's: graphs of another pipeline in it, or of this one under the
        # hooks of its last plan, are not this compilation's (their guards would be checked on every call)
        torch._dynamo.reset()
        self.modes: dict[str, str] = {}  # component -> regional (N blocks) | whole
        # LoRA switches: dynamo makes a graph the first time an adapter, then a changed scale, reaches a
        # block (measured: at most 2 per adapter, tests/workers/pipeline/test_speed.py); past its recompile limit it
        # would run those blocks uncompiled without a word, so the limit covers the job's adapters.
        limit = torch._dynamo.config.recompile_limit
        torch._dynamo.config.recompile_limit = max(limit, RECOMPILE_LIMIT_BASE + 2 * adapters)
        self._compiled: list[torch.nn.Module] = []
        for name, module in denoisers.items():
            regions = compiled_regions(module)
            targets = regions or [module]
            for target in targets:
                target.compile(dynamic=DYNAMIC)
            self._compiled += targets
            self.modes[name] = f"regional ({len(regions)} blocks)" if regions else "whole"
        self.applies = (carried.applies if carried else 0) + 1
        self._base = carried._base if carried else _dynamo_counts()
        self.disabled: str | None = None  # why compilation was taken off on this worker (it failed here)

    def close(self) -> None:
        """Calls go to the eager modules again (the compiled code is dropped with them)."""
        for module in self._compiled:
            module._compiled_call_impl = None
        self._compiled = []

    def disable(self, why: str) -> None:
        self.close()
        self.disabled = why

    def snapshot(self) -> dict:
        now = _dynamo_counts()
        return {
            "modes": dict(self.modes),
            "compiled": self.applies,  # 1, plus one per re-apply after an OOM step-down
            "compile_seconds": round(now["seconds"] - self._base["seconds"], 3),
            "graphs": int(now["graphs"] - self._base["graphs"]),
            "graph_breaks": int(now["graph_breaks"] - self._base["graph_breaks"]),
            "disabled": self.disabled,
        }
