"""An image's records, as the field table (workers/output/fields.py) says: its manifest row, and its
sidecar record stored beside the image (parquet rows, webdataset JSON)."""

from __future__ import annotations

from fleetgen.scores import ERROR_COLUMN, SCORERS
from fleetgen.workers.output.fields import records, sidecar_names
from fleetgen.workers.output.made import Made
from fleetgen.workers.rows.batches import WorkItem


class Records:
    """The records of one worker's images: what every one of them shares, given once."""

    def __init__(
        self,
        template: str | None,
        worker: str,
        device: str,
        model: str,
        store_inputs: bool = False,
        cache: str = "none",
        attention: str = "native",
    ):
        self.template, self.worker, self.device, self.model = template, worker, device, model
        self.cache = cache  # the job's step cache (`--cache`), on every image
        self.attention = attention  # the attention kernel this worker's denoisers run (`--attention`)
        self.store_inputs = store_inputs  # `--store-inputs`: each image's inputs go beside it
        self.fields = [f.name for f in records()]  # the manifest's columns
        self.sidecar = [name for name in sidecar_names() if name != "sha256"]  # the writer adds the digest

    def new(self, im: WorkItem) -> dict:
        """The image's manifest row as far as it is known before it is made."""
        return {
            **dict.fromkeys(self.fields),
            "id": im.id,
            "row_id": im.row_id,
            "image_index": im.index,
            "prompt": im.prompt,
            "negative_prompt": im.negative_prompt,
            "seed": im.seed,
            "candidate": im.candidate,
            "status": "error" if im.error else "ok",
            "error": im.error,
            **im.look.record(),
            "template": self.template,
            "cache": self.cache,
            "attention": self.attention,
            "worker": self.worker,
            "device": self.device,
        }

    def fill(self, m: Made, record: dict, inputs: list | None = None) -> None:
        """What a made image's manifest row (`record`, from `new`) gains, its sidecar record and
        (`--store-inputs`) its inputs (workers/rows/inputs.py `Loaded`) to store beside it."""
        made = {
            "batch": m.batch,
            "nsfw": m.nsfw,
            "seconds": m.seconds,
            "quantized": m.quantized,
            "cache_skipped": m.cache_skipped,
            **{SCORERS[name].column: value for name, value in m.scores.items()},
            ERROR_COLUMN: m.score_error,
        }
        if m.kept_out:  # `--keep` rejected its scores: `filtered`, not stored
            m.record = {**made, "status": "filtered", "error": m.kept_out}
            return
        if m.picture is None:  # the safety checker blacked it out: `filtered`, not stored
            m.record = {
                **made,
                "status": "filtered",
                "nsfw": True,
                "error": "flagged by the pipeline's safety checker; not stored",
            }
            return
        meta = {**{name: record[name] for name in self.sidecar}, **made, "model": self.model}
        m.meta = {k: v for k, v in meta.items() if k in self.sidecar or k in ("nsfw", "model")}
        m.record = made
        m.inputs = [(x.ref.role, x.picture) for x in inputs or []] if self.store_inputs else []
