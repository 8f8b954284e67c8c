"""Denoiser FLOPs as torch's FLOP counter counts them (offload/flops.py), stored per architecture and
used by the cost model in place of the estimate."""

import pytest

from fleetgen.offload.flops import INPUTS, SIDES, count, counted


def test_the_stored_counts_are_a_fresh_count(meta_build):
    """`architectures/flops.json` against torch's FlopCounterMode on the meta build now (FLUX.1's
    transformer at the three sides, and at a fourth the fit never saw)."""
    module = meta_build("flux.1-dev")["transformer"]
    terms = counted(type(module).__name__, dict(module.config))
    assert terms is not None
    fixed, linear, quadratic = terms
    for side in (*SIDES, 1280):
        tokens = (side // 16) ** 2
        assert fixed + linear * tokens + quadratic * tokens**2 == pytest.approx(count(module, side), rel=1e-6)


def test_the_cost_model_takes_the_count_where_there_is_one():
    """FLUX.1-dev at 1024²: 74.4 TFLOP counted a forward, where 2 x parameters x tokens plus attention
    estimates 109 (1.47x over); SDXL's UNet 6.8 (its levels weighted estimate 6.0); a denoiser whose class
    is not counted keeps the estimate."""
    from fleetgen.jobs.planning import pipeline_profile
    from fleetgen.offload.cost import Workload, _flops

    profiles = {n: pipeline_profile(n, "bfloat16", False, ()) for n in ("flux.1-dev", "sdxl", "z-image-turbo")}
    w = Workload(width=1024, height=1024)
    flux = profiles["flux.1-dev"]
    assert _flops(flux.components["transformer"], flux, w) == pytest.approx(74.38e12, rel=0.01)
    sdxl = profiles["sdxl"]
    assert _flops(sdxl.components["unet"], sdxl, w) == pytest.approx(6.76e12, rel=0.01)
    z = profiles["z-image-turbo"]
    assert z.components["transformer"].cls not in INPUTS
    assert z.components["transformer"].flops_terms == ()


def test_a_checkpoint_of_another_config_is_not_taken_for_a_shipped_one(tiny_model):
    """The tiny SD's UNet has the class of SD 1.5's but not its config: no stored count, the estimate."""
    import torch

    from fleetgen.offload import profile_pipeline
    from fleetgen.workers.pipeline.load import load_pipeline

    prof = profile_pipeline(load_pipeline(tiny_model, torch.float32, False))
    assert prof.components["unet"].cls in INPUTS and prof.components["unet"].flops_terms == ()
