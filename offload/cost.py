"""The planner's cost model: what each component costs in each format and placement, at each
batch size — device bytes held throughout and while it runs, host bytes (steady and while loading),
seconds per pipeline call (compute at the device's FLOP/s plus transfers at its bandwidth, overlapped
when streams prefetch), bytes moved — as `_Option`s the search (offload/search.py) combines and the
planner (offload/planner.py) chooses among. Every offloaded weight moves once per forward, whatever
the grouping; grouping changes the device floor and the number of transfers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from fleetgen.caches import CacheSpec
from fleetgen.offload.speed import FP32_SLOWDOWN, Speed, Terms, fitted, kind
from fleetgen.offload.weight_formats import CHOOSABLE, NONE, QuantizeSpec, allowed, refusal, spec

if TYPE_CHECKING:  # the profile measures torch modules; the cost model reads its numbers only
    from fleetgen.offload.profile import ComponentProfile, PipelineProfile

MARGIN = 0.10  # of the budget: allocator fragmentation, CUDA context, workspace
# Activation estimates, bytes per image = tokens × width × dtype bytes × factor. Calibrated on
# published peaks (SDXL UNet and FLUX transformer at 1024², 2-4 GB; SD VAE decode at 1024², ~3 GB);
# they are estimates: the measured peak is in each worker's stats.
ACT_FACTOR = 64
VAE_ACT_FACTOR = 12
# A clip's denoiser holds tens of thousands of tokens (Wan at 1280x720, 81 frames: 75,600), where
# memory-efficient attention keeps no tokens x tokens matrix: per token the hidden states, q, k, v,
# the attention output and the feed-forward's intermediate (2.7x the width) twice, about 12 widths.
# An estimate from the layer's shapes, to calibrate on a GPU (bench/gpu_check.py's Wan case).
VIDEO_ACT_FACTOR = 12
# Tokens a text encoder reads per prompt (the families' `max_sequence_length`); else 77 (CLIP).
TEXT_TOKENS = {
    "T5EncoderModel": 512,
    "UMT5EncoderModel": 512,
    "Mistral3ForConditionalGeneration": 512,  # FLUX.2 dev
    "Qwen3ForCausalLM": 512,  # FLUX.2 klein
    "Qwen3Model": 512,  # Z-Image
    "Qwen2_5_VLForConditionalGeneration": 1024,  # Qwen-Image (512 + its template), HunyuanImage (1000)
    "Qwen2_5_VLTextModel": 1024,  # HunyuanVideo 1.5 (its text model alone)
    "LlamaForCausalLM": 128,  # HiDream
    "Gemma2Model": 300,  # Sana
}
# What a quantized component costs the plan's choice beyond its predicted seconds, as a share of the
# pipeline's time all resident at batch 1 (a fixed measure, whatever the budget): under `auto` a
# format must buy at least this much predicted speed to change the pixels. Added to the time, so
# the search still compares one number per plan ("cost"): more memory never predicts a higher cost,
# and `auto` never predicts slower than `none` (its cost is at most none's, which is its seconds).
QUANTIZED_SHARE = 0.05


@dataclass(frozen=True)
class DeviceSpec:
    """What a plan is fitted to. Bandwidth and FLOP/s are measured by the worker's probe (a large
    pinned copy, a large matmul); `speed` says what share of them a pipeline's work achieves
    (offload/speed.py, fitted to measured rows)."""

    budget: int  # device bytes the plan may use
    host_budget: int  # host RAM bytes for offloaded copies (pageable and pinned)
    bandwidth: float = 20e9  # host→device bytes/s of a large pinned copy
    flops: float = 100e12  # FLOP/s of a large matmul at the run dtype
    streams: bool = True  # CUDA streams can overlap transfers with compute
    disk_bandwidth: float = 2e9  # bytes/s reading offloaded groups back from local disk
    name: str = ""
    formats: tuple[str, ...] = CHOOSABLE  # storage formats it can run (`--quantize auto` chooses among them)
    # device bytes the job's scorers (`--score`) hold once on the device: off the whole budget of a per-batch
    # plan; a phase of their own after a phased plan's decode phase, else off every phase's (offload/phasing.py)
    beside: int = 0
    speed: Speed = field(default_factory=fitted)  # the fitted speed model (offload/speed.py)
    # components whose host copy is the node's (`--host-copy node`, workers/pipeline/host_copy.py): counted
    # once per node, not in `host_budget`; streamed, pinned in place (no private, rounded-up pinned copy)
    shared: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Workload:
    width: int = 1024
    height: int = 1024
    steps: int = 30
    cfg: bool = True  # the denoiser runs on a doubled batch (classifier-free guidance; not guidance-distilled Flux)
    max_batch: int = 8
    offload: str = "auto"  # auto | none | block | leaf | disk: which placements may be used
    quantize: QuantizeSpec = QuantizeSpec()  # which storage formats may be used (`--quantize`)
    fixed: tuple[tuple[str, str], ...] = ()  # (component, format) already applied to live modules
    loaded: bool = False  # planned after loading (a worker): the loading peak is past, not planned
    input_images: int = 0  # input images per image (image-to-image, inpaint, edit): the VAE encodes each
    in_sequence: bool = False  # their latent tokens join the denoiser's sequence (Kontext, Qwen-Image-Edit, FLUX.2)
    frames: int = 0  # video: frames per clip (0: an image); "per image" below is then per clip
    # denoiser calls of their own per step beyond the first: guidance as a second call (Qwen-Image,
    # Chroma, Wan: 1), LTX-2's spatio-temporal-guidance and modality passes (2): each adds a call's
    # compute, not activations (a batch doubled by guidance is `cfg`'s)
    cfg_calls: int = 0
    cache: CacheSpec = (
        CacheSpec()
    )  # the job's step cache (fleetgen/caches.py): its state is device memory, its skips saved time
    # whether the text encoders run in a phase of their own, a chunk of prompts at a time (offload/phasing.py):
    # auto (where predicted faster) | on (wherever the family can) | off (the whole pipeline per call)
    phases: str = "auto"
    # a phase's plan (offload/phasing.py): a resident component moves on and off once per this many images
    swap_chunk: int = 0
    # phased: the VAE decodes in a phase of its own (the family's decode is called apart from the pipeline)
    decode_apart: bool = False


_LABEL = re.compile(
    r"(?P<mode>resident|leaf_level|block_level\((?P<k>[1-9]\d*)\))(?P<a>\+stream|\+disk)?(?P<b>\+stream|\+disk)?"
)


@dataclass(frozen=True)
class Placement:
    """Where one component lives. The planner offers disk only at block level: leaf level + disk
    corrupts tied weights (docs/fitting.md, "Refused before any work")."""

    mode: str  # resident | block | leaf
    blocks_per_group: int = 1  # block level only
    stream: bool = False  # prefetch the next group on a CUDA side stream (pins a host copy)
    disk: bool = False  # offloaded groups live in files, not host RAM

    @classmethod
    def parse(cls, label: str) -> Placement:
        """A placement as plans and worker records spell it: `resident`, `leaf_level+stream`,
        `block_level(4)`, `block_level(1)+disk`, ...; `ValueError` naming the spellings otherwise."""
        m = _LABEL.fullmatch(label.strip())
        if m is None:
            raise ValueError(
                f"`{label}` is not a placement: resident, leaf_level, block_level(N), each but resident "
                "optionally with +stream or +disk"
            )
        mode = "resident" if m["mode"] == "resident" else "leaf" if m["mode"] == "leaf_level" else "block"
        extras = set(filter(None, (m["a"], m["b"])))
        if mode == "resident" and extras:
            raise ValueError(f"`{label}`: a resident component is neither streamed nor on disk")
        return cls(mode, int(m["k"] or 1), "+stream" in extras, "+disk" in extras)

    @property
    def label(self) -> str:
        if self.mode == "resident":
            return "resident"
        base = f"block_level({self.blocks_per_group})" if self.mode == "block" else "leaf_level"
        return base + ("+stream" if self.stream else "") + ("+disk" if self.disk else "")


def _candidates(c: ComponentProfile, device: DeviceSpec, offload: str) -> list[Placement]:
    """`auto` chooses per component among all placements; `none` keeps everything resident;
    `block`, `leaf` and `disk` put every component in that mode (as diffusers' pipeline-level
    `enable_group_offload` would), leaving the planner the variant and the batch size. Placements
    the component's storage format refuses (offload/quantize.py's table) are left out."""
    if c.fmt != NONE:
        return [
            p
            for p in _candidates(replace(c, fmt=NONE), device, offload)
            if not refusal(c.fmt, p.mode, p.stream, p.disk)
        ]
    if offload == "none":
        return [Placement("resident")]
    block = [Placement("block", k) for k in (1, 2, 4) if k == 1 or k <= len(c.blocks)]
    leaf = [Placement("leaf")]
    # A component the pipeline upcasts is never streamed: onload copies its pinned float16 copy,
    # whatever `.to(float32)` did, and float32 inputs meet float16 weights.
    if device.streams and not c.upcast:
        block.append(Placement("block", 1, stream=True))
        leaf.append(Placement("leaf", stream=True))
    disk = [] if c.adapters else [Placement("block", 1, disk=True)]  # LoRA + disk: wrong images (notes)
    forced = {"block": block, "leaf": leaf, "disk": disk or [Placement("block", 1, disk=True)]}
    if offload in forced:
        return forced[offload]  # `--offload disk` with adapters is refused by offload.apply, naming why
    return [Placement("resident"), *(block + disk if c.blocks else []), *leaf]


def _floor(c: ComponentProfile, p: Placement) -> int:
    """Device bytes the component holds while it runs (beyond what is resident)."""
    if p.mode == "resident":
        return 0
    if p.mode == "leaf":
        return c.non_leaf + c.largest_leaf * (2 if p.stream else 1)
    if p.stream:
        return c.unmatched + 2 * max(c.blocks)
    return c.block_floor(p.blocks_per_group)


def _forwards(c: ComponentProfile, w: Workload, prof: PipelineProfile | None = None) -> int:
    """Runs of `c` per pipeline call: every step for the denoiser (each of two experts its share of
    them: Wan 2.2 A14B); the VAE decodes once per image (or clip) and encodes each input image once
    (counted as costly as a decode, at the same size); a text encoder runs once per call."""
    if c.per_step:
        share = prof.step_shares.get(c.name) if prof is not None else None
        return w.steps if share is None else max(1, round(w.steps * share))
    return 1 + (w.input_images if c.name == "vae" else 0)


def _tokens(c: ComponentProfile, prof: PipelineProfile, w: Workload) -> int:
    if c.per_step:
        # a clip's tokens are every latent frame's; an edit model's input images, at the image's
        # size, add as many tokens each
        return prof.image_tokens(w.width, w.height, w.frames) * (1 + (w.input_images if w.in_sequence else 0))
    if c.name == "vae":
        return w.width * w.height // 16 * max(w.frames, 1)
    return TEXT_TOKENS.get(c.cls, 77)


def _activations(c: ComponentProfile, prof: PipelineProfile, w: Workload) -> int:
    """Estimated activation bytes per image (or clip) while `c` runs. A video VAE decodes one latent
    frame at a time (Wan's causal cache): its feature maps are one latent frame's output frames,
    plus the decoded clip itself held at float32 until it is post-processed."""
    if c.name == "vae":
        per_frame = w.width * w.height * prof.vae_channels * (prof.vae_dtype_bytes or prof.dtype_bytes) * VAE_ACT_FACTOR
        if not w.frames:
            return per_frame
        return per_frame * prof.vae_temporal + w.frames * w.width * w.height * 3 * 4
    cfg = 2 if c.per_step and w.cfg else 1
    factor = VIDEO_ACT_FACTOR if w.frames and c.per_step else ACT_FACTOR
    return _tokens(c, prof, w) * max(c.hidden, 1) * prof.dtype_bytes * factor * cfg


def computed_share(c: ComponentProfile, w: Workload) -> float:
    """Share of its forwards a component computes: a denoiser under a step cache that skips by step
    (TaylorSeer) its computed steps' share; a data-dependent one (first-block) is predicted as none
    skipped (what it skips is measured: the worker's stats)."""
    if not c.per_step or w.cache.method == NONE:
        return 1.0
    share = w.cache.computed_share(w.steps)
    return 1.0 if share is None else share


def cache_state_bytes(c: ComponentProfile, prof: PipelineProfile, w: Workload, batch: int) -> int:
    """Device bytes a step cache keeps for the denoiser `c` through a pipeline call: hidden-state-sized
    tensors (fleetgen/caches.py) per image, per CFG half in the batch and per cache context."""
    if not c.per_step or w.cache.method == NONE:
        return 0
    tensors = w.cache.state_tensors(len(c.blocks))
    halves = (2 if w.cfg else 1) + int(w.cfg_calls)  # the first call's batch, one more per call of its own
    return tensors * _tokens(c, prof, w) * max(c.hidden, 1) * prof.dtype_bytes * batch * halves


def _call_seconds(
    c: ComponentProfile, p: Placement, prof: PipelineProfile, w: Workload, d: DeviceSpec, batch: int
) -> float:
    """Seconds `c` takes in one pipeline call of `batch` images."""
    return _call_terms(c, p, prof, w, d, batch).seconds


def _flops(c: ComponentProfile, prof: PipelineProfile, w: Workload) -> float:
    """FLOPs of one forward of `c` for one image (one half of a guidance batch): a denoiser's as torch's
    FLOP counter counted them (offload/flops.py), else estimated."""
    tokens = _tokens(c, prof, w)
    if c.flops_terms:
        fixed, linear, quadratic = c.flops_terms
        return fixed + linear * tokens + quadratic * tokens**2
    flops = 2 * (c.token_params or c.params) * tokens  # a UNet's lower levels run over fewer tokens
    if c.per_step and "Transformer" in c.cls:  # attention over every token in every block (a UNet's runs on
        # its downsampled levels only: not counted): scores and weighted sum, 4 x tokens^2 x width (a clip's dominate)
        flops += 4 * tokens**2 * max(c.hidden, 1) * len(c.blocks)
    return flops


def _call_terms(
    c: ComponentProfile, p: Placement, prof: PipelineProfile, w: Workload, d: DeviceSpec, batch: int
) -> Terms:
    """`c`'s predicted seconds in one pipeline call of `batch` images, as terms (offload/speed.py):
    compute at the fitted share of the device's matmul rate; each offloaded group copied at the fitted
    share of its link rate plus a fixed cost per copy — hidden behind the previous group's compute
    with streams (all but the first group's, as far as compute lasts), exposed without; a fixed cost
    per forward."""
    s, forwards = d.speed, _forwards(c, w, prof)
    cfg = (2 if w.cfg else 1) + int(w.cfg_calls) if c.per_step else 1
    slowdown = spec(c.fmt).slowdown if c.fmt != NONE else 1.0  # dequantization (quantize.py's sources)
    slowdown *= FP32_SLOWDOWN if c.upcast else 1.0  # run in float32 (TF32 convolutions)
    compute = _flops(c, prof, w) * cfg * batch * slowdown / (d.flops * s.share(kind(c.name, c.per_step)))
    fixed = s.forward_seconds
    if p.mode == "resident":
        return Terms(compute=compute, fixed=fixed).scaled(forwards)
    if p.disk:
        groups = len(c.blocks) + 1
        transfer = c.bytes / min(d.disk_bandwidth, d.bandwidth * s.link) + groups * s.copy_seconds
        return Terms(compute=compute, transfer_exposed=transfer, fixed=fixed).scaled(forwards)
    groups = max(c.leaves if p.mode == "leaf" else -(-len(c.blocks) // p.blocks_per_group) + 1, 1)
    transfer = c.bytes / (d.bandwidth * s.link) + groups * s.copy_seconds
    if p.stream:  # prefetch overlaps the next group's copy with this group's compute; the first is waited for
        exposed = max(transfer - compute, 0.0) + transfer / groups
        exposed = min(exposed, transfer)
        return Terms(compute, transfer - exposed, exposed, fixed).scaled(forwards)
    return Terms(compute=compute, transfer_exposed=transfer, fixed=fixed).scaled(forwards)


@dataclass(frozen=True)
class _Option:
    """One component in one placement at one batch size: what it adds to the plan."""

    placement: Placement
    resident: int  # device bytes held all the time
    phase: int  # device bytes while it runs (live groups + activations)
    host: int
    pinned: int
    seconds: float  # per pipeline call
    moved: int  # bytes per pipeline call
    load: int = 0  # host bytes while the pipeline loads (its run-dtype bytes unless its format applies at load)
    fmt: str = NONE  # storage format
    cost: float = 0.0  # seconds, plus QUANTIZED_SHARE of the pipeline's ideal time when quantized
    terms: Terms = Terms()  # `seconds` split: compute, transfers hidden and exposed, fixed (offload/speed.py)

    @property
    def quantized(self) -> bool:
        return self.fmt != NONE

    def counts(self) -> tuple:
        return (self.resident, self.phase, self.host, self.pinned, self.cost, self.load)

    def dominates(self, other: _Option) -> bool:
        mine, theirs = self.counts(), other.counts()
        return all(a <= b for a, b in zip(mine, theirs, strict=True)) and mine != theirs


def _formats(name: str, device: DeviceSpec, w: Workload) -> tuple[str, ...]:
    return allowed(w.quantize, name, device.formats, dict(w.fixed))


def _ideal(prof: PipelineProfile, device: DeviceSpec, w: Workload) -> float:
    """Seconds per image of the whole pipeline resident, unquantized, at batch 1 (the plans' measure)."""
    fixed = device.speed.call_seconds + device.speed.image_seconds  # the call's own (planner.py `_with_call_costs`)
    return fixed + sum(
        _call_seconds(prof.variant(n, NONE), Placement("resident"), prof, w, device, 1) for n in prof.components
    )


def _options(
    name: str,
    prof: PipelineProfile,
    device: DeviceSpec,
    w: Workload,
    batch: int,
    ideal: float | None = None,
    placement: Placement | None = None,
) -> list[_Option]:
    """The component's candidate (format, placement) pairs at `batch`, without those another beats
    on every count (cost included: a quantized one pays QUANTIZED_SHARE of `ideal` per image).
    `placement`: that placement only, in each format (a plan given, `fleetgen plan --placement`)."""
    penalty = QUANTIZED_SHARE * (_ideal(prof, device, w) if ideal is None else ideal) * batch
    out = []
    for fmt in _formats(name, device, w):
        c = prof.variant(name, fmt)
        # a video VAE decodes one clip at a time (workers enable its slicing): its activations are one clip's
        acts = _activations(c, prof, w) * (1 if c.name == "vae" and w.frames else batch)
        # a step cache: its state held through the call; skipped steps neither compute nor move
        state, share = cache_state_bytes(c, prof, w, batch), computed_share(c, w)
        forwards = _forwards(c, w, prof) * share
        # the node's copy: in the node's shared segment as loaded (a format applied after load is this worker's own)
        shared = name in device.shared and fmt == NONE
        load = (
            0 if w.loaded or shared else c.bytes if fmt != NONE and spec(fmt).at_load else prof.components[name].bytes
        )
        # phased: resident in its phase, it moves on and off the device once per chunk (this call's share)
        swapped = c.bytes * batch // w.swap_chunk if w.swap_chunk else 0
        swap = 2 * swapped / device.bandwidth
        for p in [placement] if placement is not None else _candidates(c, device, w.offload):
            off = p.mode != "resident"
            # the pinned copy is the host copy with streams; the node's copy is pinned in place, in no worker's budget
            pinned = (c.pinned or c.bytes) if p.stream and not shared else 0
            out.append(
                _Option(
                    placement=p,
                    resident=(0 if off else c.bytes) + state,
                    phase=_floor(c, p) + acts,
                    # a phase's resident component keeps its host copy while it is off the device
                    # (the node's copy, streamed or swapped between phases: nothing of its own, bound to it again;
                    # offloaded without streams, diffusers copies each group back to host memory of the worker's own)
                    host=pinned
                    or (
                        c.bytes
                        if (off and not p.disk and not (shared and p.stream))
                        or (not off and w.swap_chunk and not shared)
                        else 0
                    ),
                    pinned=pinned,
                    terms=(
                        terms := _call_terms(c, p, prof, w, device, batch).scaled(share) + Terms(0, 0, swap * (not off))
                    ),
                    seconds=(seconds := terms.seconds),
                    moved=int(c.bytes * forwards) if off else swapped,
                    load=load,
                    fmt=fmt,
                    cost=seconds + (penalty if fmt != NONE else 0.0),
                )
            )
    if placement is not None:
        return out
    return [o for o in out if not any(x.dominates(o) for x in out)]
