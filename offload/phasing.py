"""Phased plans: each part of the pipeline with the whole device in turn.

Per batch, one pipeline call runs the text encoders, the denoiser and the VAE, so all of them
share the device (or are moved again at every call). Phased, a worker takes a chunk of a shard's
images at a time: (1) the text encoders encode every batch's prompts, alone on the device, into
embeddings kept in host memory; (2) the denoiser and the VAE make the images from them, alone on
the device. Each phase is planned by the per-batch planner on its own components with the whole
device budget; a component resident in its phase is moved on at the phase's start and off at its
end — once per chunk, not per batch. Decoding stays in phase 2: the families' latent-to-image steps
are not called apart from the pipeline (`DECODE_IN_DENOISE`).

Pure, like the planner: no torch. The worker's side is workers/pipeline/phases.py.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from fleetgen.errors import OffloadError
from fleetgen.offload.cost import TEXT_TOKENS, DeviceSpec, Workload, _ideal
from fleetgen.offload.weight_formats import NONE, spec
from fleetgen.units import format_size

if TYPE_CHECKING:
    from fleetgen.offload.planner import OffloadPlan
    from fleetgen.offload.profiles import PipelineProfile

PHASES_CHOICES = ("auto", "on", "off")
ENCODER_PREFIX = "text_encoder"  # text_encoder, text_encoder_2, ... (HiDream has four)
CHUNK_IMAGES = 256  # images per chunk at most: what one swap of the components is spread over
# Hidden layers an encoder's embeddings concatenate (FLUX.2 dev: three of Mistral's, 3 x 5,120 = 15,360
# wide; klein: three of Qwen3's); else the last one.
EMBED_LAYERS = {"Mistral3ForConditionalGeneration": 3, "Qwen3ForCausalLM": 3}
DECODE_IN_DENOISE = "decode stays in phase 2 (the VAE beside the denoiser): the families' latent-to-image steps are not called apart from the pipeline"


def split(prof: PipelineProfile) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """(the text encoders, everything else) in the profile's order; None when there is nothing to split."""
    encoders = tuple(n for n in prof.components if n.startswith(ENCODER_PREFIX))
    rest = tuple(n for n in prof.components if n not in encoders)
    return (encoders, rest) if encoders and rest else None


def embed_bytes(prof: PipelineProfile, w: Workload) -> int:
    """Host bytes one image's embeddings take between the phases: each encoder's tokens x its width
    (x the layers it concatenates) at the run dtype, twice with a negative prompt."""
    per = sum(
        TEXT_TOKENS.get(c.cls, 77) * max(c.hidden, 1) * EMBED_LAYERS.get(c.cls, 1) * prof.dtype_bytes
        for n, c in prof.components.items()
        if n.startswith(ENCODER_PREFIX)
    )
    return per * (2 if w.cfg or w.cfg_calls else 1)


def phased_plan(prof: PipelineProfile, device: DeviceSpec, w: Workload, plan) -> OffloadPlan:
    """The fastest phased plan (`plan`: the per-batch planner, called on each phase's components);
    `OffloadError` when none fits. Its `phases` name each phase's components; `chunk` the images
    one swap is spread over."""
    from fleetgen.offload.planner import OffloadPlan

    parts = split(prof)
    if parts is None:
        raise OffloadError("nothing to phase: the pipeline has no text encoder apart from its denoiser")
    encoders, rest = parts
    if not w.loaded and prof.total_bytes > device.host_budget:  # formats applied at load are not phased
        raise OffloadError(f"Nothing loads (host RAM binds): {format_size(prof.total_bytes)} of weights")
    # The loading peak is the whole pipeline's, the same phased or not: the per-batch planner checks it.
    # A component moves on and off the device each chunk: formats applied at load (bitsandbytes) are not offered.
    work = replace(w, phases="off", loaded=True)
    device = replace(device, formats=tuple(f for f in device.formats if not spec(f).at_load))
    per_image, chunk = embed_bytes(prof, w), CHUNK_IMAGES
    while True:  # the swaps' cost is spread over the chunk, which the host RAM the plans leave bounds
        encode, denoise = _phase_plans(prof, encoders, rest, device, replace(work, swap_chunk=chunk), plan)
        placements = {**encode.placements, **denoise.placements}
        formats = {**encode.formats, **denoise.formats}
        swap = sum(prof.variant(n, formats.get(n, NONE)).bytes for n, p in placements.items() if p.mode == "resident")
        held = encode.host_bytes + denoise.host_bytes  # a swapped component's host copy counted in its phase's
        fits = min(CHUNK_IMAGES, (device.host_budget - held) // per_image if per_image else CHUNK_IMAGES)
        if fits < denoise.batch_size:
            raise OffloadError(
                f"host RAM binds: the phases' host copies ({format_size(held)}) leave no room for a batch's embeddings"
            )
        if fits >= chunk:
            break
        chunk = fits
    seconds = encode.seconds_per_image + denoise.seconds_per_image  # each phase's plan counts its swaps
    return OffloadPlan(
        placements={n: placements[n] for n in prof.components},
        batch_size=denoise.batch_size,
        peak_bytes=max(encode.peak_bytes, denoise.peak_bytes),
        host_bytes=held + chunk * per_image,
        pinned_bytes=encode.pinned_bytes + denoise.pinned_bytes,
        moved_per_image=encode.moved_per_image + denoise.moved_per_image,
        seconds_per_image=seconds,
        relative_speed=_ideal(prof, device, w) / seconds,
        budget=device.budget,
        reason=_reason(encoders, encode, denoise, chunk, swap),
        binds=tuple(dict.fromkeys(encode.binds + denoise.binds)),
        formats=formats,
        load_bytes=0 if w.loaded else prof.total_bytes,
        cost_per_image=encode.cost_per_image + denoise.cost_per_image,
        phases=(encoders, rest),
        chunk=chunk,
    )


def _phase_plans(prof, encoders, rest, device: DeviceSpec, work: Workload, plan):
    """(phase 1's plan, phase 2's), each with the whole device; phase 1 encodes each of phase 2's
    batches as it will be made (the same pixels), in the host RAM phase 2's copies leave."""
    denoise = plan(prof.only(rest), device, work)
    while True:
        left = replace(device, host_budget=max(device.host_budget - denoise.host_bytes, 0))
        encode = plan(prof.only(encoders), left, replace(work, max_batch=denoise.batch_size))
        if encode.batch_size == denoise.batch_size:
            return encode, denoise
        denoise = plan(prof.only(rest), device, replace(work, max_batch=encode.batch_size))


def _reason(encoders, encode, denoise, chunk: int, swap: int) -> str:
    def where(p) -> str:
        return ", ".join(f"{n} {'resident in its phase' if m == 'resident' else m}" for n, m in p.modes.items())

    # a quantized component's why first, as a per-batch plan says it (each phase's plan begins with it)
    lead = "".join(p.reason.split("; ")[0] + "; " for p in (encode, denoise) if p.formats)
    return lead + (
        f"phased: {', '.join(encoders)} once per {chunk} images ({where(encode)}), then the rest "
        f"({where(denoise)}); {format_size(swap)} swapped per chunk; {DECODE_IN_DENOISE}; phase 2: {denoise.reason}"
    )
