"""Whole jobs on a real local Ray against a flaky S3 (tests/faulty_store.py in front of moto): every
row exactly once, no stray object, `verify --deep` clean, whatever the store did; an outage ends in
one line and exit 1, and a rerun finishes. Paths as typed, a rebuilt model, counts that agree."""

from __future__ import annotations

import functools
import io
import threading
import time

import pytest

from bench.chaos import check
from fleetgen.cli import main
from fleetgen.jobs.driver import run_job
from tests.conftest import fast_settings, make_job, run_args, run_one_shard, write_prompts

pytestmark = pytest.mark.chaos
ROWS = 64


job = functools.partial(make_job, rows_per_shard=8, max_batch=4, workers=2)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_model, ray_cluster):
    """The prompts and the sha256 of each image, made shard by shard on a local disk by a worker in
    this process with the jobs' own settings (one torch thread, batches of 4 in shards of 8): what
    every faulted run must match, byte for byte."""
    root = tmp_path_factory.mktemp("flaky")
    prompts = write_prompts(root / "p.parquet", [f"flaky store prompt {i}" for i in range(ROWS)])
    worker, clean = run_one_shard(
        tiny_model, root / "clean", prompts, fast_settings(), rows=8, shards=range(ROWS // 8), max_batch=4, threads=1
    )
    worker.close()
    return prompts, {k: r["sha256"] for k, r in clean.items()}


@pytest.fixture
def quick_retries(monkeypatch):
    """The storage policy's backoff at 50 ms, here and in the workers (the driver hands them its env)."""
    from fleetgen.workers.output import policy

    monkeypatch.setattr(policy, "BACKOFF", 0.05)
    monkeypatch.setenv("FLEETGEN_STORAGE_BACKOFF", "0.05")


def s3_bucket(name: str) -> str:
    import s3fs

    fs = s3fs.S3FileSystem()
    if not fs.exists(name):
        fs.mkdir(name)
    return f"s3://{name}/out"


CLEAN = {"missing": 0, "duplicates": 0, "stray_objects": 0, "sha_mismatches": 0, "tmp_files": 0, "verify_deep": "clean"}


def _first_commit(direct, out: str, timeout: float = 300) -> None:
    """Wait, asking the store's server itself (`direct`, not through the faults), until a shard of
    the job at `out` is committed."""
    path = out.split("://", 1)[1]
    deadline = time.monotonic() + timeout
    while not direct.glob(f"{path}/shards/*.parquet"):
        assert time.monotonic() < deadline, "no shard committed"
        time.sleep(0.05)
        direct.invalidate_cache()


@pytest.fixture(params=["s3", "gcs", "azure"])
def object_store(request, _stores_env):
    """S3, GCS and Azure in turn, each behind its fault proxy (tests/stores.py)."""
    store = request.getfixturevalue(f"_{request.param}_stack")
    store = _stores_env[request.param] if request.param == "s3" else store
    store.proxy.reset()
    yield store
    store.proxy.reset()


def test_a_run_at_5_percent_faults_with_a_30_percent_burst_loses_nothing(
    reference, tiny_model, object_store, quick_retries
):
    """A job from and to each store (its prompts read from it, its outputs written to it), 5 % of
    requests faulted from the start (every kind: 503, 500, resets before and after the request is
    applied, latency), 30 % for 3 s after the first commit. More seeds, and each scenario alone:
    bench/flaky_store.py (BENCHMARKS.md)."""
    prompts, clean = reference
    out = object_store.location(f"flaky-5pct-{object_store.name}")
    source = out.rsplit("/", 1)[0] + "/prompts.parquet"
    object_store.filesystem().put_file(str(prompts), source.split("://", 1)[1])
    faulty_store = object_store.proxy
    faulty_store.delay = 0.2
    faulty_store.reset(rate=0.05, seed=1)
    burst_faults = []

    def burst():
        _first_commit(object_store.filesystem(direct=True), out)
        before = faulty_store.faulted()
        faulty_store.rate = 0.3
        time.sleep(3)
        faulty_store.rate = 0.05
        burst_faults.append(faulty_store.faulted() - before)

    thread = threading.Thread(target=burst, daemon=True)
    thread.start()
    summary = run_job(job(source, tiny_model, out, max_attempts=5), progress_stream=io.StringIO())
    thread.join()
    faulted, requests, kinds = faulty_store.faulted(), faulty_store.counts["requests"], dict(faulty_store.counts)
    faulty_store.reset()
    assert faulted > 10 and requests > 100 and burst_faults and burst_faults[0] > 0, (faulted, requests, kinds)
    # the summary's error and failures whole (its repr is cut short in pytest's report)
    assert summary.complete and summary.images_ok == ROWS, (summary.error, summary.failures, faulted, kinds)
    assert check(out, clean) == {"rows": ROWS, **CLEAN}


def test_the_store_down_mid_run_ends_in_one_line_and_a_rerun_finishes(
    reference, tiny_model, faulty_store, _stores_env, quick_retries, capsys, monkeypatch
):
    """The store goes away after the first commit and stays away: the driver rides it out for the
    lock's lease (here 4 s, as `fleetgen.jobs.lock.STALE`; 60 s in a job), then stops as on SIGTERM —
    workers closed, no traceback, exit 1 with the reason in one line. The store back, a rerun of the
    same command finishes the job, every row once."""

    import fleetgen.jobs.lock

    monkeypatch.setattr(fleetgen.jobs.lock, "HEARTBEAT", 0.5)
    monkeypatch.setattr(fleetgen.jobs.lock, "STALE", 4.0)
    monkeypatch.setenv("FLEETGEN_STORAGE_ATTEMPTS", "2")
    prompts, clean = reference
    out = s3_bucket("flaky-outage")
    args = ["run", *run_args(str(prompts), out, tiny_model, rows_per_shard="8", max_attempts="5")]

    def outage():
        _first_commit(_stores_env["s3"].filesystem(direct=True), out)
        faulty_store.down = True

    thread = threading.Thread(target=outage, daemon=True)
    thread.start()
    code = main(args)
    thread.join()
    faulty_store.reset()
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("fleetgen: error: the output store has not taken a write for "), last
    assert "EndpointConnectionError" in last and last.endswith("rerun the same command to resume"), last
    assert "stopping: the output store has not taken a write" in err
    time.sleep(4)  # the lock left behind is this (live) process's: a rerun takes it over once its lease is out
    assert main(args) == 0  # the store is back: the rerun resumes and finishes
    assert check(out, clean) == {"rows": ROWS, **CLEAN}


def test_a_job_run_as_dotdot_lands_where_every_command_looks(reference, tiny_model, tmp_path, monkeypatch, capsys):
    """Run from `a/` with `--output ../out` (once: images under `out/00/<attempt>/...`, and verify
    calling all of them missing): the layout is the usual one and status/verify agree on it."""
    prompts, clean = reference
    (tmp_path / "a").mkdir()
    (tmp_path / "p.parquet").write_bytes(prompts.read_bytes())
    monkeypatch.chdir(tmp_path / "a")
    assert main(["run", *run_args("../p.parquet", "../out/", tiny_model, rows_per_shard="8", workers="1")]) == 0
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == [
        "README.md",
        "_SUCCESS",
        "counts.parquet",
        "fleet.json",
        "images",
        "job.json",
        "shards",
        "summary.json",
        "workers",
    ]
    assert len(list((out / "images").glob("shard-*/*.png"))) == ROWS
    assert check(out, clean) == {"rows": ROWS, **CLEAN}
    for name in ("../out", "../out/", f"file://{out}", str(out)):
        assert main(["verify", name]) == 0 and main(["status", name]) == 0
    assert main(["verify", "../out", "--fix"]) == 0
    assert len(list((out / "images").glob("shard-*/*.png"))) == ROWS
    capsys.readouterr()


def test_a_rebuilt_model_refuses_to_resume_and_progress_counts_as_the_summary(
    tiny_model, tmp_path, ray_cluster, capsys
):
    from fleetgen.workers.tiny import write_tiny_model

    model = str(write_tiny_model(tmp_path / "model", seed=0))
    prompts = write_prompts(tmp_path / "p.parquet", ["a cat", None, "a dog", "", "an owl", "a fox"])
    stream = io.StringIO()
    summary = run_job(job(prompts, model, tmp_path / "out"), progress_stream=stream)
    assert summary.complete and summary.images_error == 2 and summary.images_ok == 4
    assert stream.getvalue().strip().splitlines()[-1].endswith("(2 row errors, 0 shards failed)")
    args = ["run", *run_args(str(prompts), str(tmp_path / "out"), model, rows_per_shard="8")]
    assert main(args) == 0  # the same model: a rerun resumes (nothing to do)
    write_tiny_model(tmp_path / "model", seed=1)  # rebuilt in place: same files, same sizes, other weights
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "already holds a different job (the weights in" in err and "changed since this job started" in err
    assert "pass `--overwrite`" in err
