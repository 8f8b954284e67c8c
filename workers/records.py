"""An image's records, as the field table (workers/output/fields.py) says: its manifest row, and what is
stored beside the image (parquet rows, webdataset JSON)."""

from __future__ import annotations

from fleetgen.workers.output.fields import records, sidecar_names
from fleetgen.workers.output.writer import Made
from fleetgen.workers.pipeline.fitted import Picture
from fleetgen.workers.rows.batches import WorkItem
from fleetgen.workers.rows.inputs import stored_inputs


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
        self.stored = [name for name in sidecar_names() if name != "sha256"]  # the writer adds the digest

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
            "status": "error" if im.error else "ok",
            "error": im.error,
            **im.look.record(),
            "template": self.template,
            "cache": self.cache,
            "attention": self.attention,
            "worker": self.worker,
            "device": self.device,
        }

    def made(self, p: Picture, record: dict, inputs: list | None = None) -> Made:
        """A picture with what its manifest row (`record`, from `new`) gains, and the record stored
        beside it (and its `inputs`, workers/rows/inputs.py, where they are stored too)."""
        im = p.image
        if p.picture is None:  # the safety checker blacked it out: `filtered`, not stored
            flagged = {
                "status": "filtered",
                "nsfw": True,
                "batch": p.batch,
                "seconds": p.seconds,
                "error": "flagged by the pipeline's safety checker; not stored",
                "quantized": p.quantized,
                "cache_skipped": p.cache_skipped,
            }
            return Made(im.id, im.row, None, {}, flagged)
        made = {
            "batch": p.batch,
            "nsfw": p.nsfw,
            "seconds": p.seconds,
            "quantized": p.quantized,
            "cache_skipped": p.cache_skipped,
        }
        meta = {**{name: record[name] for name in self.stored}, **made, "model": self.model}
        meta = {k: v for k, v in meta.items() if k in self.stored or k in ("nsfw", "model")}
        return Made(
            im.id, im.row, p.picture, meta, made, inputs=stored_inputs(inputs or []) if self.store_inputs else None
        )
