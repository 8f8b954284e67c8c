"""A shard's stored images scored after the fact (`fleetgen score`, jobs/score.py says which shards and
pins the models): its manifest's stored rows read back from the store as `verify` reads them (any output
format), scored a batch at a time on this process's device, and one table per scorer,
`scores/<name>/<shard>.parquet` (`id`, `score_<name>`, `score_error`; the manifest version it read in its
metadata), committed create-if-absent. The same code runs in the `fleetgen score` process and in its Ray
workers (cluster/score_pool.py).
"""

from __future__ import annotations

import io

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from fleetgen.errors import StorageError
from fleetgen.scores import ERROR_COLUMN, SCORERS, ScoreSpec
from fleetgen.workers.output.formats import Unreadable, get_format
from fleetgen.workers.output.layout import manifest_key
from fleetgen.workers.output.storage import Output
from fleetgen.workers.pipeline.load import resolve_device
from fleetgen.workers.pipeline.scoring import Scoring

SCORES = "scores"
VERSION_KEY = b"fleetgen.manifest_version"  # the manifest version a score table read
BATCH = 16  # images scored per call
COLUMNS = ["id", "status", "image", "member", "size", "prompt", "num_frames"]  # of a manifest, read to score it


def table_key(name: str, shard: str) -> str:
    return f"{SCORES}/{name}/{shard}.parquet"


class ShardScorer:
    """The job's scorers loaded once on `device` (`auto`: a GPU where there is one), scoring shard after
    shard of the output at `url` (its images in `output_format`)."""

    def __init__(self, url: str, spec: ScoreSpec, output_format: str, device: str = "auto", batch: int = BATCH):
        self.output, self.fmt, self.batch = Output(url), get_format(output_format), batch
        dev = resolve_device(device)
        self.scoring = Scoring(spec, dev, torch.float32 if dev.type == "cpu" else torch.bfloat16)

    def attempt(self, shard: str, version: str, names: list[str]) -> tuple[str, int, int, str | None]:
        """`score`'s (shard, images, errors, None), or (shard, 0, 0, why) where the store or a stored image
        failed it: that shard is left for a rerun, the others go on."""
        try:
            return shard, *self.score(shard, version, names), None
        except (StorageError, Unreadable, OSError, ValueError) as err:
            return shard, 0, 0, f"{type(err).__name__}: {err}"[:300]

    def score(self, shard: str, version: str, names: list[str]) -> tuple[int, int]:
        """Score `shard` (its manifest at `version`) with the scorers `names`, committing a table for each;
        returns (images scored, images a scorer could not score)."""
        from PIL import Image

        manifest = self.output.read_parquet(manifest_key(shard), COLUMNS)  # an older one lacks newer columns
        rows = [r for r in manifest.to_pylist() if r["status"] == "ok"]
        stored, _ = self.fmt.read_back(self.output, shard, rows, None)
        missing = [r["image"] for r in rows if stored[r["id"]][1] is None]
        fetched = self.output.get_many(missing) if missing else {}
        results: list[tuple[dict, str | None]] = []
        for start in range(0, len(rows), self.batch):
            part = rows[start : start + self.batch]
            pictures = []
            for r in part:
                blob = stored[r["id"]][1]
                blob = blob if blob is not None else fetched[r["image"]]
                pictures.append(_Frames(blob) if r.get("num_frames") else Image.open(io.BytesIO(blob)).convert("RGB"))
            results += self.scoring.score(pictures, [r["prompt"] or "" for r in part])
        errors = 0
        for name in names:
            own = [(s.get(name), e if s.get(name) is None else None) for s, e in results]
            errors += sum(v is None for v, _ in own)
            self._commit(name, shard, version, rows, own)
        return len(rows), errors

    def _commit(self, name: str, shard: str, version: str, rows: list[dict], own: list[tuple]) -> None:
        table = pa.table(
            {
                "id": pa.array([r["id"] for r in rows], pa.string()),
                SCORERS[name].column: pa.array([v for v, _ in own], pa.float32()),
                ERROR_COLUMN: pa.array([e for _, e in own], pa.string()),
            }
        ).replace_schema_metadata({VERSION_KEY: version.encode()})
        sink = io.BytesIO()
        pq.write_table(table, sink)
        key = table_key(name, shard)
        if self.output.exists(key):  # scored from a manifest replaced since: this one's scores replace it
            self.output.put(key, sink.getvalue())
        else:
            self.output.create(key, sink.getvalue())  # another run's, if it won the race: the same scores


class _Frames:
    """A stored clip's frames, decoded, as the pass's scorers take a clip (`.frames`)."""

    def __init__(self, data: bytes):
        from fleetgen.workers.output.video import decode_frames

        self.frames = decode_frames(data)
