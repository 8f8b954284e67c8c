"""One image (or clip) from its pipeline call to its commit: the record the fitted pipeline makes,
the worker's records fill in, the writer thread encodes and a format's sink stores.

    FittedPipeline._call   id, row, picture, and how it was made (batch, seconds, formats, cache)
    Worker._score          its scores (`--score`), and whether `--keep` keeps it (else its picture is let go)
    Records.fill           its sidecar record (`meta`), what its manifest row gains (`record`), its inputs
    writer                 `data` (the encoded picture; the decoded one is let go), `companions`, sha256
    sink.add               stores `data` and `companions` under the format's keys, `meta` beside them
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fleetgen.workers.output.layout import POSTER, frame_name

MASK = "mask.png"  # `--store-inputs`: an inpainting mask beside its image


def input_name(k: int) -> str:
    """The member name of an image's k-th input stored beside it: `input.png`, `input1.png`, ..."""
    return f"input{k or ''}.png"


@dataclass
class Companions:
    """What is stored beside an image, encoded: a clip's poster and (`--store-frames`) its frames,
    and (`--store-inputs`) the inputs it was made from. Each format stores them its own way (files
    beside the image's object, webdataset members `<id>.<name>`, parquet columns)."""

    poster: bytes | None = None  # a clip's first frame, JPEG
    frames: list[bytes] = field(default_factory=list)  # every frame of a clip, PNG, in order
    inputs: list[bytes] = field(default_factory=list)  # the input images as the pipeline got them, PNG
    mask: bytes | None = None  # the inpainting mask as the pipeline got it, PNG

    def members(self) -> list[tuple[str, bytes]]:
        """(name, bytes) of each, the name as it is stored beside the image (`poster.jpg`,
        `frame-0000.png`, `input.png`, `mask.png`)."""
        out = [(POSTER, self.poster)] if self.poster is not None else []
        out += [(frame_name(i), f) for i, f in enumerate(self.frames)]
        out += [(input_name(k), x) for k, x in enumerate(self.inputs)]
        return out + ([(MASK, self.mask)] if self.mask is not None else [])


@dataclass
class Made:
    """One image (or clip) on its way from the pipeline call to the store."""

    id: str
    row: int  # its row in the shard's table (to carry the row's columns)
    picture: (
        object | None
    )  # the decoded image (a video task's: a Clip) until encoded; None: the safety checker flagged it
    nsfw: bool | None = None  # the safety checker's flag; None where the pipeline has none
    batch: int = 1  # images in the call that made it
    seconds: float = 0.0  # its share of the call's wall time
    quantized: str = "none"  # the storage formats its components had (offload/weight_formats.py `describe`)
    cache_skipped: float | None = None  # share of the denoiser's block evaluations its call's step cache skipped
    inputs: list = field(default_factory=list)  # `--store-inputs`: (role, picture) to store beside it, until encoded
    scores: dict = field(default_factory=dict)  # `--score`: {scorer: its score, None where it failed}
    score_error: str | None = None  # why a scorer failed on it
    kept_out: str | None = None  # `--keep` rejected it, or `--best-of` chose another (why): a filtered row, not stored
    record_id: str | None = None  # `--best-of`'s best: its manifest row's key (its candidate id; `id` is the image's)
    meta: dict = field(default_factory=dict)  # its sidecar record: webdataset JSON, parquet row
    record: dict = field(default_factory=dict)  # what its manifest row gains once made
    data: bytes | None = None  # the encoded picture (set by the writer)
    companions: Companions = field(default_factory=Companions)  # encoded by the writer

    @property
    def filtered(self) -> bool:
        return self.picture is None and self.data is None
