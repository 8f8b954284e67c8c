"""A step cache on a fitted pipeline's denoisers (fleetgen/caches.py says which and what it does):
applied after offloading, so that a skipped block skips its onload too, and counted, so that each
image's record and the worker's stats say what share of block evaluations it skipped.

Hooks registered later wrap earlier ones (diffusers' HookRegistry): group offloading's hook and the
offload counter (offload/stats.py) sit under the cache's, so a block the cache skips is neither
onloaded nor counted as moved. Registered before offloading, the cache would run inside the onload
and every skipped block would still be copied to the device.
"""

from __future__ import annotations

import contextlib
import inspect
import typing

import torch

from fleetgen.caches import CacheSpec
from fleetgen.errors import OffloadError

COUNT_HOOK = "fleetgen_block_count"
# Denoisers on which a cache method of diffusers (0.42.1) fails, measured on the tiny pipelines
# (tests/workers/pipeline/test_caching.py runs each and fails when diffusers fixes it: then remove the entry).
FAILS = {
    ("first-block", "Flux2Transformer2DModel"): (
        "diffusers' First Block Cache fails on FLUX.2's blocks (TypeError: a list subtracted from a tensor in "
        "its head-block hook); taylorseer runs"
    )
}


# MagCache's magnitude ratios, per denoiser class, as diffusers publishes them (diffusers.hooks.mag_cache):
# FLUX.1 [dev]'s, measured at 28 steps and interpolated to the job's. FLUX.1 [schnell] and Kontext share
# the class; on them these ratios are [dev]'s, not their own (`fleetgen calibrate` measures the result).
MAG_RATIOS = {"FluxTransformer2DModel": "FLUX_MAG_RATIOS"}


def block_lists(module: torch.nn.Module) -> list[tuple[str, torch.nn.ModuleList]]:
    """The denoiser's repeated blocks, as diffusers' caches find them (its block identifiers)."""
    from diffusers.hooks._common import _ALL_TRANSFORMER_BLOCK_IDENTIFIERS

    return [
        (name, child)
        for name, child in module.named_children()
        if name in _ALL_TRANSFORMER_BLOCK_IDENTIFIERS and isinstance(child, torch.nn.ModuleList)
    ]


def names_contexts(pipeline_cls: type) -> bool:
    """Whether the pipeline's call names its denoiser calls' cache contexts ("cond", "uncond"), as
    diffusers' caches need: read from the installed diffusers, not a table of ours."""
    try:
        return "cache_context" in inspect.getsource(pipeline_cls.__call__)
    except (OSError, TypeError):
        return False


def cache_refusal(pipeline_cls: type, denoiser_cls: type, calls_twice: bool, method: str) -> str | None:
    """Why a step cache cannot run on this pipeline (None: it can). A pipeline that names no cache
    context gets one for its whole call from fleetgen, which is right only where the denoiser runs
    once per step (guidance distilled or in the batch); guidance as a second call needs the
    pipeline's own "cond" / "uncond" contexts, or both calls would share one cache."""
    from diffusers.models.cache_utils import CacheMixin

    if not issubclass(denoiser_cls, CacheMixin):
        return f"{denoiser_cls.__name__} takes no step cache in diffusers (only transformers with repeated blocks do)"
    if (method, denoiser_cls.__name__) in FAILS:
        return FAILS[method, denoiser_cls.__name__]
    if method == "magcache" and denoiser_cls.__name__ not in MAG_RATIOS:
        return (
            f"diffusers publishes MagCache's magnitude ratios for FLUX.1 only, not {denoiser_cls.__name__} "
            "(each checkpoint needs its own)"
        )
    if calls_twice and not names_contexts(pipeline_cls):
        return (
            f"{pipeline_cls.__name__} runs guidance as a second denoiser call without naming cache contexts, "
            "so both calls would share one cache"
        )
    return None


def _config(spec: CacheSpec, module: torch.nn.Module, dtype: torch.dtype, steps: int):
    from diffusers.hooks import FirstBlockCacheConfig, MagCacheConfig, TaylorSeerCacheConfig

    if spec.method == "first-block":
        return FirstBlockCacheConfig(threshold=spec.threshold)
    if spec.method == "magcache":
        from diffusers.hooks import mag_cache

        return MagCacheConfig(
            threshold=spec.threshold,
            max_skip_steps=spec.max_skip,
            retention_ratio=spec.retention,
            num_inference_steps=steps,  # the ratios are interpolated to them: one steps value per job
            mag_ratios=getattr(mag_cache, MAG_RATIOS[type(module).__name__]),
        )
    # TaylorSeer over whole blocks (diffusers' default hooks attention only, so every block's
    # feed-forward would still run and, offloaded, still move): a predicted step skips each block
    return TaylorSeerCacheConfig(
        cache_interval=spec.interval,
        disable_cache_before_step=spec.warmup,
        max_order=spec.order,
        taylor_factors_dtype=dtype,
        cache_identifiers=[rf"{name}\.\d+" for name, _ in block_lists(module)],
    )


class AppliedCache:
    """`spec` on `modules` (the denoisers); `take()` the share of block evaluations skipped since
    the last take, `snapshot()` the totals, `close()` removes every hook it added."""

    def __init__(
        self,
        spec: CacheSpec,
        modules: dict[str, torch.nn.Module],
        dtype: torch.dtype,
        own_context: bool,
        carried: AppliedCache | None = None,
        steps: int = 0,
    ):
        """`own_context`: the pipeline names no cache context (`context()` gives its call one);
        `carried`: the cache this one replaces after a re-plan, whose counts run on; `steps`: the
        job's (MagCache's ratios are interpolated to them)."""
        from diffusers.hooks import HookRegistry, ModelHook

        self.spec, self.modules, self.own_context = spec, modules, own_context
        self.asked = self.computed = 0  # block evaluations the denoiser made / that ran
        self._taken = (0, 0)
        if carried is not None:
            self.asked, self.computed, self._taken = carried.asked, carried.computed, carried._taken
        self._handles = []
        self._counted: list[torch.nn.Module] = []
        counts = self

        class Computed(ModelHook):  # under the cache's hook: runs only when the block does
            def pre_forward(self, module, *args, **kwargs):
                counts.computed += 1
                return args, kwargs

        def asked(*_):  # a torch pre-hook runs on every call of the block, skipped or not
            counts.asked += 1

        for name, module in modules.items():  # checked before any hook is added
            count = sum(len(blocks) for _, blocks in block_lists(module))
            if spec.method == "first-block" and count < 2:  # its head block and its tail block are two
                raise OffloadError(f"`--cache {spec.label}`: {name} has {count} repeated block(s); it needs 2 or more")
        for module in modules.values():
            for _, blocks in block_lists(module):
                for block in blocks:
                    HookRegistry.check_if_exists_or_initialize(block).register_hook(Computed(), COUNT_HOOK)
                    self._counted.append(block)
                    self._handles.append(block.register_forward_pre_hook(asked))
            module.enable_cache(_config(spec, module, dtype, steps))

    @contextlib.contextmanager
    def context(self):
        """Around one pipeline call: the one cache context of a pipeline that names none."""
        with contextlib.ExitStack() as stack:
            if self.own_context:
                for module in self.modules.values():
                    stack.enter_context(module.cache_context("fleetgen"))
            yield

    def take(self) -> float | None:
        """The share of block evaluations skipped since the last call (None: none were asked)."""
        asked, computed = self.asked - self._taken[0], self.computed - self._taken[1]
        self._taken = (self.asked, self.computed)
        return (asked - computed) / asked if asked else None

    def snapshot(self) -> dict:
        return {
            "cache": self.spec.label,
            "block_evaluations": self.asked,
            "skipped": self.asked - self.computed,
            "skipped_share": (self.asked - self.computed) / self.asked if self.asked else None,
        }

    def close(self) -> None:
        from diffusers.hooks import HookRegistry

        for module in self.modules.values():
            module.disable_cache()
        for block in self._counted:
            HookRegistry.check_if_exists_or_initialize(block).remove_hook(COUNT_HOOK, recurse=False)
        for handle in self._handles:
            handle.remove()
        self._counted, self._handles = [], []


def pipeline_refusal(pipeline: str, calls_twice: bool, method: str) -> str | None:
    """`cache_refusal` from a pipeline class's name alone (the driver, before any weight is read): its
    denoiser class is what its `__init__` is annotated with, in the installed diffusers."""
    import diffusers

    cls = getattr(diffusers, pipeline, None)
    if cls is None:
        return None  # not a diffusers pipeline (custom code): the worker checks the loaded one
    params = inspect.signature(cls.__init__).parameters
    denoiser = next((params[n].annotation for n in ("transformer", "unet") if n in params), None)
    if isinstance(denoiser, str):  # postponed annotations
        denoiser = getattr(diffusers, denoiser.strip("'\""), None)
    denoiser = next((t for t in typing.get_args(denoiser) if isinstance(t, type)), denoiser)  # `X | None`
    if not isinstance(denoiser, type):
        return f"{pipeline} has no denoiser diffusers' step caches know"
    return cache_refusal(cls, denoiser, calls_twice, method)


def cacheable_families(method: str) -> list[str]:
    """The families of the table whose every task's pipeline takes `method` at their default guidance."""
    from fleetgen.workers.families.table import FAMILIES

    return [
        name
        for name, f in FAMILIES.items()
        if f.tasks
        and all(pipeline_refusal(t.pipeline, f.extra_calls(f.guidance, None), method) is None for t in f.tasks)
    ]
