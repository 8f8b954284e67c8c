"""Step caches on a fitted pipeline's denoisers (workers/pipeline/caching.py): what they skip, what they
move under offloading, what each image records."""

import json

import numpy as np
import pyarrow as pa
import pytest
import torch

from fleetgen.caches import parse_cache
from fleetgen.errors import ConfigError
from fleetgen.jobs.config import JobConfig
from fleetgen.jobs.models import resolve_defaults
from fleetgen.jobs.sharding import read_footer, resolve_columns
from fleetgen.offload import OffloadPlan, OffloadStats, apply, pipeline_modules, profile_pipeline
from fleetgen.offload.cost import Placement
from fleetgen.workers.pipeline.caching import AppliedCache
from fleetgen.workers.rows.shard import Columns
from fleetgen.workers.spec import GenerationSettings
from fleetgen.workers.tiny.flux import build_tiny_flux
from tests.conftest import pixels, run_one_shard, write_prompts

STEPS = 12


FBC = "first-block:0.3"  # skips a few of 12 steps of the tiny FLUX.1 (random weights): measured below, not assumed


def _run(model, out, prompts, cache="none", **spec):
    settings = GenerationSettings(
        task="text-to-image", steps=STEPS, guidance=3.5, width=64, height=64, family="flux", cache=parse_cache(cache)
    )
    return run_one_shard(model, out, prompts, settings, **{"max_batch": 4, **spec})


def test_a_skipped_block_moves_no_bytes_only_when_the_cache_wraps_the_offloading():
    """Block-level offload, one block per group: every block evaluation the cache skips is one
    onload fewer — when the cache is applied after offloading. Applied before, the onload runs
    outside the cache's hook, and every skipped block is still copied."""
    onloads = {}
    for order in ("none", "after", "before"):
        pipe = build_tiny_flux(0, guidance_embeds=True)
        pipe.set_progress_bar_config(disable=True)
        prof = profile_pipeline(pipe)
        modules = pipeline_modules(pipe)
        spec, cache = parse_cache(FBC), None
        if order == "before":
            cache = AppliedCache(spec, {"transformer": pipe.transformer}, torch.float32, own_context=False)
        plan = OffloadPlan({"transformer": Placement("block", 1)}, batch_size=1)
        placed = apply(pipe, plan, prof, torch.device("cpu"))
        stats = OffloadStats(modules, torch.device("cpu"))
        if order == "after":
            cache = AppliedCache(spec, {"transformer": pipe.transformer}, torch.float32, own_context=False)
        pipe("a red fox", num_inference_steps=STEPS, guidance_scale=3.5, height=64, width=64, output_type="np")
        onloads[order] = stats.snapshot()["components"]["transformer"]["onloads"]
        skipped = cache.snapshot()["skipped"] if cache else 0
        if order != "none":
            assert skipped > 0, "the tiny model skipped nothing: raise the threshold of FBC"
            counted = skipped
        placed.close()
    assert onloads["none"] - onloads["after"] == counted  # each skipped block: one onload fewer
    assert onloads["before"] == onloads["none"]  # wrapped the other way round, every block still moves


def test_a_worker_records_the_cache_and_what_it_skipped(tiny_flux, tmp_path):
    prompts = write_prompts(tmp_path / "p.parquet", ["a red fox", "a blue owl", "a green frog"])
    plain, plain_rows = _run(tiny_flux, tmp_path / "plain", prompts)
    cached, rows = _run(tiny_flux, tmp_path / "cached", prompts, cache=FBC)
    again, again_rows = _run(tiny_flux, tmp_path / "again", prompts, cache=FBC)
    assert plain.batch_size == 4 and cached.batch_size == 1  # first-block decides per call: one image per call
    assert "batch 1 (the first-block cache: one image per call)" in cached.plan.reason
    info = json.loads((tmp_path / "cached" / "workers" / "w0.json").read_text())
    blocks = len(cached.pipe.transformer.transformer_blocks) + len(cached.pipe.transformer.single_transformer_blocks)
    assert info["cache"]["block_evaluations"] == 3 * STEPS * blocks
    assert 0 < info["cache"]["skipped"] < info["cache"]["block_evaluations"]
    assert info["cache"]["cache"] == FBC
    skipped = [r["cache_skipped"] for r in rows.values()]
    assert sum(s * STEPS * blocks for s in skipped) == pytest.approx(info["cache"]["skipped"])  # per image, the call's
    assert {r["cache"] for r in rows.values()} == {FBC} and {r["cache"] for r in plain_rows.values()} == {"none"}
    assert {r["cache_skipped"] for r in plain_rows.values()} == {None}
    changed = [
        k
        for k in rows
        if pixels(tmp_path / "cached", rows[k]).tolist() != pixels(tmp_path / "plain", plain_rows[k]).tolist()
    ]
    assert changed, "the cache skipped blocks but changed no image"
    assert {k: r["sha256"] for k, r in again_rows.items()} == {k: r["sha256"] for k, r in rows.items()}  # deterministic


def test_taylorseer_skips_exactly_the_steps_it_predicts(tiny_flux, tmp_path):
    prompts = write_prompts(tmp_path / "p.parquet", ["a red fox", "a blue owl"])
    spec = "taylorseer:interval=3,warmup=2,order=1"
    worker, rows = _run(tiny_flux, tmp_path / "ts", prompts, cache=spec)
    assert worker.batch_size == 4 and {r["batch"] for r in rows.values()} == {2}  # by the step: batches as ever
    share = parse_cache(spec).computed_share(STEPS)
    info = json.loads((tmp_path / "ts" / "workers" / "w0.json").read_text())
    assert info["cache"]["skipped_share"] == pytest.approx(1 - share)
    assert [r["cache_skipped"] for r in rows.values()] == pytest.approx([1 - share] * 2, rel=1e-6)


@pytest.mark.parametrize("family", ["flux2", "qwen-image", "hunyuanimage", "wan"])
def test_each_cacheable_family_runs_taylorseer_and_first_block_or_says_why(family):
    """The tiny pipeline of each family diffusers can cache, through `AppliedCache` as a worker
    applies it. A `FAILS` entry must still fail (when diffusers fixes it, this fails: remove it)."""
    from fleetgen.workers.families.table import FAMILIES
    from fleetgen.workers.pipeline.caching import FAILS, names_contexts
    from fleetgen.workers.tiny import TINY_FAMILIES

    for method in ("taylorseer:interval=2,warmup=1", "first-block:0.3"):
        pipe = TINY_FAMILIES[family](0)
        pipe.set_progress_bar_config(disable=True)
        spec = parse_cache(method)
        cache = AppliedCache(spec, {"transformer": pipe.transformer}, torch.float32, not names_contexts(type(pipe)))
        video = {"num_frames": 5} if FAMILIES[family].video else {}
        known = FAILS.get((spec.method, type(pipe.transformer).__name__))
        try:
            with cache.context():
                pipe(prompt="a red fox", num_inference_steps=4, height=64, width=64, output_type="np", **video)
        except TypeError:
            assert known, f"{family} {method} fails and FAILS does not say so"
            continue
        assert not known, f"{family} {method} runs now: remove its FAILS entry"
        counts = cache.snapshot()
        assert counts["block_evaluations"] > 0
        if spec.method == "taylorseer":  # steps 0, 2 computed; 1, 3 predicted
            assert counts["skipped_share"] == 0.5
        cache.close()
        assert not any(
            "fbc" in n or "taylorseer" in n or n == "fleetgen_block_count"
            for m in pipe.transformer.modules()
            for n in getattr(getattr(m, "_diffusers_hook", None), "hooks", {})
        )


def test_magcache_skips_whole_steps_by_the_published_ratios_whatever_the_batch(tiny_flux, tmp_path):
    """FLUX.1 [dev]'s magnitude ratios (diffusers' FLUX_MAG_RATIOS) decide which steps skip every
    block, by the step alone: the same share for every image, batches kept, and a batch's images the
    one-by-one images within rounding. Other transformers and a per-row `steps` column are refused."""
    prompts = write_prompts(tmp_path / "p.parquet", ["a red fox", "a blue owl"])
    batched, rows = _run(tiny_flux, tmp_path / "batched", prompts, cache="magcache:threshold=0.1")
    single, single_rows = _run(tiny_flux, tmp_path / "single", prompts, cache="magcache:threshold=0.1", max_batch=1)
    assert batched.batch_size == 4 and {r["batch"] for r in rows.values()} == {2}  # both rows in one call
    shares = {r["cache_skipped"] for r in rows.values()} | {r["cache_skipped"] for r in single_rows.values()}
    assert len(shares) == 1 and 0 < shares.pop() < 1  # whole steps skipped, the same ones for every image
    assert (
        max(
            np.abs(pixels(tmp_path / "batched", rows[k]) - pixels(tmp_path / "single", single_rows[k])).max()
            for k in rows
        )
        <= 2
    )
    assert {r["cache"] for r in rows.values()} == {parse_cache("magcache:threshold=0.1").label}  # as the job gave it
    from fleetgen.workers.pipeline.caching import pipeline_refusal

    assert "MagCache's magnitude ratios for FLUX.1 only, not QwenImageTransformer2DModel" in pipeline_refusal(
        "QwenImagePipeline", False, "magcache"
    )
    path = tmp_path / "steps.parquet"
    write_prompts(path, ["a"], steps=pa.array([4], pa.int32()))
    config = JobConfig.of(input=str(path), output="o", model=tiny_flux, cache="magcache")
    with pytest.raises(ConfigError, match="the input's `steps` column gives rows steps of their own"):
        resolve_defaults(config, resolve_columns([read_footer(str(path))], Columns.of(steps="steps")))
