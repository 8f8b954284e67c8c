"""What actually moved: onloads, offloads and bytes per component, device peak, pinned host RAM, RSS.

Groups are found after applying, through the hook diffusers attaches to each grouped module
(`_diffusers_hook` → hook "group_offloading" → `.group`, a `ModuleGroup`). These names are not
exported by diffusers (0.42 pinned); tests fail loudly if they move. Counting is a diffusers hook
on each group's onload and offload leaders, registered right after group offloading's own (no
patching of diffusers): hooks registered later wrap earlier ones, so a step cache applied after it
(workers/pipeline/caching.py) that skips a block skips its count with its onload, as it should.
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


def _allocator_counts(device: torch.device) -> dict[str, int]:
    """The CUDA caching allocator's running counts: retries after a failed allocation (its cache
    freed first), cudaMalloc and cudaFree calls. Empty off CUDA."""
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    keys = {"retries": "num_alloc_retries", "device_allocs": "num_device_alloc", "device_frees": "num_device_free"}
    return {k: int(stats.get(v, 0)) for k, v in keys.items()}


def _zero(groups: int = 0) -> dict:
    """A component's counts before anything moved (`groups`: its offload groups under the plan applied)."""
    return {"groups": groups, "onloads": 0, "offloads": 0, "bytes_onloaded": 0}


COUNTER_HOOK = "fleetgen_offload_counter"


def _counter(counts: dict, onload: int | None, offload: bool):
    """A diffusers hook counting a group's onload (`onload`: its bytes) before the module runs and
    its offload after; it runs exactly when the group offloading hook it wraps runs."""
    from diffusers.hooks import ModelHook

    class Counter(ModelHook):
        def pre_forward(self, module, *args, **kwargs):
            if onload is not None:
                counts["onloads"] += 1
                counts["bytes_onloaded"] += onload
            return args, kwargs

        def post_forward(self, module, output):
            if offload:
                counts["offloads"] += 1
            return output

    return Counter()


class OffloadStats:
    """Counters per offloaded component; `snapshot()` for the worker's stats file."""

    def __init__(self, modules: dict[str, torch.nn.Module], device: torch.device):
        from diffusers.hooks import HookRegistry

        self.device = device
        self.allocator_base = _allocator_counts(device)
        self.counts: dict[str, dict] = {}
        self.counted: list[torch.nn.Module] = []  # modules carrying a counter hook
        for name, module in modules.items():
            groups = find_groups(module)
            if not groups:
                continue
            c = self.counts[name] = _zero(len(groups))
            for g in groups:
                leaders = {id(g.onload_leader): g.onload_leader, id(g.offload_leader): g.offload_leader}
                for leader in leaders.values():
                    onload = _group_bytes(g) if leader is g.onload_leader else None
                    hook = _counter(c, onload, leader is g.offload_leader)
                    HookRegistry.check_if_exists_or_initialize(leader).register_hook(hook, COUNTER_HOOK)
                    self.counted.append(leader)

    def swapped(self, name: str, size: int) -> None:
        """A phased plan moved the whole of `name` (`size` bytes) onto the device for its phase."""
        c = self.counts.setdefault(name, _zero())
        c["onloads"] += 1
        c["bytes_onloaded"] += size
        c["swaps"] = c.get("swaps", 0) + 1

    def carry(self, old: OffloadStats | None) -> OffloadStats:
        """These stats with the counts of `old`, the ones they replace (a plan re-applied after an
        out-of-memory error): a worker's stats cover its whole run; `groups` is the new plan's."""
        if old is None:
            return self
        for name, c in old.counts.items():
            mine = self.counts.setdefault(name, _zero())
            for key in ("onloads", "offloads", "bytes_onloaded", "swaps"):
                if key in c:
                    mine[key] = mine.get(key, 0) + c[key]
        self.allocator_base = old.allocator_base
        return self

    def reset(self) -> None:
        """Counts from zero, the groups kept (after a worker's warm-up: its transfers are no image's).
        In place: the counter hooks hold these dicts."""
        for c in self.counts.values():
            c.update(onloads=0, offloads=0, bytes_onloaded=0)
            if "swaps" in c:
                c["swaps"] = 0
        self.allocator_base = _allocator_counts(self.device)

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
            # since the counts began: an allocator at its cap frees its cache and retries (cudaFree
            # synchronises the device, stalling the streams' prefetch)
            now = _allocator_counts(self.device)
            out["allocator"] = {k: now[k] - self.allocator_base.get(k, 0) for k in now}
        return out

    def close(self) -> None:
        from diffusers.hooks import HookRegistry

        for module in self.counted:
            HookRegistry.check_if_exists_or_initialize(module).remove_hook(COUNTER_HOOK, recurse=False)
        self.counted = []
