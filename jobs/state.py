"""Resume and commit bookkeeping: the job record, what is committed, and the summary.

`OUT/job.json` is written first and holds the job's fingerprint (input, model, generation
settings). A rerun with the same fingerprint resumes: shards whose manifest exists are skipped.
A rerun with a different one refuses, unless `--overwrite`.
"""

from __future__ import annotations

import io
import json
import os
import platform
import time
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.parquet as pq

from fleetgen import __version__
from fleetgen.errors import StorageError
from fleetgen.scores import ScoreSpec
from fleetgen.workers.families.model_dir import is_hub_id, weights_digest
from fleetgen.workers.output.commit import COUNTS_KEY
from fleetgen.workers.output.layout import (
    CARD,
    COUNTS_INDEX,
    FLEET,
    JOB,
    PARTS,
    PLANS,
    SHARDS,
    STAGING,
    SUCCESS,
    SUMMARY,
    WIDS_INDEX,
    WORKERS,
    manifest_key,
)
from fleetgen.workers.output.parts import finish_attempts
from fleetgen.workers.output.storage import Output, parquet_schema, read_parquet
from fleetgen.workers.rows.shard import Columns

if TYPE_CHECKING:  # the commands that read a job's output (status, verify) import no torch
    from fleetgen.jobs.config import JobConfig
    from fleetgen.jobs.sharding import InputFile

# What --overwrite removes: everything fleetgen writes, nothing else under OUT.
_JOB_OBJECTS = (
    JOB,
    SUMMARY,
    SUCCESS,
    FLEET,
    CARD,
    WIDS_INDEX,
    COUNTS_INDEX,
    SHARDS,
    PARTS,
    WORKERS,
    PLANS,
    STAGING,
    "images",
    "data",
)


def model_identity(model: str, revision: str | None = None, variant: str | None = None) -> str:
    """A local directory by its absolute path (so `./m` and `/abs/m` agree), a hub id with the
    commit it was pinned to; and the weights variant."""
    if is_hub_id(model):
        name = f"{model}@{revision}" if revision else model
    else:
        name = str(Path(model).expanduser().resolve())
    return f"{name} (variant {variant})" if variant else name


def pinned(output: Output, model: str) -> tuple[str | None, dict[str, str]]:
    """What an earlier run of this job pinned, from one read of OUT's job.json (nothing where it holds
    none): the commit of its hub model (if it is `model`), and {hub id: commit} of its scorers' hub models."""
    try:
        record = json.loads(output.get(JOB))
    except (FileNotFoundError, ValueError):
        return None, {}
    config, scorers = record.get("config", {}), record.get("fingerprint", {}).get("scorers") or {}
    revision = config.get("revision") if config.get("model") == model else None
    return revision, commits([v for e in scorers.values() for v in (e.get("model", ""), *e.get("reads", ()))])


def commits(identities: list[str]) -> dict[str, str]:
    """{hub id: commit} from `model_identity` spellings (`org/name@sha`); local paths have none."""
    return dict(i.rsplit("@", 1) for i in identities if "@" in i and not i.startswith("/"))


def scorer_identity(spec: ScoreSpec, name: str) -> dict:
    """A scorer's model as job.json and a score table's claim record it: a local one by its path and
    weights, a hub one by its id at its pinned commit; the other hub models it reads (`reads`)."""
    model = dict(spec.scorers)[name]
    record = {
        "model": model_identity(model, spec.revision(model)),
        "weights": None if is_hub_id(model) else weights_digest(model),
    }
    others = [model_identity(m, spec.revision(m)) for m in spec.hub_models(name) if m != model]
    return {**record, "reads": others} if others else record


def fingerprint(config: JobConfig, files: list[InputFile], columns: Columns) -> dict:
    """Everything that changes which images a job makes. Execution settings (workers, batch,
    device) are left out: a job may resume on other hardware."""
    settings = config.generation.record()
    record = {
        "input": [{"url": f.url, "bytes": f.size, "rows": f.num_rows} for f in files],
        "model": model_identity(config.source.model, config.source.revision, config.source.variant),
        # a local directory's weights (a hub model is pinned to a commit instead): a rebuilt or
        # replaced model is another job, never mixed into this one's images
        "weights": None if is_hub_id(config.source.model) else weights_digest(config.source.model),
        "generation": {**settings, "rows_per_shard": config.rows_per_shard},
        # each scorer's model as the pipeline's is: a local one by its path and weights, a hub one by its commit
        "scorers": {name: scorer_identity(config.generation.score, name) for name in config.generation.score.names},
        "columns": columns.record(),
    }
    return json.loads(json.dumps(record))  # as job.json holds it (tuples are lists there), to compare


_NEW_DEFAULTS = {
    "generation": {
        "quantize": "none",
        "task": "text-to-image",
        "strength": None,
        "resize": "crop",
        "store_inputs": False,
        "store_frames": False,
        "num_frames": None,
        "fps": None,
        "video_format": "mp4",
        "crf": 18,
        "cache": "none",
        "attention": "exact",
        "scores": "none",
        "keep": "none",
        "best_of": 1,
        "rank_by": None,
    }
}  # settings newer than some jobs' job.json, as those made them


def _differences(old: dict, new: dict) -> list[str]:
    out = []
    for part in ("input", "model", "weights", "generation", "columns", "scorers"):
        a, b = old.get(part), new.get(part)
        if part == "scorers":  # a job from before scorers scored with none
            a, b = a or {}, b or {}
        if a == b:
            continue
        if part == "weights":
            out.append(f"the weights in {new.get('model')} changed since this job started (rebuilt or replaced)")
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            # a setting added since the job started (e.g. `quantize`) is its default in the old job
            a, b = ({**_NEW_DEFAULTS.get(part, {}), **x} for x in (a, b))
            keys = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
            out += [f"{part}.{k} differs: {a.get(k)} vs {b.get(k)}" for k in keys]
        elif part == "input":
            out.append("input differs (files, sizes or row counts)")
        else:
            out.append(f"{part} differs: {a} vs {b}")
    return out


def claim_output(
    output: Output, config: JobConfig, job_fingerprint: dict, shards_total: int = 0, family: dict | None = None
) -> dict:
    """Write `OUT/job.json`, or check that the job already there is this one."""
    if output.exists(JOB):
        try:
            existing = json.loads(output.get(JOB))
        except (json.JSONDecodeError, FileNotFoundError) as err:
            raise StorageError(f"{output.key_url(JOB)} is not a fleetgen job record: {err}") from err
        diffs = _differences(existing.get("fingerprint", {}), job_fingerprint)
        if not diffs:
            return existing
        if not config.overwrite:
            raise StorageError(
                f"{output.url} already holds a different job ({'; '.join(diffs[:3])}). "
                "Use a new `--output` or pass `--overwrite`."
            )
        for key in _JOB_OBJECTS:
            output.remove(key)
    record = {
        "fingerprint": job_fingerprint,
        "shards_total": shards_total,
        "config": config.to_dict(),
        "family": family,  # the pipeline family, its defaults, and which of them this job took
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "versions": versions(),
    }
    output.put(JOB, json.dumps(record, indent=2).encode())
    return record


def versions() -> dict:
    """What made the job, as job.json records it: read from the installed packages' metadata, so that
    a driver never imports torch or diffusers (seconds of CPU; the workers are what run them)."""
    return {
        "fleetgen": __version__,
        "python": platform.python_version(),
        "torch": _installed("torch"),
        "diffusers": _installed("diffusers"),
        "host": platform.node(),
        "pid": os.getpid(),
    }


def _installed(name: str) -> str | None:
    """A package's version from its metadata; None for one installed without it (a source build)."""
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def committed_shards(output: Output) -> set[str]:
    return {name.removesuffix(".parquet") for name in output.list(SHARDS, ".parquet")}


def read_manifests(output: Output, shard_ids: list[str], columns: list[str]) -> dict[str, list[dict]]:
    """Rows of committed manifests, fetched together (concurrently on object stores)."""
    blobs = output.get_many([manifest_key(s) for s in shard_ids])
    out = {}
    for shard, data in zip(shard_ids, blobs.values(), strict=True):
        have = set(parquet_schema(data).names)  # manifests of older versions lack newer columns
        out[shard] = read_parquet(data, [c for c in columns if c in have]).to_pylist()
    return out


def list_manifests(output: Output) -> dict[str, str]:
    """{shard: version} of every committed manifest, from one listing of `shards/` (the version, size
    and modification time or ETag, changes when a manifest is replaced, e.g. by `--retry-errors`)."""
    return {name.removesuffix(".parquet"): v for name, v in output.listing(SHARDS, ".parquet").items()}


_COUNTS_SCHEMA = pa.schema(
    [
        ("shard", pa.string()),
        ("version", pa.string()),
        ("rows", pa.int64()),
        ("images", pa.int64()),
        ("ok", pa.int64()),
        ("error", pa.int64()),
        ("filtered", pa.int64()),
    ]
)
COUNTS_FIELDS = ("rows", "images", "ok", "error", "filtered")


def _footer_counts(output: Output, shard: str) -> dict:
    """A manifest's counts from its footer (older manifests without them: from its status column)."""
    data = output.get(manifest_key(shard))  # a manifest is small (a row per image): one request
    raw = (parquet_schema(data).metadata or {}).get(COUNTS_KEY)
    if raw:
        return json.loads(raw)
    statuses = read_parquet(data, ["status"]).column("status").to_pylist()
    ids = {"ok": statuses.count("ok"), "error": statuses.count("error"), "filtered": statuses.count("filtered")}
    return {"rows": len(statuses), "images": len(statuses), **ids}


def shard_counts(
    output: Output, listing: dict[str, str] | None = None, threads: int = 32, known: dict[str, dict] | None = None
) -> dict[str, dict]:
    """{shard: {"rows", "images", "ok", "error", "filtered"}} for every committed shard, without
    reading manifest rows: `OUT/counts.parquet` (written at the end of each run) holds the counts of
    the manifests it saw, keyed by their version in the listing; only manifests committed or
    replaced since are opened, and then only their footers, concurrently; `known`: counts the
    caller has already (a worker reported them with the version in `listing`)."""
    listing = list_manifests(output) if listing is None else listing
    cached: dict[str, dict] = {s: c for s, c in (known or {}).items() if s in listing}
    try:
        index = output.read_parquet(COUNTS_INDEX)
        for row in index.to_pylist():
            if listing.get(row["shard"]) == row["version"] and row["shard"] not in cached:
                cached[row["shard"]] = {k: row[k] for k in COUNTS_FIELDS}
    except (FileNotFoundError, pa.ArrowException):
        pass  # none yet, or from another version: counted from the footers
    todo = sorted(set(listing) - set(cached))
    if todo:
        with ThreadPoolExecutor(max_workers=min(threads, len(todo))) as pool:
            cached.update(zip(todo, pool.map(lambda s: _footer_counts(output, s), todo), strict=True))
    return {s: cached[s] for s in sorted(listing)}


def write_counts_index(output: Output, counts: dict[str, dict], listing: dict[str, str] | None = None) -> None:
    """`OUT/counts.parquet`: the counts of every committed manifest at its current version."""
    listing = list_manifests(output) if listing is None else listing
    rows = [
        {"shard": s, "version": listing[s], **{k: c.get(k, 0) for k in COUNTS_FIELDS}}
        for s, c in counts.items()
        if s in listing
    ]
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows, schema=_COUNTS_SCHEMA), buf)
    output.put(COUNTS_INDEX, buf.getvalue())


def sweep(output: Output, discard: bool) -> None:
    """Before this run's workers start and after they are closed: finish the commit of attempts
    that won but died moving their objects, and remove temporary files of local writers that died.
    `discard` (only when every shard is committed): remove every other attempt's staging too — a
    dead driver's workers may still be running until then (workers/output/parts.py, `finish_attempts`)."""
    finish_attempts(output, discard_others=discard)
    # Local writers put an object as a temporary file renamed into place: a writer killed between the two
    # leaves the temporary file. Manifests and workers' status records are written so (images and data
    # reach their keys by a rename or a copy from staging: never partial). A live writer whose file this
    # removed fails its write; status records are best effort (a worker dying is the likelier writer).
    for prefix in (SHARDS, WORKERS, PLANS):
        output.sweep_tmp(prefix)
