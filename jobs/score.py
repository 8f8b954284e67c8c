"""`fleetgen score OUT --score NAME[=MODEL],...`: score a job's stored images after the fact, so one
render can be scored by several models later. Each scorer's scores of a committed shard are one table,
`OUT/scores/<name>/<shard>.parquet` (`id`, `score_<name>`, `score_error`; the manifest version it read
in its metadata), committed create-if-absent as the shards are: a rerun skips the tables there, scores
a shard whose manifest was replaced since (`--retry-errors`) again, and never keeps two. Each scorer's
model is claimed in `OUT/scores/<name>/_scorer.json` (a hub model at the commit it was pinned to, which
a rerun keeps): another model's scores under the same name are refused (one line, exit 2). Any output
format, any store: the images are read back as `verify` reads them (workers/score_tables.py).

Runs in this process, on its device (`--device`), a batch of images at a time; or, with `--workers N`,
on N Ray workers (cluster/score_pool.py: a GPU each where the cluster has them), each taking the next
shard as it is free. A clip is scored on frames evenly spaced over it, as in the pass.
"""

from __future__ import annotations

import json
import os
import posixpath
import time
from dataclasses import dataclass, field, replace

import pyarrow.parquet as pq

from fleetgen.errors import ConfigError, FleetgenError
from fleetgen.jobs.hub import HUB_ENV
from fleetgen.jobs.state import commits, list_manifests, scorer_identity
from fleetgen.jobs.validate import check_scorers
from fleetgen.scores import ScoreSpec, parse_scores
from fleetgen.workers.output.formats import PLUGINS_ENV
from fleetgen.workers.output.layout import JOB
from fleetgen.workers.output.policy import STORAGE_ENV
from fleetgen.workers.output.storage import Output
from fleetgen.workers.score_tables import BATCH, SCORES, VERSION_KEY, ShardScorer, table_key


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


def score_job(
    url: str, score: str | ScoreSpec, device: str = "auto", batch: int = BATCH, say=print, workers: int = 0
) -> ScoreSummary:
    """Score every committed shard of the job at `url` not scored yet by each of `score`'s scorers: in
    this process (`workers` 0), or on `workers` Ray workers."""
    from fleetgen.jobs.hub import pin_scorers

    output = Output(url)
    spec = parse_scores(score)
    if not spec:
        raise ConfigError("`fleetgen score` needs `--score NAME[=MODEL],...`.")
    if workers < 0:
        raise ConfigError(f"`--workers` must be 0 (this process) or more; got {workers}.")
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
    todo: dict[str, list[str]] = {}
    tables = {n: set(output.list(f"{SCORES}/{n}", ".parquet")) for n in spec.names}  # one listing per scorer
    for shard, version in sorted(committed.items()):
        names = [n for n in spec.names if _stale(output, n, shard, version, tables[n])]
        if names:
            todo[shard] = names
        else:
            summary.shards_skipped += 1
    if todo:
        used = replace(spec, scorers=tuple((n, m) for n, m in spec.scorers if any(n in v for v in todo.values())))
        work = [(shard, committed[shard], names) for shard, names in todo.items()]
        scorer = (output.url, used, generation["output_format"], device, batch)
        done = _on_ray(work, scorer, workers, device) if workers else _here(work, scorer)
        for i, (shard, images, errors, failure) in enumerate(done):
            if failure is not None:
                summary.failures[shard] = failure
                continue
            summary.shards_scored += 1
            summary.images += images
            summary.errors += errors
            say(f"[fleetgen] scored {shard} ({i + 1}/{len(todo)}): {images} images")
    summary.seconds = time.perf_counter() - started
    return summary


def _here(work: list[tuple[str, str, list[str]]], scorer: tuple):
    """Each shard scored in this process: (shard, images, errors, why it was not scored or None)."""
    scoring = ShardScorer(*scorer)
    for shard, version, names in work:
        yield scoring.attempt(shard, version, names)


def _on_ray(work: list[tuple[str, str, list[str]]], scorer: tuple, workers: int, device: str):
    """Each shard scored on one of `workers` Ray workers; a worker lost mid-run leaves its shards (and
    those not started) unscored: a rerun scores them."""
    from fleetgen.cluster.score_pool import score_shards

    env = {k: os.environ[k] for k in (*HUB_ENV, *STORAGE_ENV, PLUGINS_ENV) if k in os.environ}
    seen = set()
    try:
        for result in score_shards(work, scorer, workers, device, env):
            seen.add(result[0])
            yield result
    except FleetgenError as err:
        for shard, *_ in work:
            if shard not in seen:
                yield shard, 0, 0, str(err)[:300]


def _held(output: Output, name: str) -> dict | None:
    """The claim `scores/<name>/_scorer.json` holds, if any (`scorer.json`, the name earlier runs wrote, is read too)."""
    for key in (claim_key(name), f"{SCORES}/{name}/scorer.json"):
        try:
            return json.loads(output.get(key))
        except FileNotFoundError:
            continue
    return None


def claim_key(name: str) -> str:
    """Where a scorer's model is claimed: `_`-prefixed, so that `pyarrow.dataset.dataset("OUT/scores/<name>")`
    (which leaves `_` and `.` files out) reads the tables alone."""
    return f"{SCORES}/{name}/_scorer.json"


def _claim(output: Output, spec: ScoreSpec, name: str, held: dict | None) -> None:
    """`scores/<name>/_scorer.json`: the model this name's scores come from, written once."""
    claim = {"scorer": name, **scorer_identity(spec, name)}
    key = claim_key(name)
    if held is None and output.create(key, json.dumps(claim, indent=2).encode()):
        return
    held = held or json.loads(output.get(key))
    if held != claim:
        raise ConfigError(
            f"{output.url}/{SCORES}/{name} holds {name} scores by {_by(held)}, not {_by(claim)}: remove "
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
