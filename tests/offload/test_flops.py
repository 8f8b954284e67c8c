"""Denoiser FLOPs as torch's FLOP counter counts them (bench/flops.py), stored per architecture and
used by the cost model in place of the estimate."""

import pytest

from bench.flops import INPUTS, count, shape_of
from fleetgen.offload.flops import counted


def test_the_stored_counts_are_a_fresh_count(meta_build):
    """`architectures/flops.json` against torch's FlopCounterMode on the meta build now (FLUX.1's
    transformer at one side it was counted at, and at one the fit never saw)."""
    from fleetgen.jobs.planning import pipeline_profile

    module = meta_build("flux.1-dev")["transformer"]
    prof = pipeline_profile("flux.1-dev", "bfloat16", False, ())
    terms = counted(type(module).__name__, dict(module.config))
    assert terms is not None
    fixed, linear, quadratic = terms
    for side in (1024, 1280):  # one the counts were taken at, one they never saw
        shape = shape_of(prof, side, side)
        assert shape.tokens == (side // 16) ** 2
        tokens = shape.tokens
        assert fixed + linear * tokens + quadratic * tokens**2 == pytest.approx(count(module, shape), rel=1e-6)


def test_a_clip_is_counted_over_its_frames(meta_build):
    """Wan 2.2 TI2V-5B: counted at two frame counts and two sizes; a clip the fit never saw (1024x576,
    33 frames: 9 latent frames of 36x64 tokens) against a fresh count."""
    from fleetgen.jobs.planning import pipeline_profile

    module = meta_build("wan2.2-ti2v-5b")["transformer"]
    prof = pipeline_profile("wan2.2-ti2v-5b", "bfloat16", False, ())
    fixed, linear, quadratic = counted(type(module).__name__, dict(module.config))
    shape = shape_of(prof, 1024, 576, 33)
    assert (shape.frames, shape.tokens) == (9, 9 * 32 * 18)
    tokens = shape.tokens
    assert fixed + linear * tokens + quadratic * tokens**2 == pytest.approx(count(module, shape), rel=1e-6)


def test_the_cost_model_takes_the_count_where_there_is_one():
    """FLUX.1-dev at 1024²: 74.4 TFLOP counted a forward, where 2 x parameters x tokens plus attention
    estimates 109 (1.47x over); SDXL's UNet 6.8 (its levels weighted estimate 6.0); a denoiser whose class
    is not counted (HunyuanVideo 1.5's forward reads its inputs' values) keeps the estimate."""
    from fleetgen.jobs.planning import pipeline_profile
    from fleetgen.offload.cost import Workload, _flops

    profiles = {n: pipeline_profile(n, "bfloat16", False, ()) for n in ("flux.1-dev", "sdxl", "hunyuanvideo-1.5")}
    w = Workload(width=1024, height=1024)
    flux = profiles["flux.1-dev"]
    assert _flops(flux.components["transformer"], flux, w) == pytest.approx(74.38e12, rel=0.01)
    sdxl = profiles["sdxl"]
    assert _flops(sdxl.components["unet"], sdxl, w) == pytest.approx(6.76e12, rel=0.01)
    video = profiles["hunyuanvideo-1.5"]
    assert video.components["transformer"].cls not in INPUTS
    assert video.components["transformer"].flops_terms == ()


def test_a_checkpoint_of_another_config_is_not_taken_for_a_shipped_one(tiny_model):
    """The tiny SD's UNet has the class of SD 1.5's but not its config: no stored count, the estimate."""
    import torch

    from fleetgen.offload import profile_pipeline
    from fleetgen.workers.pipeline.load import load_pipeline

    prof = profile_pipeline(load_pipeline(tiny_model, torch.float32, False))
    assert prof.components["unet"].cls in INPUTS and prof.components["unet"].flops_terms == ()


def test_the_probe_reads_the_device_at_the_models_own_shapes():
    """FLUX.1 at 1024²: the matmul of its width (3072) over its 4096 image tokens, and copies of its
    median block and its mean leaf layer; timed here on the CPU as a GPU worker times them on its device
    (recorded beside the generic figures, for the next fit)."""
    import torch

    from fleetgen.jobs.planning import pipeline_profile
    from fleetgen.workers.pipeline.probe import measure_shapes, model_shapes

    prof = pipeline_profile("flux.1-dev", "bfloat16", False, ())
    shapes = model_shapes(prof, 1024, 1024)
    c = prof.components["transformer"]
    assert shapes["matmul"] == [4096, 3072, 3072]
    assert min(c.blocks) <= shapes["block"] <= max(c.blocks)
    assert 10 * 2**20 < shapes["leaf"] < shapes["block"] and shapes["leaf"] * c.leaves <= c.bytes
    assert model_shapes(prof.only(["vae"]), 1024, 1024) is None  # no denoiser: nothing of the model's to time
    measured = measure_shapes(
        torch.device("cpu"), torch.float32, {"matmul": [64, 32, 48], "block": 2**20, "leaf": 4096}
    )
    assert measured["flops"] > 0 and measured["block_bandwidth"] > 0 and measured["leaf_bandwidth"] > 0
