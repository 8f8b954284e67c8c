"""Workers kept between runs (`fleetgen.warm_workers()`, cluster/warm.py), on the session's Ray,
which is one such block (tests/conftest.py `ray_cluster`)."""

import io
import json
import os
import time

import pyarrow.parquet as pq
import pytest
import ray

from fleetgen.cluster import warm
from fleetgen.errors import ConfigError
from fleetgen.jobs.driver import run_job
from tests.conftest import make_job, write_prompts


def _pid(out, worker: str = "w0") -> int:
    return json.loads((out / "workers" / f"{worker}.json").read_text())["pid"]


def _shas(out) -> dict:
    return {r["id"]: r["sha256"] for r in pq.read_table(out / "shards").to_pylist()}


def _pipelines(actor) -> int:
    """In an actor's process: the diffusers pipelines still alive."""
    import gc

    from diffusers import DiffusionPipeline

    return sum(isinstance(o, DiffusionPipeline) for o in gc.get_objects())


def _run(prompts, model, out, **kw):
    summary = run_job(make_job(prompts, model, out, rows_per_shard=3, **kw), progress_stream=io.StringIO())
    assert summary.complete, summary.failures
    return summary


@pytest.fixture
def prompts(tmp_path):
    return write_prompts(tmp_path / "p.parquet", [f"a lighthouse number {i}" for i in range(6)])


def test_a_parked_worker_runs_the_next_job_as_a_fresh_one_would(
    ray_cluster, tiny_model, prompts, tmp_path, monkeypatch
):
    block = warm.scope()
    assert block is not None, "the session's Ray is a warm-workers block"
    _run(prompts, tiny_model, tmp_path / "first", workers=1)
    assert ray.get(block.parked[-1][1].__ray_call__.remote(_pipelines)) == 0  # closed: nothing of the job held
    reused = block.reused

    _run(prompts, tiny_model, tmp_path / "second", workers=1, steps=3)
    assert block.reused == reused + 1 and _pid(tmp_path / "second") == _pid(tmp_path / "first")

    # The same job outside a block: a fresh worker (the parked one is not taken), ended with its run;
    # the same bytes as the parked worker made (the second job's, not the first's). It needs a CPU that
    # workers an earlier test left parked may hold (a two-worker job's held both, and this run waited out
    # its placement timeout): those are killed, the second job's stays parked.
    for _, handle in block.parked[:-1]:
        ray.kill(handle, no_restart=True)
    del block.parked[:-1]
    monkeypatch.setattr(warm, "_scope", None)
    _run(prompts, tiny_model, tmp_path / "cold", workers=1, steps=3)
    assert _pid(tmp_path / "cold") != _pid(tmp_path / "second") and _gone({_pid(tmp_path / "cold")})
    assert _shas(tmp_path / "second") == _shas(tmp_path / "cold") != _shas(tmp_path / "first")


def test_parked_workers_that_ask_for_other_resources_are_killed_not_waited_for(
    ray_cluster, tiny_model, prompts, tmp_path
):
    block = warm.scope()
    _run(prompts, tiny_model, tmp_path / "two", workers=2)
    assert block.parked and ray.available_resources().get("CPU", 0) <= 1  # they hold their CPUs
    parked = {json.loads(p.read_text())["pid"] for p in (tmp_path / "two" / "workers").glob("*.json")}

    # one worker of 2 CPUs: it fits only once the parked ones are gone
    _run(prompts, tiny_model, tmp_path / "wide", workers=1, cpu_threads=2, placement_timeout=60)
    assert _pid(tmp_path / "wide") not in parked
    assert _gone(parked)


def test_a_parked_worker_that_died_or_was_restarted_is_passed_over(ray_cluster, tiny_model, prompts, tmp_path):
    """A parked worker Ray restarted (its process killed: a restart of its budget spent), or one dead
    for good (its node lost), is not handed to the next run: that run starts a fresh one and finishes."""
    block = warm.scope()
    _run(prompts, tiny_model, tmp_path / "first", workers=1)
    restarted = block.parked[-1][1]
    os.kill(_pid(tmp_path / "first"), 9)
    reused = block.reused
    _run(prompts, tiny_model, tmp_path / "second", workers=1)
    assert block.reused == reused and _pid(tmp_path / "second") != _pid(tmp_path / "first")
    assert restarted not in [h for _, h in block.parked]

    ray.kill(block.parked[-1][1], no_restart=True)  # the second run's worker, parked, then gone
    third = _run(prompts, tiny_model, tmp_path / "third", workers=1)
    assert block.reused == reused and [w["worker"] for w in third.workers] == ["w0"]
    assert _pid(tmp_path / "third") != _pid(tmp_path / "second")


def _gone(pids: set[int], within: float = 30) -> bool:
    deadline = time.monotonic() + within
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return not any(_alive(p) for p in pids)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"


def test_blocks_do_not_nest(ray_cluster):
    with pytest.raises(ConfigError, match="do not nest"), warm.warm_workers():
        pass
