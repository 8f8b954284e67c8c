"""`fleetgen score --workers N`: a job's shards scored on N Ray workers, each with the scorers loaded
once on its own device (a GPU each where the cluster has GPUs and `--device` is not `cpu`), each taking
the next shard as it is free. What a worker does with a shard is workers/score_tables.py's, as in the
`fleetgen score` process; committing a table is create-if-absent, so a shard scored twice (a worker
restarted by Ray, two runs at once) keeps one table.
"""

from __future__ import annotations

from collections.abc import Iterator

import ray
from ray.util import ActorPool

from fleetgen.cluster.connect import connect, disconnect
from fleetgen.cluster.warm import free_parked
from fleetgen.errors import ClusterError
from fleetgen.imports import paused_gc

Result = tuple[str, int, int, str | None]  # (shard, images, errors, why it was not scored or None)


@ray.remote
class ScoreWorker:
    def __init__(self, *scorer):
        with paused_gc():  # the process's start is nearly all imports (fleetgen/imports.py)
            from fleetgen.workers.score_tables import ShardScorer

            self.scorer = ShardScorer(*scorer)

    def score(self, shard: str, version: str, names: list[str]) -> Result:
        return self.scorer.attempt(shard, version, names)


def score_shards(
    work: list[tuple[str, str, list[str]]], scorer: tuple, workers: int, device: str, env_vars: dict[str, str]
) -> Iterator[Result]:
    """Each of `work`'s (shard, manifest version, scorer names) scored on one of `workers` Ray workers
    (`scorer`: `ShardScorer`'s arguments), as each finishes. `ClusterError` when a worker is lost or
    cannot start: the shards it had not reported are left for a rerun."""
    shape = connect()
    free_parked()  # parked workers (cluster/warm.py) hold what the scorers may need
    gpus = 1 if device != "cpu" and shape.gpus else 0
    options = {"num_cpus": 1, "num_gpus": gpus, **({"runtime_env": {"env_vars": env_vars}} if env_vars else {})}
    actors = [ScoreWorker.options(**options).remote(*scorer) for _ in range(max(1, min(workers, len(work))))]
    try:
        pool = ActorPool(actors)
        yield from pool.map_unordered(lambda actor, item: actor.score.remote(*item), work)
    except ray.exceptions.RayError as err:
        why = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ClusterError(
            f"a scoring worker was lost ({type(err).__name__}: {why[:200]}); rerun to score the rest"
        ) from None
    finally:
        for actor in actors:
            ray.kill(actor)
        disconnect()
