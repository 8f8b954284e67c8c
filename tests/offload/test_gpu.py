"""Offloading undone and re-applied (after an OOM, between budgets) leaves no hook behind and gives
the same images. On CPU here; the CUDA test (streams, whose prefetch and tracker hooks `_reapply`
once left in place) runs in `make gpu-check`."""

import pytest
import torch

from fleetgen.offload import OffloadPlan, Placement, apply, profile_pipeline
from fleetgen.offload.hooks import offload_hooks, unapply
from fleetgen.workers.tiny.flux import build_tiny_flux


def latents(pipe):
    return pipe(
        prompt=["a red fox"],
        num_inference_steps=2,
        width=32,
        height=32,
        max_sequence_length=32,
        generator=[torch.Generator().manual_seed(1)],
        output_type="latent",
    ).images


def reapplied(device: torch.device, placements: dict) -> None:
    pipe = build_tiny_flux()
    pipe.set_progress_bar_config(disable=True)
    profile = profile_pipeline(pipe)
    placed = apply(pipe, OffloadPlan({}, 1), profile, device)
    reference = latents(pipe).cpu()
    unapply(pipe, placed)
    placed = apply(pipe, OffloadPlan(placements, 1), profile, device)
    assert offload_hooks(pipe) > 0
    once = latents(pipe).cpu()
    unapply(pipe, placed)  # as the worker's step-down does, then the leaner plan again
    assert offload_hooks(pipe) == 0
    assert all(p.device.type == "cpu" for p in pipe.transformer.parameters())
    placed = apply(pipe, OffloadPlan(placements, 1), profile, device)
    again = latents(pipe).cpu()
    unapply(pipe, placed)
    assert offload_hooks(pipe) == 0
    assert torch.equal(reference, once) and torch.equal(once, again)


def test_offload_undone_and_reapplied_on_cpu():
    reapplied(torch.device("cpu"), {"transformer": Placement("block", 1), "text_encoder_2": Placement("leaf")})


@pytest.mark.gpu
def test_offload_with_streams_undone_and_reapplied_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    reapplied(
        torch.device("cuda"),
        {"transformer": Placement("block", 1, stream=True), "text_encoder_2": Placement("leaf", stream=True)},
    )
