"""What actually moved: onloads, offloads and bytes per component, device peak, pinned host RAM, RSS.

Groups are found after applying, through the hook diffusers attaches to each grouped module
(`_diffusers_hook` → hook "group_offloading" → `.group`, a `ModuleGroup`). These names are not
exported by diffusers (0.42 pinned); tests fail loudly if they move. Counting uses plain torch
forward hooks on each group's onload and offload leaders: no patching of diffusers.
"""

from __future__ import annotations

import os
import resource

import torch


def _group_bytes(group) -> int:
    tensors = {id(t): t for m in group.modules for t in [*m.parameters(), *m.buffers()]}
    tensors.update({id(t): t for t in [*group.parameters, *group.buffers]})
    return sum(t.numel() * t.element_size() for t in tensors.values())


def find_groups(module: torch.nn.Module) -> list:
    """The `ModuleGroup`s diffusers created under `module`, once each."""
    groups = {}
    for sub in module.modules():
        registry = getattr(sub, "_diffusers_hook", None)
        hook = registry.get_hook("group_offloading") if registry is not None else None
        if hook is not None:
            groups[id(hook.group)] = hook.group
    return list(groups.values())


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class OffloadStats:
    """Counters per offloaded component; `snapshot()` for the worker's stats file."""

    def __init__(self, modules: dict[str, torch.nn.Module], device: torch.device):
        self.device = device
        self.counts: dict[str, dict] = {}
        self.handles = []
        for name, module in modules.items():
            groups = find_groups(module)
            if not groups:
                continue
            c = self.counts[name] = {"groups": len(groups), "onloads": 0, "offloads": 0, "bytes_onloaded": 0}
            for g in groups:
                size = _group_bytes(g)
                self.handles.append(g.onload_leader.register_forward_pre_hook(self._counter(c, "onloads", size)))
                self.handles.append(g.offload_leader.register_forward_hook(self._counter(c, "offloads", 0)))

    @staticmethod
    def _counter(c: dict, key: str, size: int):
        def hook(*_):
            c[key] += 1
            c["bytes_onloaded"] += size

        return hook

    def snapshot(self) -> dict:
        out = {
            "components": {k: dict(v) for k, v in self.counts.items()},
            "rss_bytes": rss_bytes(),
            "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        }
        if self.device.type == "cuda":
            out["peak_device_bytes"] = torch.cuda.max_memory_allocated(self.device)
            out["peak_device_reserved_bytes"] = torch.cuda.max_memory_reserved(self.device)
            host = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
            out["pinned_host_bytes"] = host.get("allocated_bytes.current", host.get("reserved_bytes.current"))
        return out

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
