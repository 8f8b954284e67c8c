"""The Ray Data stage under what users hand it (cluster/ray_data.py, fleetgen/ray_data.py): a pool that
would starve Ray Data's reads is refused before anything runs; rows with a seed and no id get ids of their
own content, the same over any blocks and batches; a repeated or null id is an error row; a batch that
keeps killing its actor fails the stage after a bounded number of restarts; nothing of the node's copy of
the weights is left once the stage's driver is done."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pytest

import fleetgen.ray_data
from fleetgen.errors import ConfigError
from fleetgen.workers.output.fields import clip_names
from tests.conftest import ROOT
from tests.e2e.test_ray_data import OPTIONS, dataset, digest


def test_a_pool_that_takes_every_cpu_is_refused_naming_the_numbers(tiny_model, ray_cluster):
    """`workers=2` on the session's 2-CPU Ray would hold both CPUs and leave Ray Data's read tasks none (a
    hang with no error): refused by `generate` itself, with the numbers and what to pass instead. An
    autoscaling pool up to 2 is capped at 1, saying so."""
    import io

    ds = dataset(pa.table({"id": ["a"], "prompt": ["a fox"]}))
    with pytest.raises(ConfigError) as err:
        fleetgen.ray_data.generate(ds, tiny_model, workers=2, **OPTIONS)
    said = str(err.value)
    assert "`workers=2`: 2 actor(s) of 1 CPU(s) each take 2 of the Ray cluster's 2 CPUs" in said, said
    assert "the stage would wait forever. Pass `workers=1` or fewer" in said
    with pytest.raises(ConfigError, match=r"`concurrency=\(2, 2\)`: 2 actor\(s\)"):
        fleetgen.ray_data.generate(ds, tiny_model, concurrency=(2, 2), **OPTIONS)
    lines = io.StringIO()
    fleetgen.ray_data.generate(ds, tiny_model, concurrency=(1, 2), progress=lines, **OPTIONS)
    assert "the pool grows to 1 actor(s), not 2" in lines.getvalue()


def test_seed_only_rows_get_the_same_unique_ids_over_any_blocks(tiny_model, ray_cluster):
    """Rows with a seed column (one null) and no id, in three blocks of two-row batches and then in two
    blocks of three-row batches: each row's id is its content's, the same in both runs and unique; its
    seed (the null one's derived from that id) too; two rows alike are one id, the second an error row.
    Image rows carry no clip fields."""
    prompts = ["a fox", "an owl", "a ship", "a cat", "rain", "a fox"]
    seeds = pa.array([7, 8, None, 10, 11, 12], pa.int64())
    table = pa.table({"prompt": prompts, "seed": seeds, "label": list("abcdef")})

    def run(blocks: int, batch: int) -> dict[str, dict]:
        rows = fleetgen.ray_data.generate(
            dataset(table).repartition(blocks), tiny_model, batch_rows=batch, **OPTIONS
        ).take_all()
        assert len(rows) == 6
        return {r["label"]: r for r in rows}

    first, second = run(3, 2), run(2, 3)
    for label in "abcdef":
        a, b = first[label], second[label]
        assert a["status"] == "ok" and a["id"] == b["id"] and a["seed"] == b["seed"], (a, b)
        assert len(a["id"]) == 16 and digest(a["image"]) == a["sha256"]
    assert len({first[x]["id"] for x in "abcdef"}) == 6
    assert first["c"]["seed"] is not None  # the null seed: derived from the row's id, not its place
    assert not set(clip_names()) & set(first["a"])


def test_a_repeated_or_null_id_is_an_error_row(tiny_model, ray_cluster):
    """One batch with an id twice and two null ids: the second of the pair and each null are error rows in
    the stage's words, with the id as the input has it; the other rows are made; the pipeline succeeds."""
    table = pa.table({"id": ["a", "b", "a", None, None, "c"], "prompt": ["p0", "p1", "p2", "p3", "p4", "p5"]})
    rows = fleetgen.ray_data.generate(dataset(table), tiny_model, batch_rows=6, **OPTIONS).take_all()
    by_prompt = {r["prompt"]: r for r in rows}
    assert [by_prompt[p]["status"] for p in ("p0", "p1", "p5")] == ["ok"] * 3
    repeated = by_prompt["p2"]
    assert repeated["status"] == "error" and repeated["id"] == "a" and repeated["image"] is None
    assert "id `a` repeats row 0's of this batch: each row of a stage needs an id of its own" in repeated["error"]
    for p in ("p3", "p4"):
        assert by_prompt[p]["status"] == "error" and "id is null" in by_prompt[p]["error"]


@pytest.mark.chaos  # actors killed for real
def test_a_batch_that_keeps_killing_its_actor_fails_the_stage(tiny_model, tmp_path, ray_cluster):
    """A block whose second batch kills the actor that makes it (SIGKILL, as a host OOM does): with
    `max_restarts=1`, the actor is started twice and the stage fails, instead of reloading the model for
    good; the actor's record at `stats` counts its restart and both lives' images (each made the first batch)."""
    log = tmp_path / "deaths"
    env = {"FLEETGEN_TESTS_DIE_ON": "poison", "FLEETGEN_TESTS_DIE_LOG": str(log)}
    table = pa.table({"id": ["a", "b"], "prompt": ["a fox", "poison"]})
    stage = fleetgen.ray_data.generate(
        dataset(table),
        tiny_model,
        stats=str(tmp_path / "stats"),
        ray_remote_args={"runtime_env": {"env_vars": env}, "max_restarts": 1, "max_task_retries": 1},
        batch_rows=1,
        **OPTIONS,
    )
    started = time.monotonic()
    with pytest.raises(Exception) as err:  # noqa: PT011 - Ray Data's own error, whatever its class
        stage.take_all()
    assert time.monotonic() - started < 240
    assert "died" in str(err.value).lower() or "actor" in str(err.value).lower(), str(err.value)[-2000:]
    deaths = log.read_text().split()
    assert len(deaths) == 2, deaths  # its first life and one restart
    (record,) = (tmp_path / "stats" / "workers").glob("rd-*.json")
    last = json.loads(record.read_text())
    assert last.get("restarts") == 1 and last["stats"]["images"] == 2, last.get("stats")


STAGE_THEN_SHUTDOWN = """
import os, sys, json
import pyarrow as pa, ray
import fleetgen.ray_data
ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
# rows enough that the actor is still making them when the first is taken: with 3, in a loaded suite the
# copy was once gone before the listing (likely the actor had made all three and Ray Data ended it, idle,
# gracefully: its exit handler removes the copy), and the test saw nothing of the killed actor's case
table = pa.table({"id": [f"r{i}" for i in range(24)], "prompt": [f"a fox {i}" for i in range(24)]})
rows = fleetgen.ray_data.generate(
    ray.data.from_arrow(table).repartition(24), sys.argv[1], steps=2, width=32, height=32, max_batch=4,
    cpu_threads=1, workers=1, host_copy="node", batch_rows=1,
).take(1)  # the rest never made: Ray Data kills the actor, which runs no exit handler
mine = os.path.join(os.environ["FLEETGEN_SHM_DIR"], f"fleetgen-{os.geteuid()}")
print(json.dumps({"ok": sum(r["status"] == "ok" for r in rows), "during": sorted(os.listdir(mine))}), flush=True)
ray.shutdown()
"""


@pytest.mark.cluster  # a Ray of its own, started and shut down by the script
def test_no_copy_of_the_weights_is_left_after_a_stage_and_shutdown(tiny_model, tmp_path):
    """A script runs a stage with the node's copy on a local Ray, takes its first row (Ray Data then kills
    the actor, which runs no exit handler: the copy is still there) and calls `ray.shutdown()`: when it
    has exited, this user's directory of segments holds nothing."""
    base = tmp_path / "shm"
    base.mkdir(mode=0o1777)
    env = {**os.environ, "FLEETGEN_SHM_DIR": str(base), "PYTHONPATH": str(ROOT)}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run(
        [sys.executable, "-c", STAGE_THEN_SHUTDOWN, tiny_model],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["ok"] == 1 and len(report["during"]) == 4  # the killed actor's copy, left
    mine = Path(base / f"fleetgen-{os.geteuid()}")
    assert mine.is_dir() and sorted(os.listdir(mine)) == [], (report, os.listdir(mine))
