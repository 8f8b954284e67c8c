"""Step caches (`--cache`): which ones, their settings, and what they cost and save — plain data,
no torch, shared by the job's config (jobs/), the planner (offload/) and the worker that applies
them (workers/pipeline/caching.py).

A step cache reuses a denoiser's block outputs from earlier steps instead of computing them: it
changes pixels, so it is job-level (in the fingerprint, recorded per image). Two of diffusers'
hooks, each over the denoiser's repeated blocks:
- `first-block[:THRESHOLD]` (First Block Cache): the first block always runs; when its output
  changed less than THRESHOLD (relative mean absolute difference) since the last full step, the
  other blocks are skipped and their last residual reused. Data-dependent, and decided once per
  pipeline call over the whole batch — so its workers make one image per call, or an image's pixels
  would depend on the images batched with it (and batch sizes differ per worker).
- `taylorseer[:interval=N,warmup=W,order=K]` (TaylorSeer): every block runs for the first W steps,
  then once every N steps; in between each block's output is predicted from a Taylor series of
  order K over its last computed outputs. Decided by the step alone: batches are unaffected, and the
  share of computed steps is known before the job runs (`computed_share`).
- `magcache[:threshold=T,max_skip=K,retention=R]` (MagCache): after the first R of the steps, the
  whole denoiser is skipped (its last residual reused) while the error accumulated from the model's
  magnitude ratios — the published, per-checkpoint ratios of each step's residual norm to the
  last's — stays under T, at most K steps in a row. Decided by the step and the ratios alone, so
  batches are unaffected. diffusers publishes ratios for FLUX.1 [dev] only (`FLUX_MAG_RATIOS`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fleetgen.errors import ConfigError

NONE = "none"
METHODS = ("none", "first-block", "taylorseer", "magcache")
FIRST_BLOCK_THRESHOLD = 0.05  # diffusers' default (FirstBlockCacheConfig); ParaAttention's FLUX figures use 0.08-0.12
TAYLORSEER = {"interval": 5, "warmup": 3, "order": 1}  # diffusers' defaults (TaylorSeerCacheConfig)
MAGCACHE = {"threshold": 0.06, "max_skip": 3, "retention": 0.2}  # diffusers' defaults (MagCacheConfig)
# What a cache holds on the device, in tensors of the denoiser's hidden states (tokens x width, at the
# run dtype) per image and per cache context (the cond and uncond calls of true CFG keep one each).
# First Block Cache: the head block's output and residual, the tail's two residuals and the
# encoder states' pair: 5. TaylorSeer: order + 1 factors per block, each as large as the block's
# output (its text tokens, a few hundred beside thousands, not counted).
FIRST_BLOCK_TENSORS = 5
MAGCACHE_TENSORS = 3  # MagCache: the head block's input, the last residual, and the output built from them


@dataclass(frozen=True)
class CacheSpec:
    method: str = NONE  # none | first-block | taylorseer | magcache
    threshold: float = 0.0  # first-block: relative change of the first block's output below which the rest is
    #                         skipped; magcache: the accumulated error below which a step is skipped
    interval: int = 0  # taylorseer: steps between full computations
    warmup: int = 0  # taylorseer: steps computed in full before any prediction
    order: int = 0  # taylorseer: order of the Taylor series
    max_skip: int = 0  # magcache: most steps skipped in a row
    retention: float = 0.0  # magcache: share of the first steps never skipped

    @property
    def label(self) -> str:
        """The one spelling of this cache: the job's fingerprint and every image's record hold it."""
        if self.method == "first-block":
            return f"first-block:{self.threshold:g}"
        if self.method == "taylorseer":
            return f"taylorseer:interval={self.interval},warmup={self.warmup},order={self.order}"
        if self.method == "magcache":
            return f"magcache:threshold={self.threshold:g},max_skip={self.max_skip},retention={self.retention:g}"
        return NONE

    @property
    def per_call(self) -> bool:
        """Whether it decides over a whole pipeline call (its batch): then one image per call."""
        return self.method == "first-block"

    def computed_share(self, steps: int) -> float | None:
        """Share of the steps in which the blocks run, where the step alone decides (TaylorSeer, as
        diffusers' hook counts them); None where fleetgen cannot tell ahead (first-block: the data
        decides; magcache: the model's magnitude ratios, which diffusers holds)."""
        if self.method == NONE:
            return 1.0
        if self.method != "taylorseer":
            return None
        computed = sum(s < self.warmup or (s - self.warmup - 1) % self.interval == 0 for s in range(steps))
        return computed / max(steps, 1)

    def state_tensors(self, blocks: int) -> int:
        """Hidden-state-sized tensors it keeps per image and per cache context (see above)."""
        if self.method == "first-block":
            return FIRST_BLOCK_TENSORS
        if self.method == "taylorseer":
            return (self.order + 1) * blocks
        if self.method == "magcache":
            return MAGCACHE_TENSORS
        return 0


def parse_cache(value: str | CacheSpec | None) -> CacheSpec:
    """`none`, `first-block[:THRESHOLD]`, `taylorseer[:interval=N,warmup=W,order=K]` or
    `magcache[:threshold=T,max_skip=K,retention=R]`; a record is returned as it is."""
    if isinstance(value, CacheSpec):
        return value
    text = (value or NONE).strip().lower()
    method, _, args = text.partition(":")
    usage = (
        "`--cache` must be none, first-block[:THRESHOLD], taylorseer[:interval=N,warmup=W,order=K] or "
        "magcache[:threshold=T,max_skip=K,retention=R]"
    )
    if method == NONE and not args:
        return CacheSpec()
    if method == "first-block":
        raw = args.removeprefix("threshold=") if args else str(FIRST_BLOCK_THRESHOLD)
        try:
            threshold = float(raw)
        except ValueError:
            raise ConfigError(f"{usage}; got `{value}` (the threshold is a number, e.g. first-block:0.08).") from None
        if not (math.isfinite(threshold) and 0 < threshold <= 1):
            raise ConfigError(f"`--cache first-block` threshold must be more than 0 and at most 1, got `{raw}`.")
        return CacheSpec("first-block", threshold=threshold)
    if method == "taylorseer":
        given = dict(TAYLORSEER)
        for part in filter(None, args.split(",")):
            key, eq, raw = part.partition("=")
            if key not in given or not eq or not raw.isdigit():
                raise ConfigError(
                    f"{usage}; got `{value}` (taylorseer takes interval=, warmup= and order=, whole numbers)."
                )
            given[key] = int(raw)
        if given["interval"] < 1 or given["order"] < 1:
            raise ConfigError(f"`--cache taylorseer` interval and order must be 1 or more, got `{value}`.")
        return CacheSpec("taylorseer", interval=given["interval"], warmup=given["warmup"], order=given["order"])
    if method == "magcache":
        given: dict[str, float] = dict(MAGCACHE)
        for part in filter(None, args.split(",")):
            key, eq, raw = part.partition("=")
            try:
                number = float(raw) if key != "max_skip" else int(raw)
            except ValueError:
                number = None
            if key not in given or not eq or number is None or not math.isfinite(number):
                raise ConfigError(
                    f"{usage}; got `{value}` (magcache takes threshold= and retention=, numbers, and max_skip=, "
                    "a whole number)."
                )
            given[key] = number
        if not (given["threshold"] > 0 and given["max_skip"] >= 1 and 0 <= given["retention"] < 1):
            raise ConfigError(
                f"`--cache magcache` needs threshold > 0, max_skip >= 1 and 0 <= retention < 1, got `{value}`."
            )
        return CacheSpec(
            "magcache", threshold=given["threshold"], max_skip=int(given["max_skip"]), retention=given["retention"]
        )
    raise ConfigError(f"{usage}; got `{value}`.")
