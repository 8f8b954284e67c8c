"""Scorers on the worker's device (fleetgen/scores.py says which and what each reads): each loaded
once, each image scored right after it is decoded — a batch at a time, and an image alone where its
batch fails, so that a scorer's failure is that image's `score_error`, never a lost image. A clip is
scored on a few of its frames (evenly spaced), their mean.

Where the scorers live is the plan's (offload/cost.py `DeviceSpec.beside`): loaded into host memory,
moved onto the device for their first score; beside a per-batch plan they stay there, under a phased
plan with a decode phase the worker `release`s them after each chunk's decode, so the encoders' and the
denoiser's phases have the whole device.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from fleetgen.errors import ConfigError, FleetgenError
from fleetgen.scores import CLIP_L14, NSFW_LABELS, SCORERS, ScoreSpec
from fleetgen.workers.families.model_dir import is_hub_id

CLIP_FRAMES = 4  # frames of a clip scored (first, last, evenly between)
HEAD_NAMES = ("aesthetic.safetensors", "aesthetic.pth")  # an aesthetic directory's head beside its CLIP model

Run = Callable[[list, list[str]], list[float]]  # (images, prompts) -> one score per image
Loaded = tuple[Run, list[torch.nn.Module]]  # a scorer's run and the modules it holds (moved on and off the device)
Pins = Callable[[str], str | None]  # a hub id -> the commit the driver pinned it to (ScoreSpec.revision)


class Scoring:
    """The job's scorers, loaded on `device`: `score(pictures, prompts)` gives each picture's scores
    ({name: float or None}) and its error (or None)."""

    def __init__(self, spec: ScoreSpec, device: torch.device, dtype: torch.dtype):
        self.spec, self.device, self.dtype = spec, device, dtype
        self.runs: dict[str, Run] = {}
        self.modules: list[torch.nn.Module] = []  # in host memory until the first score
        self.on_device = False  # loaded into host memory; on the device from the first score
        self.moves = 0  # times the scorers were moved onto the device
        for name, model in spec.scorers:
            try:
                self.runs[name], modules = LOADERS[name](model, device, dtype, spec.revision)
                self.modules += modules
            except (ConfigError, FleetgenError):
                raise
            except Exception as err:  # noqa: BLE001 - said as the scorer's, in one line
                raise FleetgenError(f"`--score {name}={model}` did not load: {type(err).__name__}: {err}") from None
        self.seconds = 0.0  # wall time spent scoring (workers/<w>.json)
        self.images = 0

    def score(self, pictures: list, prompts: list[str]) -> list[tuple[dict[str, float | None], str | None]]:
        if not pictures:
            return []
        started = time.perf_counter()
        if not self.on_device:
            self._move(self.device)  # (a CPU worker's scorers stay where they are: counted all the same)
            self.on_device, self.moves = True, self.moves + 1
        out: list[tuple[dict, list[str]]] = [({}, []) for _ in pictures]
        for name, run in self.runs.items():
            for i, value in enumerate(_each(run, pictures, prompts, name)):
                scores, errors = out[i]
                if isinstance(value, str):
                    scores[name] = None
                    errors.append(value)
                else:
                    scores[name] = value
        self.seconds += time.perf_counter() - started
        self.images += len(pictures)
        return [(scores, "; ".join(errors) or None) for scores, errors in out]

    def release(self) -> None:
        """The scorers back in host memory (a phased plan's decode phase is over), until the next score."""
        if self.on_device:
            self._move(torch.device("cpu"))
            self.on_device = False

    def _move(self, device: torch.device) -> None:
        for module in self.modules:
            module.to(device)

    def snapshot(self) -> dict:
        return {
            "scorers": dict(self.spec.scorers),
            "images": self.images,
            "seconds": round(self.seconds, 3),
            "moved_on": self.moves,
        }


def _each(run: Run, pictures: list, prompts: list[str], name: str) -> list[float | str]:
    """`run` over every picture (a clip: the mean over its frames): the batch at once; where that
    fails, each picture alone; a picture that fails alone is its error (a string)."""
    frames = [_frames(p) for p in pictures]
    flat = [f for fs in frames for f in fs]
    texts = [t for fs, t in zip(frames, prompts, strict=True) for _ in fs]
    try:
        values = run(flat, texts)
        return _means(values, frames)
    except Exception:  # noqa: BLE001 - each picture alone, below
        pass
    out: list[float | str] = []
    for fs, text in zip(frames, prompts, strict=True):
        try:
            out.append(_means(run(fs, [text] * len(fs)), [fs])[0])
        except Exception as err:  # noqa: BLE001 - this picture's error; the others' scores kept
            out.append(f"{name}: {type(err).__name__}: {err}"[:300])
    return out


def _frames(picture) -> list:
    frames = getattr(picture, "frames", None)
    if frames is None:
        return [picture]
    n = len(frames)
    picks = sorted({round(i * (n - 1) / max(CLIP_FRAMES - 1, 1)) for i in range(min(CLIP_FRAMES, n))})
    return [frames[i] for i in picks]


def _means(values: list[float], frames: list[list]) -> list[float]:
    out, at = [], 0
    for fs in frames:
        chunk = values[at : at + len(fs)]
        out.append(float(sum(chunk) / len(chunk)))
        at += len(fs)
    return out


# --- loaders: (model, device, dtype, pins) -> Run ---------------------------------------------------------


def _pooled(out) -> torch.Tensor:
    """transformers 5 returns the projected embedding as `pooler_output` of an output record; 4.x the tensor."""
    return out.pooler_output if hasattr(out, "pooler_output") else out


def _clip_parts(model: str, device, dtype, pins: Pins, processor: str = ""):
    from transformers import AutoTokenizer, CLIPImageProcessor, CLIPModel

    clip = CLIPModel.from_pretrained(model, torch_dtype=dtype, revision=pins(model)).eval()  # host memory
    source = model
    if processor and is_hub_id(model) and model == SCORERS["pickscore"].model:
        source = processor  # PickScore's repository has no processor of its own; its paper's is CLIP-H's
    images = CLIPImageProcessor.from_pretrained(source, revision=pins(source))
    tokenizer = AutoTokenizer.from_pretrained(source, revision=pins(source))
    return clip, images, tokenizer


def _image_embeddings(clip, images, pictures: list, device, dtype) -> torch.Tensor:
    pixels = images(images=[p.convert("RGB") for p in pictures], return_tensors="pt")["pixel_values"]
    emb = _pooled(clip.get_image_features(pixel_values=pixels.to(device, dtype))).float()
    return emb / emb.norm(dim=-1, keepdim=True)


def _alignment(scale: bool, processor: str = "") -> Callable[[str, torch.device, torch.dtype], Run]:
    """CLIP score (the cosine) or PickScore (its logit scale x the cosine)."""

    def load(model: str, device, dtype, pins: Pins) -> Loaded:
        clip, images, tokenizer = _clip_parts(model, device, dtype, pins, processor)
        limit = clip.config.text_config.max_position_embeddings

        @torch.no_grad()
        def run(pictures: list, prompts: list[str]) -> list[float]:
            img = _image_embeddings(clip, images, pictures, device, dtype)
            tokens = tokenizer(prompts, padding=True, truncation=True, max_length=limit, return_tensors="pt")
            txt = _pooled(clip.get_text_features(**{k: v.to(device) for k, v in tokens.items()})).float()
            cos = (img * (txt / txt.norm(dim=-1, keepdim=True))).sum(-1)
            return (cos * clip.logit_scale.exp().float() if scale else cos).tolist()

        return run, [clip]

    return load


def _aesthetic(model: str, device, dtype, pins: Pins) -> Loaded:
    """LAION's aesthetic predictor v2: its MLP (Linear layers with dropout between, as the published
    `layers.N` state dict has them) over CLIP's normalized image embedding. `model`: the head's weights
    file (CLIP ViT-L/14 from the hub), or a directory with `aesthetic.pth|safetensors` and the CLIP model."""
    path = Path(model).expanduser()
    if path.is_dir():
        head = next((path / n for n in HEAD_NAMES if (path / n).exists()), None)
        if head is None:
            raise ConfigError(f"`--score aesthetic={model}`: the directory holds none of {', '.join(HEAD_NAMES)}")
        base = str(path)
    else:
        head, base = path, CLIP_L14
    state = _load_state(head)
    layers = sorted({int(k.split(".")[1]) for k in state if k.startswith("layers.") and k.endswith(".weight")})
    if not layers:
        raise ConfigError(f"`--score aesthetic={model}`: {head.name} holds no `layers.N.weight` (LAION's MLP)")
    mlp = torch.nn.Sequential(*[torch.nn.Linear(*state[f"layers.{i}.weight"].shape[::-1]) for i in layers])
    mlp.load_state_dict(
        {f"{j}.{p}": state[f"layers.{i}.{p}"] for j, i in enumerate(layers) for p in ("weight", "bias")}
    )
    mlp = mlp.to(torch.float32).eval()
    clip, images, _ = _clip_parts(base, device, dtype, pins)
    if clip.config.projection_dim != mlp[0].in_features:
        raise ConfigError(
            f"`--score aesthetic={model}`: the head reads {mlp[0].in_features}-wide embeddings, "
            f"its CLIP makes {clip.config.projection_dim}"
        )

    @torch.no_grad()
    def run(pictures: list, prompts: list[str]) -> list[float]:
        return mlp(_image_embeddings(clip, images, pictures, device, dtype)).squeeze(-1).tolist()

    return run, [mlp, clip]


def _load_state(path: Path) -> dict:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    state = torch.load(str(path), map_location="cpu", weights_only=True)
    return state.get("state_dict", state)


def _nsfw(model: str, device, dtype, pins: Pins) -> Loaded:
    """An image classifier's probability of its NSFW labels (`NSFW_LABELS`)."""
    from transformers import AutoImageProcessor, AutoModelForImageClassification

    classifier = AutoModelForImageClassification.from_pretrained(model, torch_dtype=dtype, revision=pins(model))
    classifier = classifier.eval()
    labels = {i: str(label) for i, label in classifier.config.id2label.items()}
    flagged = [i for i, label in labels.items() if label.lower() in NSFW_LABELS]
    if not flagged:
        raise ConfigError(
            f"`--score nsfw={model}`: none of its labels ({', '.join(labels.values())}) is one of {', '.join(NSFW_LABELS)}"
        )
    processor = AutoImageProcessor.from_pretrained(model, use_fast=False, revision=pins(model))

    @torch.no_grad()
    def run(pictures: list, prompts: list[str]) -> list[float]:
        pixels = processor(images=[p.convert("RGB") for p in pictures], return_tensors="pt")["pixel_values"]
        logits = classifier(pixel_values=pixels.to(device, dtype)).logits.float()
        return logits.softmax(-1)[:, flagged].sum(-1).tolist()

    return run, [classifier]


def _hpsv2(model: str, device, dtype, pins: Pins) -> Loaded:
    """HPS v2.1: open_clip's ViT-H-14 with HPS's checkpoint (`model`: the checkpoint file, or the hub
    repository holding HPS_v2.1_compressed.pt)."""
    import open_clip

    path = Path(model).expanduser()
    if not path.exists():
        from huggingface_hub import hf_hub_download

        path = Path(hf_hub_download(model, "HPS_v2.1_compressed.pt", revision=pins(model)))
    clip, _, preprocess = open_clip.create_model_and_transforms("ViT-H-14", pretrained=None, device="cpu")
    clip.load_state_dict(_load_state(path))
    clip = clip.to(dtype).eval()
    tokenizer = open_clip.get_tokenizer("ViT-H-14")

    @torch.no_grad()
    def run(pictures: list, prompts: list[str]) -> list[float]:
        pixels = torch.stack([preprocess(p.convert("RGB")) for p in pictures]).to(device, dtype)
        img = clip.encode_image(pixels, normalize=True).float()
        txt = clip.encode_text(tokenizer(prompts).to(device), normalize=True).float()
        return (img * txt).sum(-1).tolist()

    return run, [clip]


LOADERS: dict[str, Callable[[str, torch.device, torch.dtype, Pins], Loaded]] = {
    "clip": _alignment(scale=False),
    "pickscore": _alignment(scale=True, processor=SCORERS["pickscore"].processor),
    "hpsv2": _hpsv2,
    "aesthetic": _aesthetic,
    "nsfw": _nsfw,
}
