"""Phased generation on the worker (the plan's side: offload/phasing.py). For a chunk of a shard's
batches: phase 1 runs each batch's pipeline call only up to its latents — the text encoders (and an
image encoder: Wan 2.1 image-to-video's CLIP) alone on the device — and keeps what `encode_prompt`
(and `encode_image`) returned in host memory; phase 2 runs each batch's call whole, those answered
from phase 1, the denoiser and the VAE alone on the device. A task that takes images passes them
through the same calls: an edit model's vision-language encoder reads them in phase 1 (Qwen-Image-Edit),
the VAE encodes them into latents in phase 2, beside the denoiser, as the call makes its latents. Components resident in a phase move on at its start and off at its end: once per chunk.

Nothing family-specific: the pipeline's own `__call__` decides what to encode and how to use it
(masks, pooled embeddings, negatives, lists of embeddings), so a batch made in phase 2 is the same
call as per batch — the same pixels. Where the plan has a third phase (the family's decode called
apart: its table's `decode_apart`), phase 2's `vae.decode` records its latents (in host memory) and
answers an empty tensor, its processor's post-processing is recorded and skipped, and phase 3 runs
both on the recorded latents with the VAE alone on the device. Within a chunk a call seen already (a negative prompt every
row shares, a batch of the same prompts again) is answered from the first; and where a call's
prompts come in equal runs (N images per row), the pipeline encodes each once and repeats them
itself (its `num_images_per_prompt`).
"""

from __future__ import annotations

import gc
import hashlib
from collections.abc import Callable

import torch
from PIL.Image import Image as PILImage

from fleetgen.errors import FleetgenError

REPEAT_ARGS = ("num_images_per_prompt", "num_videos_per_prompt")  # what encode_prompt repeats each prompt by
ENCODERS = ("encode_prompt", "encode_image")  # the pipeline methods phase 1 runs and phase 2 is answered from


class _Stop(Exception):
    """Raised where the pipeline call leaves its encoding (`prepare_latents`): phase 1 ends there."""


def call_key(value) -> object:
    """A hashable stand-in for an encoder call's arguments: strings and numbers as they are, tensors
    and pictures (an edit model's input image) by shape and a digest of their values."""
    if isinstance(value, dict):
        return tuple(sorted((k, call_key(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, *map(call_key, value))
    if isinstance(value, torch.Tensor):
        data = value.detach().to("cpu").contiguous().flatten().view(torch.uint8).numpy()
        return ("tensor", tuple(value.shape), str(value.dtype), hashlib.blake2b(data, digest_size=16).digest())
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, PILImage):
        return ("picture", value.mode, value.size, hashlib.blake2b(value.tobytes(), digest_size=16).digest())
    return (type(value).__name__, str(value) if isinstance(value, (torch.device, torch.dtype)) else "")


def moved(value, device):
    """`value` (tensors, nested in tuples, lists and dicts) with every tensor on `device`."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (list, tuple)):
        return type(value)(moved(v, device) for v in value)
    if isinstance(value, dict):
        return {k: moved(v, device) for k, v in value.items()}
    return value


def runs(kwargs: dict) -> tuple[dict, int] | None:
    """Where every list of prompts in an `encode_prompt` call is made of equal runs of the same
    (prompt, negative, ...) — N images per row — the call with each run once and the run length;
    None where that does not hold, the call takes no repeat count or reads more than text (an image)."""
    repeat = next((a for a in REPEAT_ARGS if isinstance(kwargs.get(a), int)), None)
    lists = {k: v for k, v in kwargs.items() if isinstance(v, list) and v and all(isinstance(s, str) for s in v)}
    if repeat is None or not lists or len({len(v) for v in lists.values()}) != 1 or _reads_pictures(kwargs):
        return None
    rows = list(zip(*lists.values(), strict=True))
    first = rows[0]
    r = next((i for i, row in enumerate(rows) if row != first), len(rows))
    if r < 2 or len(rows) % r or any(rows[i] != rows[i - i % r] for i in range(len(rows))):
        return None
    return {**kwargs, **{k: v[::r] for k, v in lists.items()}, repeat: kwargs[repeat] * r}, r


class Phases:
    """The phases of a phased plan on one pipeline: which resident components each puts on the
    device, what phase 1 encoded for each batch, and counts for the worker's stats."""

    def __init__(
        self, pipe, plan, modules: dict[str, torch.nn.Module], device: torch.device, on_swap=None, to_host=None
    ):
        self.pipe, self.device, self.modules = pipe, device, modules
        # (component, module) off the device: the node's copy bound again (workers/pipeline/host_copy.py), else moved
        self.to_host = to_host or (lambda name, module: module.to("cpu"))
        self.resident = [[n for n in phase if plan.placements[n].mode == "resident"] for phase in plan.phases]
        self.on_swap = on_swap  # (component, bytes) per move onto the device: the offload stats count it
        self.current: int | None = None
        self.peaks = [0] * len(self.resident)  # the device's peak bytes in each phase (CUDA)
        self.failed = 1  # the phase the last error was raised in
        self.encoded: dict[tuple[str, ...], list] = {}  # image ids of a batch -> its encode_prompt calls
        self.pending: dict[tuple[str, ...], dict] = {}  # image ids of a batch -> its recorded decode (phase 3)
        self.seen: dict = {}  # call key -> what it returned (host memory), this chunk
        self.reset()

    def reset(self) -> None:
        """Counts from zero (after the warm-up)."""
        self.counts = {
            "chunks": 0,
            "encode_calls": 0,  # encode_prompt calls run (phase 1)
            "prompts_encoded": 0,  # prompts those calls encoded
            "calls_reused": 0,  # calls answered from an earlier one of the chunk
            "encoded_again": 0,  # batches encoded in phase 2 (re-batched after an OOM, or retried one by one)
        }

    def enter(self, phase: int | None) -> None:
        """Phase `phase`'s resident components on the device, the others' off it (None: every phase's
        off, the device left to the job's scorers). On CUDA the device's peak is read per phase
        (`peak_device_bytes`)."""
        if self.current == phase:
            return
        if self.device.type == "cuda":
            if self.current is not None:
                peak = torch.cuda.max_memory_allocated(self.device)
                self.peaks[self.current] = max(self.peaks[self.current], peak)
            torch.cuda.reset_peak_memory_stats(self.device)
        for i, names in enumerate(self.resident):
            if i != phase:
                for name in names:
                    self.to_host(name, self.modules[name])
        for name in self.resident[phase] if phase is not None else ():
            module = self.modules[name]
            module.to(self.device)
            if self.on_swap is not None:
                self.on_swap(name, sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()]))
        self.current = phase

    def carry(self, old: Phases | None) -> Phases:
        """What `old` (the phases of the plan this one replaces) encoded and counted, kept."""
        if old is not None:
            self.encoded, self.seen, self.counts, self.peaks = old.encoded, old.seen, old.counts, old.peaks
            self.pending = old.pending
        return self

    def encode(self, keys: list[tuple], capture: Callable[[tuple], None]) -> None:
        """Phase 1 for a chunk: `capture(key)` runs the pipeline call of the batch `key` names up to
        its encoding (under `self.capturing(key)`). A call that fails here is left to phase 2, where
        its error is its rows'."""
        self.encoded, self.seen = {}, {}
        self.counts["chunks"] += 1
        self.enter(0)
        for key in keys:
            try:
                capture(key)
            except Exception:  # noqa: BLE001 - made again in phase 2, where a row's failure is recorded
                self.encoded.pop(key, None)
        self.enter(1)

    def capturing(self, batch_key: tuple):
        """While the pipeline runs the call of the batch `batch_key` names (its image ids): its encoder
        calls (`ENCODERS`) recorded, the call stopped before its latents."""
        calls = self.encoded[batch_key] = []

        def recorder(method: str, real: Callable) -> Callable:
            def encode(*args, **kwargs):
                key = (method, call_key((args, kwargs)))
                if key in self.seen:
                    self.counts["calls_reused"] += 1
                else:
                    once = runs(kwargs) if not args and method == "encode_prompt" else None
                    call = once[0] if once else kwargs
                    self.counts["encode_calls"] += 1
                    if method == "encode_prompt":
                        self.counts["prompts_encoded"] += max(len(_prompts(args, call)), 1)
                    self.seen[key] = moved(real(*args, **call), "cpu")
                calls.append((key, self.seen[key]))
                return moved(self.seen[key], self.device)

            return encode

        def prepare_latents(*args, **kwargs):
            raise _Stop

        patches = [(self.pipe, m, recorder(m, getattr(self.pipe, m))) for m in ENCODERS if hasattr(self.pipe, m)]
        return _Patched([*patches, (self.pipe, "prepare_latents", prepare_latents)], _Stop)

    def replaying(self, batch_key: tuple, capture: Callable[[tuple], None]):
        """While the pipeline runs a batch's call in phase 2: its encoder calls answered from phase 1.
        A batch phase 1 did not encode (re-batched after an OOM, retried row by row) is encoded now,
        the phases swapped for it."""
        if batch_key not in self.encoded:
            self.counts["encoded_again"] += 1
            self.enter(0)
            try:
                capture(batch_key)
            except BaseException:
                self.failed = 0
                raise
            finally:
                self.enter(1)
        self.failed = 1
        self.enter(1)
        calls = list(self.encoded[batch_key])

        def answer(method: str) -> Callable:
            def encode(*args, **kwargs):
                if not calls:
                    raise FleetgenError(f"phase 2 called {method} more often than phase 1 did")
                key, out = calls.pop(0)
                if key != (method, call_key((args, kwargs))):
                    raise FleetgenError(f"phase 2 called {method} with other arguments than phase 1 did")
                return moved(out, self.device)

            return encode

        return _Patched([(self.pipe, m, answer(m)) for m in ENCODERS if hasattr(self.pipe, m)])

    @property
    def decode_apart(self) -> bool:
        return len(self.resident) > 2

    def deferring(self, batch_key: tuple):
        """While phase 2 runs a batch's call: its `vae.decode` recorded (the latents to host memory) and
        answered with an empty tensor; its processor's post-processing recorded and skipped (the call's
        pictures are placeholders, never used)."""
        from diffusers.models.autoencoders.vae import DecoderOutput

        record = self.pending[batch_key] = {}

        def decode(z, *args, **kwargs):
            record["decode"] = (moved(z, "cpu"), args, kwargs)
            empty = z.new_empty((z.shape[0], 0, *z.shape[2:]))  # no memory: nothing reads it but the post-processing
            record["ndim"] = empty.ndim
            return (empty,) if kwargs.get("return_dict") is False else DecoderOutput(sample=empty)

        patches = [(self.pipe.vae, "decode", decode)]
        for holder in ("image_processor", "video_processor"):
            processor = getattr(self.pipe, holder, None)
            for name in ("postprocess", "postprocess_video"):
                real = getattr(processor, name, None) if processor is not None else None
                if real is None:
                    continue

                def post(image, *args, _holder=holder, _name=name, **kwargs):
                    record["post"] = (_holder, _name, args, kwargs, image.ndim)
                    return [None] * image.shape[0]

                patches.append((processor, name, post))
        return _Patched(patches)

    def decoded(self, batch_key: tuple, rows: slice | None = None) -> Output:
        """Phase 3 for one batch (`rows`: some of its images): its recorded latents decoded, post-processed
        as the call would have; the call's output (its images, or each clip's frames)."""
        record = self.pending[batch_key]
        if "post" not in record:
            raise FleetgenError("phase 2 recorded no decode for this batch")
        z, args, kwargs = record["decode"]
        z = z if rows is None else z[rows]
        with torch.no_grad():
            out = self.pipe.vae.decode(z.to(self.device), *args, **kwargs)
            image = out[0] if isinstance(out, tuple) else out.sample
            holder, name, pargs, pkwargs, ndim = record["post"]
            if ndim == record["ndim"] - 1:  # the call took the only frame of an image VAE's clip (Qwen-Image)
                image = image[:, :, 0]
            return Output(getattr(getattr(self.pipe, holder), name)(image, *pargs, **pkwargs))

    def snapshot(self) -> dict:
        peaks = {"peak_device_bytes": list(self.peaks)} if self.device.type == "cuda" else {}
        return {"phases": [list(p) for p in self.resident], **self.counts, **peaks}


def _reads_pictures(value) -> bool:
    if isinstance(value, dict):
        return any(map(_reads_pictures, value.values()))
    if isinstance(value, (list, tuple)):
        return any(map(_reads_pictures, value))
    return isinstance(value, (torch.Tensor, PILImage))


def _prompts(args: tuple, kwargs: dict) -> list:
    prompt = kwargs.get("prompt", args[0] if args else None)
    return prompt if isinstance(prompt, list) else [prompt] if prompt is not None else []


class _Patched:
    """Methods replaced for one call, as instance attributes shadowing the class's (`patches`:
    (object, attribute, function)); `stop`: an exception that ends the call quietly."""

    def __init__(self, patches: list[tuple[object, str, Callable]], stop: type[BaseException] | None = None):
        self.patches, self.stop = patches, stop

    def __enter__(self):
        self.before = [(holder, name, holder.__dict__.get(name, _ABSENT)) for holder, name, _ in self.patches]
        for holder, name, fn in self.patches:
            setattr(holder, name, fn)
        return self

    def __exit__(self, kind, err, tb) -> bool:
        for holder, name, was in reversed(self.before):  # an instance attribute set before (a hook's) restored
            if was is _ABSENT:
                holder.__dict__.pop(name, None)
            else:
                setattr(holder, name, was)
        return self.stop is not None and kind is not None and issubclass(kind, self.stop)


_ABSENT = object()


class Output:
    """A decode phase's pictures as a pipeline's output holds them (`images`; a video's `frames`)."""

    audio = None
    nsfw_content_detected = None

    def __init__(self, pictures: list):
        self.images = self.frames = pictures


def decode_all(pending: list[tuple[Phases, tuple, list, Callable]], device: torch.device) -> dict[str, str]:
    """Phase 3 for a chunk: each deferred batch — (its phases, its key, its `Made` records, `pictures`:
    the call's output to its pictures) — decoded, its pictures set on its records. A batch whose decode
    fails is decoded again an image at a time, outside the `except` (an OOM's tensors freed first);
    returns {image id: error} for those that still fail."""
    failed: dict[str, str] = {}
    for phases, key, made, pictures in pending:
        error = None
        try:
            _set_pictures(made, pictures(phases.decoded(key)))
            continue
        except Exception as err:  # noqa: BLE001 - decoded again an image at a time, below
            error = f"{type(err).__name__}: {err}"
        gc.collect()  # the failed decode's tensors, held by its traceback until here
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if len(made) == 1:
            failed[made[0].id] = error
            continue
        for i, m in enumerate(made):
            try:
                _set_pictures([m], pictures(phases.decoded(key, slice(i, i + 1))))
            except Exception as err:  # noqa: BLE001 - this image's error, the others' pictures kept
                failed[m.id] = f"{type(err).__name__}: {err}"
    for phases, *_ in pending:
        phases.pending.clear()
    return failed


def _set_pictures(made: list, pictures: list) -> None:
    for m, picture in zip(made, pictures, strict=True):
        m.picture = picture
