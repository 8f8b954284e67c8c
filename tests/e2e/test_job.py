"""Whole jobs on a real local Ray (one per test run): dispatch, determinism, resume, refusal, S3."""

import functools
import hashlib
import io
import json
import os
import shutil

import pyarrow.parquet as pq
import pytest

from fleetgen.cli import main
from fleetgen.cluster.warm import free_parked
from fleetgen.errors import StorageError
from fleetgen.jobs.config import JobConfig, validate
from fleetgen.jobs.driver import run_job
from fleetgen.jobs.state import list_manifests
from fleetgen.workers.output.storage import Output
from tests.conftest import FAST, fast_settings, make_job, run_one_shard, write_prompts

N = 12
NATIVE = {"width": 64, "height": 64}  # the tiny model's own size (the tests' FAST is smaller)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "p.parquet"
    return str(write_prompts(path, [f"prompt number {i}" for i in range(N)], row_group_size=6))


job = functools.partial(make_job, rows_per_shard=3, max_batch=3)


def shas(out) -> dict:
    rows = pq.read_table(os.path.join(out, "shards")).to_pylist()
    return {r["id"]: r["sha256"] for r in rows}


@pytest.fixture(scope="module")
def finished(ray_cluster, tiny_model, prompts, tmp_path_factory):
    """A finished two-worker job (its summary and progress log), run once for this module's tests;
    a test that changes it works on a copy (`copy_of`)."""
    out = tmp_path_factory.mktemp("finished") / "two"
    log = io.StringIO()
    summary = run_job(job(prompts, tiny_model, out, workers=2), progress_stream=log, progress_interval=0)
    return out, summary, log.getvalue()


def copy_of(finished, to):
    """A copy of the finished job's output (files keep their times), for a test to resume or refuse."""
    shutil.copytree(finished[0], to)
    return to


def test_two_workers_one_worker_same_images(finished, tiny_model, prompts, tmp_path):
    two_out, two, log = finished
    assert two.complete and (two.images_ok, two.images_error, two.shards_total) == (N, 0, 4)
    # Both were asked for; which makes what is the pool's (one ready after the other took every shard
    # takes none: CI saw it at 12 rows). Every image is made once, and the bytes are one worker's.
    assert {w["worker"] for w in two.workers} <= {"w0", "w1"} and two.workers
    assert sum(w["images"] for w in two.workers) == N
    assert (two_out / "_SUCCESS").exists()
    assert json.loads((two_out / "summary.json").read_text())["complete"] is True
    job_json = json.loads((two_out / "job.json").read_text())
    assert job_json["fingerprint"]["input"][0]["rows"] == N
    lines = log.splitlines()
    assert any("shards 4/4  rows 12/12" in line for line in lines), lines  # plain lines when not a TTY
    assert all(line.startswith("[fleetgen] ") for line in lines)

    # each worker mapped the node's one copy of the weights (`--host-copy node`, the default); the job's
    # end left nothing in the node's shared memory (the tests' FLEETGEN_SHM_DIR)
    from fleetgen.jobs.status import job_state, status_text

    copies = [json.loads(p.read_text())["host_copy"] for p in (two_out / "workers").glob("w*.json")]
    assert copies and all(c["shared"] and c["role"] in ("wrote", "mapped") and c["own_bytes"] == 0 for c in copies)
    assert "weights: the node's copy" in status_text(job_state(str(two_out)))
    mine = os.path.join(os.environ["FLEETGEN_SHM_DIR"], f"fleetgen-{os.geteuid()}")  # this user's directory of copies
    assert not os.path.exists(mine) or not os.listdir(mine)

    one = run_job(
        job(prompts, tiny_model, tmp_path / "one", workers=1, host_copy="worker"), progress_stream=io.StringIO()
    )
    assert one.complete
    assert shas(tmp_path / "one") == shas(two_out)  # a copy of its own: the same pixels
    assert len(set(shas(tmp_path / "one").values())) == N  # and the images differ from each other


def test_resume_redoes_only_missing_shards(finished, tiny_model, prompts, tmp_path):
    out = copy_of(finished, tmp_path / "out")
    before = shas(out)
    kept = out / "images" / "shard-00000" / "00000-000000000.png"
    kept_mtime = kept.stat().st_mtime_ns
    redone = out / "images" / "shard-00002" / "00000-000000006.png"
    redone_mtime = redone.stat().st_mtime_ns
    for shard in ("shard-00001", "shard-00002"):
        (out / "shards" / f"{shard}.parquet").unlink()
    (out / "_SUCCESS").unlink()

    again = run_job(job(prompts, tiny_model, out, workers=2), progress_stream=io.StringIO())
    assert again.complete and again.shards_skipped == 2 and again.images_ok == N
    assert sum(w["images"] for w in again.workers) == 6  # only the two deleted shards' rows
    assert shas(out) == before
    assert kept.stat().st_mtime_ns == kept_mtime  # committed shard untouched
    assert redone.stat().st_mtime_ns != redone_mtime  # uncommitted shard overwritten, not duplicated
    assert sorted(p.name for p in (out / "images" / "shard-00002").iterdir()) == [
        "00000-000000006.png",
        "00000-000000007.png",
        "00000-000000008.png",
    ]

    index = pq.read_table(out / "counts.parquet")  # the versions workers reported are the listing's
    assert dict(zip(index["shard"].to_pylist(), index["version"].to_pylist(), strict=True)) == list_manifests(
        Output(str(out))
    )
    # all committed: no workers start, nothing is generated
    done = run_job(job(prompts, tiny_model, out, workers=2), progress_stream=io.StringIO())
    assert done.complete and done.shards_skipped == 4 and done.workers == []


def test_other_job_refuses_unless_overwrite(finished, tiny_model, prompts, tmp_path):
    out = copy_of(finished, tmp_path / "out")
    with pytest.raises(StorageError) as err:
        run_job(job(prompts, tiny_model, out, workers=1, steps=3), progress_stream=io.StringIO())
    assert "already holds a different job (generation.steps differs: 2 vs 3)" in str(err.value)
    assert "--overwrite" in str(err.value)
    replaced = run_job(job(prompts, tiny_model, out, workers=1, steps=3, overwrite=True), progress_stream=io.StringIO())
    assert replaced.complete and replaced.shards_skipped == 0
    assert json.loads((out / "job.json").read_text())["fingerprint"]["generation"]["steps"] == 3


def test_cli_run_with_config_file_and_webdataset(ray_cluster, tiny_model, prompts, tmp_path, capsys):
    cfg = tmp_path / "job.toml"
    cfg.write_text(
        f'model = "{tiny_model}"\nsteps = 2\nwidth = 64\nheight = 64\nrows-per-shard = 6\n'
        'output_format = "webdataset"\ndevice = "cpu"\n'
    )
    code = main(
        [
            "run",
            "--input",
            prompts,
            "--output",
            str(tmp_path / "out"),
            "--config",
            str(cfg),
            "--workers",
            "2",
            "--max-batch",
            "2",
        ]
    )
    assert code == 0
    assert "12 images (0 row errors)" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "out" / "data").iterdir()) == ["shard-00000.tar", "shard-00001.tar"]


def test_cli_errors_exit_2_with_message(tmp_path, tiny_model, capsys):
    code = main(
        ["run", "--input", str(tmp_path / "none.parquet"), "--output", str(tmp_path / "o"), "--model", tiny_model]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("fleetgen: error: `--input`") and "does not exist" in err
    assert not (tmp_path / "o").exists()  # refused before anything was written
    code = main(["run", "--input", "x", "--output", "o", "--model", "m", "--steps", "0"])
    assert code == 2
    assert "`--steps` must be 1 or more, got `0`." in capsys.readouterr().err


def test_s3_input_and_output(ray_cluster, s3_server, tiny_model, tmp_path, monkeypatch):
    """... and the driver counts without listing shards/ again or opening a manifest: each commit
    reports its counts and its manifest's version, which is the version a listing shows."""
    import s3fs

    import fleetgen.jobs.state

    def never(output, shard):
        raise AssertionError(f"the driver opened the manifest of {shard}")

    monkeypatch.setattr(fleetgen.jobs.state, "_footer_counts", never)

    fs = s3fs.S3FileSystem()
    fs.mkdir("fleetgen-test")
    local = write_prompts(tmp_path / "p.parquet", [f"s3 prompt {i}" for i in range(6)])
    fs.put(str(local), "fleetgen-test/in/p.parquet")
    cfg = validate(
        JobConfig.of(
            input="s3://fleetgen-test/in/",
            output="s3://fleetgen-test/out",
            model=tiny_model,
            rows_per_shard=3,
            max_batch=3,
            **{**FAST, "workers": 2},
        )
    )
    summary = run_job(cfg, progress_stream=io.StringIO())
    assert summary.complete and summary.images_ok == 6
    fs.invalidate_cache()
    assert fs.exists("fleetgen-test/out/_SUCCESS")
    assert len(fs.find("fleetgen-test/out/images")) == 6
    rows = pq.read_table("fleetgen-test/out/shards", filesystem=fs).to_pylist()
    for r in rows:
        assert hashlib.sha256(fs.cat(f"fleetgen-test/out/{r['image']}")).hexdigest() == r["sha256"]
    index = pq.read_table("fleetgen-test/out/counts.parquet", filesystem=fs)
    assert dict(zip(index["shard"].to_pylist(), index["version"].to_pylist(), strict=True)) == list_manifests(
        Output("s3://fleetgen-test/out")
    )
    # resume on S3: everything committed, nothing to do
    assert run_job(cfg, progress_stream=io.StringIO()).shards_skipped == 2


def test_emulated_mixed_fleet_plans_per_worker_same_images(ray_cluster, tiny_model, prompts, tmp_path):
    """`--worker-memory`: one worker per budget, each planning for its own; the images are the
    bytes a single uniform worker makes (same batch size)."""
    # Both workers start fresh, together, as on a new cluster: a worker parked by an earlier test would be
    # ready at once and make all four shards before the other had loaded (seen once in a full run).
    free_parked()
    mixed = run_job(
        job(
            prompts,
            tiny_model,
            tmp_path / "mixed",
            worker_memory="20MiB,1GiB",
            max_batch=1,
            workers=None,
            host_copy="worker",  # both load at once (with the node's copy the second waits for the first's)
            **NATIVE,
        ),
        progress_stream=io.StringIO(),
    )
    # the uniform worker: one in this process, one thread as each of the job's, batches of 1 in shards of 3
    worker, uniform = run_one_shard(
        tiny_model,
        tmp_path / "uniform",
        prompts,
        fast_settings(**NATIVE),
        rows=3,
        shards=range(N // 3),
        max_batch=1,
        threads=1,
    )
    worker.close()
    assert mixed.complete and len(uniform) == N
    by_worker = {w["worker"]: w for w in mixed.workers}
    assert by_worker["w0"]["budget"] == 20 * 2**20 and by_worker["w0"]["modes"]["unet"] != "resident"
    assert set(by_worker["w1"]["modes"].values()) == {"resident"}
    # Which worker makes which shard is the pool's (a worker ready after the others finished takes
    # none: CI saw it); every image is made once, and each worker's bytes are the uniform worker's.
    assert sum(w["images"] for w in mixed.workers) == N and sum(w["share"] for w in mixed.workers) == pytest.approx(1)
    assert shas(tmp_path / "mixed") == {k: r["sha256"] for k, r in uniform.items()}


def test_plan_trials_through_a_job_one_measurer_per_device_kind(ray_cluster, tiny_model, prompts, tmp_path):
    """`--plan-trials on` through the driver and Ray's actors: the driver tells each worker its shard's
    images (the trials' cap is a share of them), one worker of the kind measures, the others (and a rerun
    that has work left) take its answer from `OUT/plans/`, and another job written over it (`--overwrite`) removes it."""
    free_parked()
    out = tmp_path / "trials"
    # both load at once (with the node's copy the second waits for the first's load)
    config = job(
        prompts, tiny_model, out, workers=2, gpu_memory="256MiB", plan_trials="on", host_copy="worker", **NATIVE
    )
    summary = run_job(config, progress_stream=io.StringIO())
    assert summary.complete
    records = [json.loads(p.read_text()) for p in (out / "workers").glob("*.json")]
    plans = [r["plan"] for r in records]
    assert sorted(p["chosen_by"] for p in plans) in (["measured", "shared"], ["model", "shared"], ["measured"])
    (measurer,) = [p for p in plans if "trial_seconds" in p]
    first = measurer["trials"][0]["measured_seconds_per_image"]
    assert measurer["cap_seconds"] == pytest.approx(0.05 * 3 * first)  # a shard of 3 rows, one image each
    assert len(list((out / "plans").glob("*.json"))) == 1
    # a rerun with work left: its worker reuses the answer, times nothing
    shutil.rmtree(out / "shards")
    shutil.rmtree(out / "workers")
    again = run_job(job(prompts, tiny_model, out, workers=1, gpu_memory="256MiB", plan_trials="on", **NATIVE))
    assert again.complete
    (record,) = [json.loads(p.read_text()) for p in (out / "workers").glob("*.json")]
    assert record["plan"]["chosen_by"] == "shared" and "trial_seconds" not in record["plan"]
    # another job over it (`--overwrite`): the old job's answers go with it
    other = job(prompts, tiny_model, out, workers=1, overwrite=True, **{**NATIVE, "steps": FAST["steps"] + 1})
    run_job(other, progress_stream=io.StringIO())
    assert not (out / "plans").exists()
