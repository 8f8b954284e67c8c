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
    parts = split(prof)
    if parts is None:
        raise OffloadError("nothing to phase: the pipeline has no text encoder apart from its denoiser")
    encoders, rest = parts
    # the loading peak is the whole pipeline's, the same phased or not: the per-batch planner checks it
    work = replace(w, phases="off", loaded=True)
    # a component moves on and off the device each chunk: formats applied at load (bitsandbytes) are not offered
    device = replace(device, formats=tuple(f for f in device.formats if not spec(f).at_load))
    denoise = plan(prof.only(rest), device, work)

    def left(p: OffloadPlan) -> DeviceSpec:  # the host RAM phase 2's copies leave phase 1
        swapped = sum(prof.variant(n, p.formats.get(n, NONE)).bytes for n, m in p.modes.items() if m == "resident")
        return replace(device, host_budget=max(device.host_budget - p.host_bytes - swapped, 0))

    while True:  # phase 1 encodes each of phase 2's batches as it will be made (the same pixels)
        encode = plan(prof.only(encoders), left(denoise), replace(work, max_batch=denoise.batch_size))
        if encode.batch_size == denoise.batch_size:
            break
        denoise = plan(prof.only(rest), device, replace(work, max_batch=encode.batch_size))
    placements = {**encode.placements, **denoise.placements}
    formats = {**encode.formats, **denoise.formats}
    swapped = [n for n, p in placements.items() if p.mode == "resident"]
    for name in swapped:
        fmt = formats.get(name, NONE)
        if fmt != NONE and spec(fmt).at_load:
            raise OffloadError(f"{name} {fmt} would be resident in its phase: {fmt} weights are not moved between devices")
    swap = sum(prof.variant(n, formats.get(n, NONE)).bytes for n in swapped)
    held = encode.host_bytes + denoise.host_bytes + swap  # a swapped-out component's copy is in host RAM
    per_image = embed_bytes(prof, w)
    room = device.host_budget - held
    chunk = min(CHUNK_IMAGES, room // per_image if per_image else CHUNK_IMAGES)
    chunk -= chunk % denoise.batch_size
    if chunk < denoise.batch_size:
        raise OffloadError(
            f"host RAM binds: the phases' host copies ({format_size(held)}) leave no room for a batch's embeddings"
        )
    swap_seconds = 2 * swap / device.bandwidth / chunk  # on, and off again, once per chunk
    seconds = encode.seconds_per_image + denoise.seconds_per_image + swap_seconds
    moved = encode.moved_per_image + denoise.moved_per_image + swap // chunk
    from fleetgen.offload.planner import OffloadPlan

    return OffloadPlan(
        placements={n: placements[n] for n in prof.components},
        batch_size=denoise.batch_size,
        peak_bytes=max(encode.peak_bytes, denoise.peak_bytes),
        host_bytes=held + chunk * per_image,
        pinned_bytes=encode.pinned_bytes + denoise.pinned_bytes,
        moved_per_image=moved,
        seconds_per_image=seconds,
        relative_speed=_ideal(prof, device, w) / seconds,
        budget=device.budget,
        reason=_reason(encoders, encode, denoise, chunk, swapped, prof, formats),
        binds=tuple(dict.fromkeys(encode.binds + denoise.binds)),
        formats=formats,
        load_bytes=prof.total_bytes if not w.loaded else 0,
        cost_per_image=encode.cost_per_image + denoise.cost_per_image + swap_seconds,
        phases=(encoders, rest),
        chunk=chunk,
    )


def _reason(encoders, encode, denoise, chunk, swapped, prof, formats) -> str:
    def where(p) -> str:
        return "; ".join(f"{n} {'resident in its phase' if m == 'resident' else m}" for n, m in p.modes.items())

    moved = format_size(sum(prof.variant(n, formats.get(n, NONE)).bytes for n in swapped))
    return (
        f"phased: {', '.join(encoders)} once per {chunk} images ({where(encode)}), then the rest "
        f"({where(denoise)}); {moved} swapped per chunk; batch {denoise.batch_size}; {DECODE_IN_DENOISE}"
    )
