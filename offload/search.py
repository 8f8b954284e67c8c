"""The planner's search: the combinations of per-component options worth comparing, without the
exhaustive product (offload/planner.py scores them)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fleetgen.offload.cost import _Option


def _combos(
    tables: list[list[_Option]], limit: float, host_budget: float, bound: float, dims: int = 5
) -> list[tuple[_Option, ...]]:
    """The combinations of one option per component worth comparing, in `itertools.product` order:
    none another beats on every one of the first `dims` counts (device bytes held throughout, the
    largest phase, host bytes, cost — seconds plus what quantizing costs — and host bytes while
    loading), and none that already breaks a limit: device bytes held plus the largest phase over
    `limit`, host bytes (steady or loading) over `host_budget`, cost over `bound`. Built one component at a time, dropping such partial combinations as it goes: each count only grows
    as components are added (the phase is a maximum), so a dropped one could never end better.
    HiDream's six components are 154 k products at one batch size; what is left is a few hundred."""
    partial: list[tuple[tuple[_Option, ...], tuple]] = [((), (0, 0, 0, 0.0, 0, 0, 0, 0))]
    for options in tables:
        grown = []
        for combo, (resident, phase, host, cost, load, quantized, moved, off) in partial:
            for o in options:
                counts = (
                    resident + o.resident,
                    max(phase, o.phase),
                    host + o.host,
                    cost + o.cost,
                    load + o.load,
                    quantized + o.quantized,
                    moved + o.moved,
                    off + (o.placement.mode != "resident"),
                )
                if (
                    counts[0] + counts[1] > limit
                    or counts[2] > host_budget
                    or counts[3] > bound
                    or counts[4] > host_budget
                ):
                    continue
                grown.append((combo + (o,), counts))
        if not grown:
            return []
        partial = _frontier(grown, dims)
    return [combo for combo, _ in partial]


def _frontier(items: list[tuple[tuple, tuple]], dims: int = 5) -> list[tuple[tuple, tuple]]:
    """The items no other item dominates on the first `dims` counts (device bytes held throughout,
    the largest phase, host bytes, seconds, loading bytes, components quantized: what decides a
    plan), in their order; of items equal on those, the one first by bytes moved, components
    offloaded, then position (the plan's tie-breaks). Vectorised: six components' frontier can be thousands of items."""
    import numpy as np

    counts = np.array([c for _, c in items], dtype=np.float64)
    order = np.lexsort((np.arange(len(items)), *counts.T[::-1]))  # by every count, then position
    kept = np.zeros(len(items), dtype=bool)
    frontier = np.empty((len(items), dims))
    n = 0
    for i in order:
        if n and (frontier[:n] <= counts[i, :dims]).all(axis=1).any():
            continue  # another item is as good on every count (and first on the tie-breaks)
        frontier[n] = counts[i, :dims]
        n += 1
        kept[i] = True
    return [item for item, keep in zip(items, kept, strict=True) if keep]
