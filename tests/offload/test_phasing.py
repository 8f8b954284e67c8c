"""Phased plans (offload/phasing.py) on the shipped architectures' stored profiles: where `auto` picks
phased it is predicted cheaper than per batch, more memory never predicts slower, every plan is
quick, and the host RAM a chunk's embeddings take bounds the chunk."""

import time
from dataclasses import replace

import pytest

from fleetgen.errors import OffloadError
from fleetgen.jobs.planning import pipeline_profile, plan_workload
from fleetgen.offload import DeviceSpec, plan
from fleetgen.offload.architectures import NAMES
from fleetgen.offload.devices import gpu
from fleetgen.offload.phasing import CHUNK_IMAGES, embed_bytes, phased_plan
from fleetgen.offload.planner import (
    TIE,  # plans within it compare as equal: the tie goes to fewer bytes moved
    per_batch_plan,
)
from fleetgen.offload.profiles import DTYPE_BYTES

GIB = 1 << 30
BUDGETS = (12, 16, 24, 48, 80)
CARDS = ("H100", "RTX-4090")


def _case(arch: str):
    work, family = plan_workload(arch, max_batch=4)
    dtype = family.dtype if family.dtype in DTYPE_BYTES else "bfloat16"
    return pipeline_profile(arch, dtype, family.upcasts_vae, ()), work


def _device(card: str, gib: int, host_gib: int = 128) -> DeviceSpec:
    g = gpu(card)
    return DeviceSpec(budget=gib * GIB, host_budget=host_gib * GIB, bandwidth=g.bandwidth, flops=g.flops)


@pytest.mark.parametrize("arch", NAMES)
def test_phased_where_picked_is_predicted_cheaper_and_more_memory_never_predicts_slower(arch):
    prof, work = _case(arch)
    for card in CARDS:
        last = None
        for gib in BUDGETS:
            device = _device(card, gib)
            started = time.perf_counter()
            try:
                chosen = plan(prof, device, work)
            except OffloadError:
                assert last is None, (arch, card, gib)
                continue
            assert time.perf_counter() - started < 1.0, (arch, card, gib)  # every architecture plans in under 1 s
            if chosen.phases:
                try:
                    per_batch = per_batch_plan(prof, device, work)
                except OffloadError:
                    per_batch = None  # phased fits where per batch nothing does
                assert per_batch is None or chosen.cost_per_image < per_batch.cost_per_image, (arch, card, gib)
                assert chosen.peak_bytes <= device.budget * 0.9 and chosen.host_bytes <= device.host_budget
                assert "phased:" in chosen.reason and "per batch" in chosen.reason
            if last is not None:
                assert chosen.seconds_per_image <= last.seconds_per_image * (1 + TIE), (arch, card, gib)
            last = chosen


def test_klein_at_12_gib_is_phased_and_moves_less_than_per_batch():
    """The issue's case: FLUX.2 klein 4B on a 12 GiB card keeps its text encoder beside the transformer per
    batch; phased, the text encoder leaves the device before the transformer needs it."""
    prof, work = _case("flux.2-klein-4b")
    device = _device("RTX-4090", 12, host_gib=64)
    chosen, per_batch = plan(prof, device, work), per_batch_plan(prof, device, work)
    assert chosen.phases == (("text_encoder",), ("transformer",), ("vae",))  # klein decodes apart
    assert chosen.moved_per_image < per_batch.moved_per_image
    assert chosen.seconds_per_image < per_batch.seconds_per_image
    assert plan(prof, device, replace(work, phases="off")) == per_batch


def test_the_embeddings_bound_the_chunk():
    """FLUX.2 dev's Mistral embeddings: 512 tokens x 3 layers x 5,120 x 2 bytes, 15.7 MB a prompt; a
    host with little room left after the copies takes fewer per chunk."""
    prof, work = _case("flux.2-dev")
    assert embed_bytes(prof, work) == 512 * 3 * 5120 * 2
    roomy = plan(prof, _device("H200", 141, host_gib=512), replace(work, phases="on"))
    assert roomy.chunk == CHUNK_IMAGES
    tight_host = (roomy.host_bytes - CHUNK_IMAGES * embed_bytes(prof, work) + 40 * embed_bytes(prof, work)) / GIB
    tight = plan(prof, DeviceSpec(budget=141 * GIB, host_budget=int(tight_host * GIB)), replace(work, phases="on"))
    assert 0 < tight.chunk < CHUNK_IMAGES and tight.host_bytes <= tight_host * GIB


def test_off_never_phases_and_on_phases_wherever_it_fits():
    prof, work = _case("z-image-turbo")
    device = _device("RTX-4090", 16, host_gib=64)
    assert not plan(prof, device, replace(work, phases="off")).phases
    assert plan(prof, device, replace(work, phases="on")).phases
    with pytest.raises(OffloadError, match="--phases"):
        plan(prof, device, replace(work, phases="sometimes"))


def test_an_edit_is_phased_with_the_vae_encoding_and_decoding_beside_the_denoiser():
    """FLUX.2 klein edits from two references at 12 GiB: the text encoder in a phase of its own; the VAE,
    which encodes the references as the call makes its latents, with the transformer; each image's
    input pictures held in host memory for the chunk beside its embeddings."""
    from fleetgen.offload.phasing import input_bytes

    prof, _ = _case("flux.2-klein-4b")
    edit, _ = plan_workload("flux.2-klein-4b", task="edit", references=2, max_batch=4)
    assert edit.input_images == 2 and not edit.decode_apart
    chosen = plan(prof, _device("RTX-4090", 12, host_gib=64), replace(edit, phases="on"))
    assert chosen.phases == (("text_encoder",), ("transformer", "vae"))
    assert "the VAE encoding the input images and decoding in phase 2" in chosen.reason
    assert input_bytes(edit) == 2 * 1024 * 1024 * 3
    assert chosen.host_bytes > chosen.chunk * (embed_bytes(prof, edit) + input_bytes(edit))  # and the host copies


def test_scorers_are_a_phase_of_their_own_after_a_decode_phase_else_beside_every_phase():
    """`DeviceSpec.beside` (the job's scorers): with a decode phase no phase gives up room for them; without
    one (an edit: the VAE decodes in phase 2) they stay on the device, so every phase fits beside them."""
    scorers = 3 * GIB
    prof, work = _case("flux.2-klein-4b")
    device = _device("RTX-4090", 12, host_gib=64)
    alone = plan(prof, device, replace(work, phases="on"))
    scored = plan(prof, replace(device, beside=scorers), replace(work, phases="on"))
    assert len(scored.phases) == 3 and scored.batch_size == alone.batch_size and scored.peak_bytes == alone.peak_bytes
    assert "then the scorers (3.0 GiB) alone on the device score the chunk" in scored.reason
    edit, _ = plan_workload("flux.2-klein-4b", task="edit", references=2, max_batch=4)
    beside = plan(prof, replace(device, beside=scorers), replace(edit, phases="on"))
    assert len(beside.phases) == 2 and beside.peak_bytes <= (device.budget - scorers) * 0.9
    # scorers larger than the card: refused, as a phase that does not fit
    with pytest.raises(OffloadError, match="the scorers need 12.0 GiB on the device"):
        phased_plan(prof, replace(device, beside=12 * GIB), work, per_batch_plan)
