"""`fleetgen score OUT --score NAME[=MODEL],...`: score a job's stored images after the fact, so one
render can be scored by several models later. Each scorer's scores of a committed shard are one table,
`OUT/scores/<name>/<shard>.parquet` (`id`, `score_<name>`, `score_error`; the manifest version it read
in its metadata), committed create-if-absent as the shards are: a rerun skips the tables there, scores
a shard whose manifest was replaced since (`--retry-errors`) again, and never keeps two. Each scorer's
model is claimed in `OUT/scores/<name>/scorer.json` (a hub model at the commit it was pinned to, which
a rerun keeps): another model's scores under the same name are refused (one line, exit 2). Any output format, any store: the images are read back as `verify` reads them.

Runs in this process, on its device (`--device`), a batch of images at a time; a clip is scored on
frames evenly spaced over it, as in the pass.
"""

from __future__ import annotations

import io
import json
import posixpath
import time
from dataclasses import dataclass, field, replace

import pyarrow as pa
import pyarrow.parquet as pq

from fleetgen.errors import ConfigError, StorageError
from fleetgen.jobs.state import commits, list_manifests, read_manifests, scorer_identity
from fleetgen.jobs.validate import check_scorers
from fleetgen.scores import ERROR_COLUMN, SCORERS, ScoreSpec, parse_scores
from fleetgen.workers.output.formats import Unreadable, get_format
from fleetgen.workers.output.layout import JOB
from fleetgen.workers.output.storage import Output

SCORES = "scores"
VERSION_KEY = b"fleetgen.manifest_version"  # the manifest version a score table read
BATCH = 16  # images scored per call


def table_key(name: str, shard: str) -> str:
    return f"{SCORES}/{name}/{shard}.parquet"


@dataclass
class ScoreSummary:
    output: str
    scorers: list[str]
    shards_scored: int = 0  # tables committed by this run
    shards_skipped: int = 0  # already scored (a rerun)
    images: int = 0
    errors: int = 0  # images a scorer could not score (their `score_error`)
    failures: dict[str, str] = field(default_factory=dict)  # shard -> why it was not scored
    seconds: float = 0.0

    @property
    def complete(self) -> bool:
        return not self.failures

    def text(self) -> str:
        failed = f"; {len(self.failures)} shards not scored: " + "; ".join(
            f"{s}: {e}" for s, e in list(self.failures.items())[:3]
        )
        return (
            f"scored {self.images} images with {', '.join(self.scorers)} in {self.shards_scored} shards "
            f"({self.shards_skipped} already scored, {self.errors} score errors) in {self.seconds:.1f} s; "
            f"tables under {self.output}/{SCORES}/<name>/" + (failed if self.failures else "")
        )


def score_job(url: str, score: str | ScoreSpec, device: str = "auto", batch: int = BATCH, say=print) -> ScoreSummary:
    """Score every committed shard of the job at `url` not scored yet by each of `score`'s scorers."""
    import torch

    from fleetgen.jobs.models import pin_scorers
    from fleetgen.workers.pipeline.load import resolve_device
    from fleetgen.workers.pipeline.scoring import Scoring

    output = Output(url)
    spec = parse_scores(score)
    if not spec:
        raise ConfigError("`fleetgen score` needs `--score NAME[=MODEL],...`.")
    check_scorers(spec)
    try:
        generation = json.loads(output.get(JOB))["fingerprint"]["generation"]
    except FileNotFoundError:
        raise ConfigError(f"{output.url} holds no fleetgen job (no {JOB}).") from None
    held = {name: _held(output, name) for name in spec.names}
    spec, notes = pin_scorers(
        spec, commits([m for c in held.values() if c for m in (c.get("model", ""), *c.get("reads", ()))])
    )
    for line in notes:
        say(line)
    for name in spec.names:
        _claim(output, spec, name, held[name])
    started = time.perf_counter()
    summary = ScoreSummary(output.url, list(spec.names))
    committed = list_manifests(output)
    fmt = get_format(generation["output_format"])
    todo: dict[str, list[str]] = {}
    tables = {n: set(output.list(f"{SCORES}/{n}", ".parquet")) for n in spec.names}  # one listing per scorer
    for shard, version in sorted(committed.items()):
        names = [n for n in spec.names if _stale(output, n, shard, version, tables[n])]
        if names:
            todo[shard] = names
        else:
            summary.shards_skipped += 1
    if not todo:
        summary.seconds = time.perf_counter() - started
        return summary
    dev = resolve_device(device)
    scoring = Scoring(
        replace(spec, scorers=tuple((n, m) for n, m in spec.scorers if any(n in v for v in todo.values()))),
        dev,
        torch.float32 if dev.type == "cpu" else torch.bfloat16,
    )
    for i, (shard, names) in enumerate(todo.items()):
        try:
            images, errors = _score_shard(output, fmt, shard, committed[shard], names, scoring, batch)
        except (StorageError, Unreadable, OSError, ValueError) as err:
            summary.failures[shard] = f"{type(err).__name__}: {err}"[:300]
            continue
        summary.shards_scored += 1
        summary.images += images
        summary.errors += errors
        say(f"[fleetgen] scored {shard} ({i + 1}/{len(todo)}): {images} images")
    summary.seconds = time.perf_counter() - started
    return summary


def _held(output: Output, name: str) -> dict | None:
    """The claim `scores/<name>/scorer.json` holds, if any."""
    try:
        return json.loads(output.get(f"{SCORES}/{name}/scorer.json"))
    except FileNotFoundError:
        return None


def _claim(output: Output, spec: ScoreSpec, name: str, held: dict | None) -> None:
    """`scores/<name>/scorer.json`: the model this name's scores come from, written once."""
    claim = {"scorer": name, **scorer_identity(spec, name)}
    key = f"{SCORES}/{name}/scorer.json"
    if held is None and output.create(key, json.dumps(claim, indent=2).encode()):
        return
    held = held or json.loads(output.get(key))
    if held != claim:
        raise ConfigError(
            f"{output.url}/{key} holds {name} scores by {_by(held)}, not {_by(claim)}: remove "
            f"{output.url}/{SCORES}/{name} to score again."
        )


def _by(claim: dict) -> str:
    """A claim's model as its error says it: a hub model at its commit; a local one with its weights digest."""
    weights = claim.get("weights")
    return f"{claim.get('model')}" + (f" (weights {weights})" if weights else "")


def _stale(output: Output, name: str, shard: str, version: str, tables: set[str]) -> bool:
    """Whether `name` has no table for `shard`'s current manifest (`tables`: the names its listing holds;
    a table there is read for the manifest version it scored)."""
    key = table_key(name, shard)
    if posixpath.basename(key) not in tables:
        return True
    meta = output.read_with(key, lambda f: pq.read_schema(f).metadata or {})
    return meta.get(VERSION_KEY, b"").decode() != version


def _score_shard(output: Output, fmt, shard: str, version: str, names: list[str], scoring, batch: int):
    from PIL import Image

    rows = [
        r
        for r in read_manifests(output, [shard], ["id", "status", "image", "member", "size", "prompt", "num_frames"])[
            shard
        ]
        if r["status"] == "ok"
    ]
    stored, _ = fmt.read_back(output, shard, rows, None)
    missing = [r["image"] for r in rows if stored[r["id"]][1] is None]
    fetched = output.get_many(missing) if missing else {}
    results: list[tuple[dict, str | None]] = []
    for start in range(0, len(rows), batch):
        part = rows[start : start + batch]
        pictures = []
        for r in part:
            data = stored[r["id"]][1]
            data = data if data is not None else fetched[r["image"]]
            pictures.append(_Frames(data) if r.get("num_frames") else Image.open(io.BytesIO(data)).convert("RGB"))
        results += scoring.score(pictures, [r["prompt"] or "" for r in part])
    errors = 0
    for name in names:
        own = [(s.get(name), e if s.get(name) is None else None) for s, e in results]
        errors += sum(v is None for v, _ in own)
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
        if output.exists(key):  # scored from a manifest replaced since: this one's scores replace it
            output.put(key, sink.getvalue())
        else:
            output.create(key, sink.getvalue())  # another run's, if it won the race: the same scores
    return len(rows), errors


class _Frames:
    """A stored clip's frames, decoded, as the pass's scorers take a clip (`.frames`)."""

    def __init__(self, data: bytes):
        from fleetgen.workers.output.video import decode_frames

        self.frames = decode_frames(data)
