"""Phased plans: each part of the pipeline with the whole device in turn.

Per batch, one pipeline call runs the text encoders, the denoiser and the VAE, so all of them
share the device (or are moved again at every call). Phased, a worker takes a chunk of a shard's
images at a time: (1) the text encoders encode every batch's prompts, alone on the device, into
embeddings kept in host memory; (2) the denoiser makes every batch's latents, kept in host memory;
(3) the VAE decodes them, alone on the device. Where a family's decode is not called apart from
its pipeline (`Workload.decode_apart` false: the family table's `decode_apart` says why), the VAE
decodes in phase 2 beside the denoiser. The job's scorers (`--score`, `DeviceSpec.beside`) score a chunk
after its decode phase, alone on the device (a phase of their own); without one they stay on the
device beside every phase. Each phase is planned by the per-batch planner on its own
components with the whole device budget; a component resident in its phase is moved on at the
phase's start and off at its end — once per chunk, not per batch.

Pure, like the planner: no torch. The worker's side is workers/pipeline/phases.py.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from fleetgen.errors import OffloadError
from fleetgen.offload.cost import MARGIN, TEXT_TOKENS, DeviceSpec, Workload, _ideal
from fleetgen.offload.weight_formats import NONE, spec
from fleetgen.units import format_size

if TYPE_CHECKING:
    from fleetgen.offload.planner import OffloadPlan
    from fleetgen.offload.profiles import PipelineProfile

PHASES_CHOICES = ("auto", "on", "off")
ENCODER_PREFIX = "text_encoder"  # text_encoder, text_encoder_2, ... (HiDream has four)
IMAGE_ENCODER = "image_encoder"  # Wan 2.1 image-to-video's CLIP: its call (`encode_image`) is phase 1's too
CHUNK_IMAGES = 256  # images per chunk at most: what one swap of the components is spread over
# Hidden layers an encoder's embeddings concatenate (FLUX.2 dev: three of Mistral's, 3 x 5,120 = 15,360
# wide; klein: three of Qwen3's); else the last one.
EMBED_LAYERS = {"Mistral3ForConditionalGeneration": 3, "Qwen3ForCausalLM": 3}
DECODER = "vae"


def split(prof: PipelineProfile, decode_apart: bool = False) -> tuple[tuple[str, ...], ...] | None:
    """The phases' components in the profile's order: (the text encoders, the rest) or, with
    `decode_apart`, (the text encoders, the rest, the VAE); None when there is nothing to split.
    An image encoder is phase 1's, beside the text encoders."""
    encoders = tuple(n for n in prof.components if n.startswith(ENCODER_PREFIX) or n == IMAGE_ENCODER)
    apart = decode_apart and DECODER in prof.components and len(prof.components) > len(encoders) + 1
    rest = tuple(n for n in prof.components if n not in encoders and not (apart and n == DECODER))
    if not encoders or not rest:
        return None
    return (encoders, rest, (DECODER,)) if apart else (encoders, rest)


def embed_bytes(prof: PipelineProfile, w: Workload) -> int:
    """Host bytes one image's embeddings take between the phases: each encoder's tokens x its width
    (x the layers it concatenates) at the run dtype, twice with a negative prompt."""
    per = sum(
        TEXT_TOKENS.get(c.cls, 77) * max(c.hidden, 1) * EMBED_LAYERS.get(c.cls, 1) * prof.dtype_bytes
        for n, c in prof.components.items()
        if n.startswith(ENCODER_PREFIX)
    )
    return per * (2 if w.cfg or w.cfg_calls else 1)


def input_bytes(w: Workload) -> int:
    """Host bytes one image's input pictures take while its chunk is made (RGB, at the image's size)."""
    return w.input_images * w.width * w.height * 3


def latent_bytes(prof: PipelineProfile, w: Workload) -> int:
    """Host bytes one image's (or clip's) latents take between denoising and decoding, at float32."""
    side = max(prof.vae_scale, 1)
    frames = 1 + (max(w.frames, 1) - 1) // max(prof.vae_temporal, 1)
    return prof.latent_channels * (w.width // side) * (w.height // side) * frames * 4


def phased_plan(prof: PipelineProfile, device: DeviceSpec, w: Workload, plan) -> OffloadPlan:
    """The fastest phased plan (`plan`: the per-batch planner, called on each phase's components);
    `OffloadError` when none fits. Its `phases` name each phase's components; `chunk` the images
    one swap is spread over."""
    from fleetgen.offload.planner import OffloadPlan

    parts = split(prof, w.decode_apart)
    if parts is None:
        raise OffloadError("nothing to phase: the pipeline has no text encoder apart from its denoiser")
    encoders, rest, *decoder = parts
    # formats applied at load are not phased; the node's shared copy is not this worker's to load
    own = sum(c.bytes for n, c in prof.components.items() if n not in device.shared)
    if not w.loaded and own > device.host_budget:
        raise OffloadError(f"Nothing loads (host RAM binds): {format_size(own)} of weights")
    # The loading peak is the whole pipeline's, the same phased or not: the per-batch planner checks it.
    # A component moves on and off the device each chunk: formats applied at load (bitsandbytes) are not offered.
    work = replace(w, phases="off", loaded=True)
    device = replace(device, formats=tuple(f for f in device.formats if not spec(f).at_load))
    per_image = embed_bytes(prof, w) + input_bytes(w) + (latent_bytes(prof, w) if decoder else 0)
    chunk = CHUNK_IMAGES
    while True:  # the swaps' cost is spread over the chunk, which the host RAM the plans leave bounds
        plans = _phase_plans(prof, parts, device, replace(work, swap_chunk=chunk), plan)
        denoise = plans[1]
        placements = {n: p for each in plans for n, p in each.placements.items()}
        formats = {n: f for each in plans for n, f in each.formats.items()}
        swap = sum(prof.variant(n, formats.get(n, NONE)).bytes for n, p in placements.items() if p.mode == "resident")
        held = sum(p.host_bytes for p in plans)  # a swapped component's host copy counted in its phase's
        fits = min(CHUNK_IMAGES, (device.host_budget - held) // per_image if per_image else CHUNK_IMAGES)
        if fits < denoise.batch_size:
            raise OffloadError(
                f"host RAM binds: the phases' host copies ({format_size(held)}) leave no room for a batch's embeddings"
            )
        if fits >= chunk:
            break
        chunk = fits
    # each phase's plan counts its swaps, and its calls' own costs; an image's own (its post-processing) is once
    repeated = (len(plans) - 1) * device.speed.image_seconds
    seconds = sum(p.seconds_per_image for p in plans) - repeated
    if decoder and device.beside:  # the scorers' phase: moved on after each chunk's decode, and off again
        if device.beside > device.budget * (1 - MARGIN):
            raise OffloadError(
                f"the scorers need {format_size(device.beside)} on the device, more than the "
                f"{format_size(device.budget * (1 - MARGIN))} usable of {format_size(device.budget)}"
            )
        seconds += 2 * device.beside / device.bandwidth / chunk
    return OffloadPlan(
        placements={n: placements[n] for n in prof.components},
        batch_size=denoise.batch_size,
        peak_bytes=max(p.peak_bytes for p in plans),
        host_bytes=held + chunk * per_image,
        pinned_bytes=sum(p.pinned_bytes for p in plans),
        moved_per_image=sum(p.moved_per_image for p in plans),
        seconds_per_image=seconds,
        relative_speed=_ideal(prof, device, w) / seconds,
        budget=device.budget,
        reason=_reason(encoders, plans, chunk, swap, w.input_images > 0, device.beside),
        binds=tuple(dict.fromkeys(b for p in plans for b in p.binds)),
        formats=formats,
        load_bytes=0 if w.loaded else prof.total_bytes,
        cost_per_image=sum(p.cost_per_image for p in plans) - repeated,
        phases=parts,
        chunk=chunk,
        terms=_merged([p.terms for p in plans], repeated),
    )


def _merged(each: list[dict], repeated: float) -> dict:
    """The phases' terms per image as one plan's: each component's from its phase, the calls' own summed
    less what `repeated` counts more than once (an image's own cost, in every phase's plan)."""
    from fleetgen.offload.speed import Terms

    out: dict = {}
    for terms in each:
        for name, t in terms.items():
            out[name] = out[name] + t if name in out else t
    if "pipeline" in out:
        out["pipeline"] = out["pipeline"] + Terms(fixed=-repeated)
    return out


def _phase_plans(prof, parts, device: DeviceSpec, work: Workload, plan) -> list:
    """Each phase's plan, with the whole device: phase 2's first, at its own fastest batch and at the
    largest batch it allows (a smaller batch faster for the denoiser alone may cost the encoders more
    calls): the cheaper whole."""
    first = _phase_plans_at(prof, parts, device, work, plan)
    found = [first]
    for batch, same in ((work.max_batch, False), (None, True), (work.max_batch, True)):
        if batch is not None and first[1].batch_size >= batch:
            continue
        try:
            found.append(_phase_plans_at(prof, parts, device, work, plan, batch, same))
        except OffloadError:
            continue
    return min(found, key=lambda plans: sum(p.cost_per_image for p in plans))


def _phase_plans_at(
    prof, parts, device: DeviceSpec, work: Workload, plan, batch: int | None = None, same: bool = False
) -> list:
    """Each phase's plan, with the whole device: phase 2's first (at `batch`, else its fastest); phases 1
    and 3 encode and decode each of phase 2's batches as it is made (the same pixels), in the host RAM the
    others' copies leave — at their own fastest batch up to phase 2's, or with `same` at phase 2's (where
    their fastest alone would hold phase 2 to a smaller batch)."""
    encoders, rest, *decoder = parts
    # The scorers (`DeviceSpec.beside`): with a decode phase, a phase of their own after it (the worker
    # moves the VAE off, then them on); else they stay on the device from their first score, beside each phase.
    alone = replace(device, beside=0)
    denoise = plan(prof.only(rest), alone if decoder else device, work, batch)
    while True:
        others, held = [], denoise.host_bytes
        for names in (encoders, *decoder):
            # with no decode phase the scorers stay on the device: beside every phase
            left = replace(alone if decoder else device, host_budget=max(device.host_budget - held, 0))
            at = denoise.batch_size if same else None
            others.append(plan(prof.only(names), left, replace(work, max_batch=denoise.batch_size), at))
            held += others[-1].host_bytes
        smallest = min(p.batch_size for p in others)
        if smallest == denoise.batch_size:
            return [others[0], denoise, *others[1:]]
        denoise = plan(prof.only(rest), alone if decoder else device, replace(work, max_batch=smallest))


def _reason(encoders, plans: list, chunk: int, swap: int, inputs: bool = False, scorers: int = 0) -> str:
    def where(p) -> str:
        return ", ".join(f"{n} {'resident in its phase' if m == 'resident' else m}" for n, m in p.modes.items())

    # a quantized component's why first, as a per-batch plan says it (each phase's plan begins with it)
    lead = "".join(p.reason.split("; ")[0] + "; " for p in plans if p.formats)
    decode = (
        f"then the VAE decodes ({where(plans[2])})"
        + (f", then the scorers ({format_size(scorers)}) alone on the device score the chunk" if scorers else "")
        if len(plans) > 2
        else "the VAE encoding the input images and decoding in phase 2"
        if inputs
        else "the VAE decoding in phase 2 (the family's decode is not called apart: its table's `decode_apart`)"
    )
    return lead + (
        f"phased: {', '.join(encoders)} once per {chunk} images ({where(plans[0])}), then the denoiser "
        f"({where(plans[1])}), {decode}; {format_size(swap)} swapped per chunk; phase 2: {plans[1].reason}"
        + (f"; phase 3: {plans[2].reason}" if len(plans) > 2 else "")
    )
