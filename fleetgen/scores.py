"""Scorers (`--score`) and keep rules (`--keep`): which models score each image after it is decoded,
what each reads and writes, and which images are stored — plain data, no torch, shared by the job's
config (jobs/), the field table (workers/output/fields.py: a `score_<name>` column per scorer) and
the worker that loads and runs them (workers/pipeline/scoring.py).

A scorer reads the decoded image (and, where it scores alignment, the prompt) and writes one number
per image. Scores keep pixels, but the scorers chosen and their models decide what the output holds,
so they are job-level (in the fingerprint, their models pinned there); so is a keep rule, which
decides which images are stored at all.

Built in (`--score NAME[=MODEL],...`; MODEL a hub id or a local directory, as for the pipeline; a
hub id may name a revision, `clip=ORG/NAME@REV`, and is pinned to a commit by the driver as the
pipeline's model is):
- `clip`: the cosine similarity of CLIP's image and prompt embeddings (Hessel et al. 2021's CLIP
  score without its x100 and clamp; about 0.2-0.35 for a matching pair on ViT-L/14).
- `pickscore`: PickScore (Kirstain et al. 2023), a CLIP-H fine-tuned on human preferences: its logit
  scale x the cosine (about 18-23).
- `hpsv2`: Human Preference Score v2.1 (Wu et al. 2023): open_clip's ViT-H-14 with HPS's
  checkpoint, the cosine of image and prompt (about 0.2-0.35); needs `open_clip_torch`.
- `aesthetic`: LAION's aesthetic predictor v2 (an MLP over CLIP ViT-L/14's normalized image
  embedding; 1-10). Its weights are a file the user has (`aesthetic=sac+logos+ava1-l14-linearMSE.pth`),
  or a directory holding that file and the CLIP model it reads.
- `nsfw`: an image classifier's probability of its NSFW labels (e.g. Falconsai/nsfw_image_detection).
"""

from __future__ import annotations

import ast
import functools
import json
import math
import operator
from dataclasses import dataclass
from pathlib import Path

from fleetgen.errors import ConfigError

CLIP_L14 = "openai/clip-vit-large-patch14"
IMAGE_TOKENS = 257  # a 224-pixel image through a ViT with 14-pixel patches, and its class token
CLIP_PARAMS = 428_000_000  # CLIP ViT-L/14, which an aesthetic head given as a file reads


@dataclass(frozen=True)
class Scorer:
    name: str  # `--score` name; its manifest column is `score_<name>`
    model: str  # the default model: hub id ("" : the user must name one)
    doc: str
    prompt: bool = False  # reads the image's prompt too (alignment, preference)
    module: str = "transformers"  # the package its loader imports
    package: str = "transformers"  # what to `pip install` when that is missing
    processor: str = ""  # a hub id to take the image/text processor from when the model has none
    params: int = 0  # parameters of the default model, for the device budget (`reserved_bytes`)

    @property
    def column(self) -> str:
        return f"score_{self.name}"


SCORERS: dict[str, Scorer] = {
    s.name: s
    for s in (
        Scorer("clip", CLIP_L14, "cosine of CLIP's image and prompt embeddings", prompt=True, params=428_000_000),
        Scorer(
            "pickscore",
            "yuvalkirstain/PickScore_v1",
            "PickScore: CLIP-H's logit scale x the cosine of image and prompt",
            prompt=True,
            processor="laion/CLIP-ViT-H-14-laion2B-s32B-b79K",
            params=986_000_000,
        ),
        Scorer(
            "hpsv2",
            "xswu/HPSv2",
            "HPS v2.1: open_clip ViT-H-14 with HPS's checkpoint, the cosine of image and prompt",
            prompt=True,
            module="open_clip",
            package="open_clip_torch",
            params=986_000_000,
        ),
        Scorer(
            "aesthetic",
            "",
            "LAION aesthetic predictor v2 over CLIP ViT-L/14's image embedding (1-10)",
            params=430_000_000,
        ),
        Scorer(
            "nsfw",
            "Falconsai/nsfw_image_detection",
            "an image classifier's probability of its NSFW labels",
            params=86_000_000,
        ),
    )
}
NSFW_LABELS = ("nsfw", "porn", "hentai", "sexy", "unsafe", "explicit")  # a classifier's labels that count as NSFW
ERROR_COLUMN = "score_error"
MAX_CANDIDATES = 64  # `--best-of`: candidates per image at most


@dataclass(frozen=True)
class ScoreSpec:
    """The job's scorers: (name, model) in the order asked; model as given (hub id or directory).
    `revisions`: (hub id, revision) for the hub models the scorers read — as asked (`@REV`), then, once
    the driver has pinned them (jobs/hub.py `pin_scorers`), each a commit."""

    scorers: tuple[tuple[str, str], ...] = ()
    revisions: tuple[tuple[str, str], ...] = ()

    @property
    def label(self) -> str:
        """The one spelling: `name=model,...` (the fingerprint holds it); `none` without scorers."""
        return ",".join(f"{n}={m}" for n, m in self.scorers) or "none"

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.scorers)

    def __bool__(self) -> bool:
        return bool(self.scorers)

    def revision(self, model: str) -> str | None:
        """The revision (once pinned: the commit) a hub model is read at; None: the hub's main."""
        return dict(self.revisions).get(model)

    def hub_models(self, name: str) -> tuple[str, ...]:
        """The hub ids scorer `name` reads: its model; PickScore's processor (its repository has none);
        an aesthetic head given as a file reads CLIP ViT-L/14 from the hub."""
        model = dict(self.scorers)[name]
        if Path(model).is_absolute():  # a local path (parse_scores makes them absolute)
            return (CLIP_L14,) if name == "aesthetic" and not Path(model).is_dir() else ()
        processor = SCORERS[name].processor
        return (model, processor) if processor and model == SCORERS[name].model else (model,)

    def params(self, name: str) -> int:
        """Scorer `name`'s parameters: a local model's counted from its weights files (safetensors headers;
        other files at 4 bytes each), a hub model's the registry's figure for the default model's size."""
        model = dict(self.scorers)[name]
        hub = sum(
            SCORERS[name].params if m == model else CLIP_PARAMS
            for m in self.hub_models(name)
            if m != SCORERS[name].processor
        )
        return hub + (local_params(Path(model)) if Path(model).is_absolute() else 0)

    def reserved_bytes(self, dtype_bytes: int = 2) -> int:
        """Device bytes the scorers hold once on the device (weights at the run dtype, and a quarter
        again for one image's activations)."""
        return int(sum(self.params(n) for n in self.names) * dtype_bytes * 1.25)

    def seconds_per_image(self, flops: float) -> float:
        """Predicted compute per image at `flops`: each scorer's forward pass, 2 FLOPs per parameter per
        token over a ViT-L/14-sized image (257 tokens; the prompt's 77 on the smaller text tower, not counted)."""
        return sum(2 * self.params(n) * IMAGE_TOKENS for n in self.names) / flops


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pth", ".pt")


def local_params(path: Path) -> int:
    """Parameters in a local weights file or directory: each safetensors file's header (its tensors'
    shapes), any other weights file at 4 bytes a parameter (float32; beside safetensors files only an
    aesthetic head, the rest being the same weights in another format)."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.suffix in WEIGHT_SUFFIXES)
    if any(f.suffix == ".safetensors" for f in files):  # a repo with both formats: the same weights twice
        files = [f for f in files if f.suffix == ".safetensors" or f.name.startswith("aesthetic")]
    total = 0
    for f in files:
        if f.suffix == ".safetensors":
            with open(f, "rb") as fh:
                header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
            total += sum(math.prod(t["shape"]) for k, t in header.items() if k != "__metadata__")
        elif f.suffix in WEIGHT_SUFFIXES:
            total += f.stat().st_size // 4
    return total


USAGE = "`--score` takes NAME[=MODEL],... with NAME one of " + ", ".join(SCORERS)


def parse_scores(value: str | ScoreSpec | None) -> ScoreSpec:
    """`clip,aesthetic=PATH,nsfw=ORG/NAME` (or `none`); a record is returned as it is."""
    if isinstance(value, ScoreSpec):
        return value
    text = (value or "").strip()
    if text.lower() in ("", "none"):
        return ScoreSpec()
    out: dict[str, str] = {}
    revisions: dict[str, str] = {}
    for part in (p.strip() for p in text.split(",")):
        name, eq, model = part.partition("=")
        name, model = name.strip().lower(), model.strip()
        if name not in SCORERS:
            raise ConfigError(f"{USAGE}; got `{name or part}`.")
        if eq and not model:
            raise ConfigError(
                f"`--score {name}=` names no model: give a hub id or a directory, or leave `=` off for the default."
            )
        if name in out:
            raise ConfigError(f"`--score` names `{name}` twice.")
        model = model or SCORERS[name].model
        if model and Path(model).expanduser().exists():  # one spelling, absolute: workers start elsewhere
            model = str(Path(model).expanduser().resolve())
        elif "@" in model:  # ORG/NAME@REV: a hub model at a branch, tag or commit
            model, _, rev = model.rpartition("@")
            if not model or not rev:
                raise ConfigError(f"`--score {part}`: write a hub model's revision as NAME=ORG/MODEL@REV.")
            revisions[model] = rev
        if not model:
            raise ConfigError(
                f"`--score {name}` needs its weights: `{name}=PATH` (LAION's sac+logos+ava1-l14-linearMSE.pth, "
                "or a directory holding it and the CLIP model it reads)."
            )
        out[name] = model
    return ScoreSpec(tuple(out.items()), tuple(revisions.items()))


# --- keep rules -------------------------------------------------------------------------------------

_COMPARE = {ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt, ast.GtE: operator.ge}
KEEP_USAGE = "`--keep` is comparisons of scores with numbers joined by and/or/not, e.g. 'clip>=0.26 and nsfw<0.5'"


@dataclass(frozen=True)
class KeepRule:
    """Which images are stored: a boolean expression over the job's scores (`clip>=0.26 and nsfw<0.5`).
    An image it rejects is a `filtered` row with its scores, never stored."""

    text: str = ""

    def __bool__(self) -> bool:
        return bool(self.text)

    @property
    def label(self) -> str:
        return self.text or "none"

    def names(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(n.id for n in ast.walk(_tree(self.text)) if isinstance(n, ast.Name)))

    def keeps(self, scores: dict[str, float | None]) -> bool | None:
        """Whether an image with these scores is kept; None where a score it reads is missing (its
        scorer failed on the image: the image is stored, its error recorded)."""
        if not self.text:
            return True
        if any(scores.get(n) is None or math.isnan(scores[n]) for n in self.names()):
            return None
        return bool(_eval(_tree(self.text).body, scores))

    def why(self, scores: dict[str, float | None]) -> str:
        """The rejected image's error: the rule and the scores it read."""
        read = ", ".join(f"{n} {scores[n]:.4g}" for n in self.names())
        return f"kept out by --keep '{self.text}' ({read}); not stored"


def parse_keep(value: str | KeepRule | None, scores: ScoreSpec) -> KeepRule:
    """A keep rule over `scores` (its names must be scores the job computes); `none`/empty: keep all."""
    if isinstance(value, KeepRule):
        value = value.text
    text = (value or "").strip()
    if text.lower() in ("", "none"):
        return KeepRule()
    try:
        tree = _tree(text)
        _check(tree.body)
    except (SyntaxError, ValueError) as err:
        raise ConfigError(f"{KEEP_USAGE}; `{text}`: {err.msg if isinstance(err, SyntaxError) else err}.") from None
    rule = KeepRule(" ".join(text.split()))
    missing = [n for n in rule.names() if n not in scores.names]
    if missing:
        computed = ", ".join(scores.names) or "none (add --score)"
        raise ConfigError(f"`--keep` reads {', '.join(missing)}, which the job does not score; it scores: {computed}.")
    return rule


@functools.lru_cache(maxsize=64)  # a job has one rule, read for every image: parsed once
def _tree(text: str) -> ast.Expression:
    return ast.parse(text.strip(), mode="eval")


def _check(node: ast.AST) -> None:
    if isinstance(node, ast.BoolOp):
        for v in node.values:
            _check(v)
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        _check(node.operand)
    elif isinstance(node, ast.Compare):
        if not all(type(op) in _COMPARE for op in node.ops):
            raise ValueError("compare with <, <=, > or >=")
        sides = [node.left, *node.comparators]
        for side in sides:
            if isinstance(side, ast.UnaryOp) and isinstance(side.op, ast.USub):
                side = side.operand
            if not (isinstance(side, ast.Name) or (isinstance(side, ast.Constant) and _number(side.value))):
                raise ValueError(f"`{ast.unparse(side)}` is neither a score nor a number")
        if not any(isinstance(s, ast.Name) for s in sides):
            raise ValueError(f"`{ast.unparse(node)}` reads no score")
    else:
        raise ValueError(f"`{ast.unparse(node)}` is not a comparison")


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _eval(node: ast.AST, scores: dict) -> object:
    if isinstance(node, ast.BoolOp):
        values = (_eval(v, scores) for v in node.values)
        return all(values) if isinstance(node.op, ast.And) else any(values)
    if isinstance(node, ast.UnaryOp):
        value = _eval(node.operand, scores)
        return (not value) if isinstance(node.op, ast.Not) else -value
    if isinstance(node, ast.Compare):
        sides = [_eval(s, scores) for s in (node.left, *node.comparators)]
        return all(_COMPARE[type(op)](a, b) for op, a, b in zip(node.ops, sides, sides[1:], strict=False))
    if isinstance(node, ast.Name):
        return scores[node.id]
    return node.value
