"""Faults injected for real: SIGKILLed workers and drivers, SIGTERM, a corrupt row group, a row
the pipeline rejects, a second driver, a missing bucket. Real local Ray, real files, real S3."""

import functools
import io
import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from bench.chaos import Killer, check, manifest_rows
from fleetgen.errors import StorageError
from fleetgen.jobs.driver import run_job
from fleetgen.jobs.verify import verify
from fleetgen.workers.spec import GenerationSettings
from tests.conftest import (
    fast_settings,
    foreign_lock,
    kill_driver,
    make_job,
    run_args,
    run_one_shard,
    start_driver,
    wait_for_commits,
    write_prompts,
)

ROOT = Path(__file__).resolve().parents[2]


ROWS_PER_SHARD = 8
job = functools.partial(make_job, rows_per_shard=ROWS_PER_SHARD, max_batch=4, workers=2)
CHAOS_ROWS = 96  # 12 shards, made by two workers in about 3 s of work between their restarts
KILL_GAP = (0.2, 0.6)  # seconds from a worker seen alive to its kill: 4 kills land with shards left to make


@pytest.fixture(scope="module")
def chaos_input(tmp_path_factory, tiny_model, ray_cluster):
    """CHAOS_ROWS prompts and their images from a clean run (the reference every fault run must match): made
    in this process by one worker with one thread, as each of the job's two has, in the same batches of 4
    (the session's Ray is asked for here for the fault runs)."""
    root = tmp_path_factory.mktemp("chaos")
    prompts = write_prompts(root / "p.parquet", [f"chaos prompt {i}" for i in range(CHAOS_ROWS)])
    worker, clean = run_one_shard(
        tiny_model, root / "clean", prompts, fast_settings(), rows=CHAOS_ROWS, max_batch=4, threads=1
    )
    worker.close()
    assert len(clean) == CHAOS_ROWS and {r["status"] for r in clean.values()} == {"ok"}
    return prompts, {k: r["sha256"] for k, r in clean.items()}, None


@pytest.mark.chaos
def test_chaos_workers_killed_at_random_moments(chaos_input, tiny_model, tmp_path):
    prompts, clean, _ = chaos_input
    killer = Killer(tmp_path / "out", kills=4, gap=KILL_GAP, seed=1)
    killer.start()
    summary = run_job(
        job(prompts, tiny_model, tmp_path / "out", max_attempts=10, max_restarts=5), progress_stream=io.StringIO()
    )
    killer.done.set()
    killer.join()
    assert len(killer.killed) == 4, "the job ended before every kill landed: make it longer"
    # the last one too, with shards left to make
    assert killer.killed[-1]["shards"] < CHAOS_ROWS // ROWS_PER_SHARD, killer.killed
    assert summary.complete and summary.images_ok == CHAOS_ROWS
    assert check(tmp_path / "out", clean) == {
        "rows": CHAOS_ROWS,
        "missing": 0,
        "duplicates": 0,
        "stray_objects": 0,
        "sha_mismatches": 0,
        "tmp_files": 0,
        "verify_deep": "clean",
    }
    assert not list((tmp_path / "out").rglob("*.tmp-*"))
    # Each worker ready again after a kill (fleet.json) wrote its record (workers/<w>.json) as the
    # restarted process. A record may still name a killed process: one killed parked after its run,
    # or still restarting when the other worker emptied the queue (released, never ready again).
    killed_at = {k["pid"]: k["time"] for k in killer.killed}
    events = json.loads((tmp_path / "out" / "fleet.json").read_text())["events"]
    for record in (tmp_path / "out" / "workers").glob("*.json"):
        if (pid := json.loads(record.read_text())["pid"]) in killed_at:
            mine = [e for e in events if e["worker"] == record.stem]
            since = max([killed_at[pid], *(e["time"] for e in mine if e["event"] == "lost")])
            assert not [e for e in mine if e["event"] == "ready" and e["time"] > since], (record.stem, mine)
    came_back = [
        e
        for e in events
        if e["event"] == "ready"
        and any(f["event"] == "lost" and f["worker"] == e["worker"] and f["time"] < e["time"] for f in events)
    ]
    assert came_back, events  # a killed worker restarted and worked on


def _corrupt_first_row_group(path: Path) -> None:
    """Overwrite bytes inside the first row group's column data; the footer stays valid."""
    meta = pq.ParquetFile(path).metadata
    col = meta.row_group(0).column(0)
    start = col.dictionary_page_offset or col.data_page_offset
    with open(path, "r+b") as f:
        f.seek(start)
        f.write(b"\xff" * col.total_compressed_size)


def test_failing_shard_is_retried_bounded_then_reported(tiny_model, tmp_path, ray_cluster, capsys):
    from fleetgen.cli import main

    prompts = write_prompts(tmp_path / "p.parquet", [f"p{i}" for i in range(16)], row_group_size=8)
    _corrupt_first_row_group(prompts)
    args = ["run", *run_args(prompts, tmp_path / "out", tiny_model, guidance=None, rows_per_shard=8, max_attempts=2)]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "FAILED shard-00000 after 2 attempt(s): InputError: Could not read row group 0" in err
    assert "rerun the same command to retry only those" in err
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert (summary["complete"], summary["shards_committed"], summary["images_ok"]) == (False, 1, 8)
    assert [f["shard"] for f in summary["failures"]] == ["shard-00000"]
    assert not (tmp_path / "out" / "_SUCCESS").exists()
    assert main(args) == 1  # the rerun retries only the failed shard
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["shards_skipped"] == 1


def _wait_for_images(out: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not any((out / "images").glob("*/*.png")):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no image appeared"
        time.sleep(0.1)


def _held_by_others(shm: Path) -> dict[str, list[str]]:
    """The node copies in `shm` that a process other than this one holds, or that nobody holds (left to
    reclaim): {segment: the holders' command lines}, from /proc/locks."""
    holders: dict[int, set[int]] = {}  # inode -> pids holding a lock on it
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        if "->" in fields:  # a waiter, not a holder
            continue
        pid, device = int(fields[4]), fields[5]
        holders.setdefault(int(device.rsplit(":", 1)[1]), set()).add(pid)
    out = {}
    for users in shm.glob("fleetgen-*.users"):
        try:
            pids = holders.get(users.stat().st_ino, set())
        except FileNotFoundError:
            continue
        if pids != {os.getpid()}:
            names = []
            for pid in sorted(pids):
                try:
                    names.append(
                        f"{pid}: " + (Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120])
                    )
                except OSError:
                    names.append(f"{pid}: gone")
            out[users.name] = names or ["nobody"]
    return out


@pytest.mark.chaos
def test_driver_stopped_then_killed_then_rerun_resumes(chaos_input, tiny_model, tmp_path, ray_address):
    """A driver SIGTERMed mid-run stops in time, writes its summary and releases the lock; its rerun,
    SIGKILLed mid-run, leaves a lock whose process is gone; a third run resumes at once, skips what
    both committed and finishes: every row once, the clean run's bytes, `verify --deep` clean."""
    prompts, clean, _ = chaos_input
    out = tmp_path / "out"
    args = run_args(prompts, out, tiny_model, rows_per_shard=ROWS_PER_SHARD, max_batch=4)
    env = {**os.environ, "RAY_ADDRESS": ray_address}

    proc = start_driver(args, env)
    _wait_for_images(out, proc)
    proc.send_signal(signal.SIGTERM)
    start = time.monotonic()
    _, stderr = proc.communicate(timeout=60)
    assert time.monotonic() - start < 30 and proc.returncode == 1, stderr
    assert "SIGTERM: no new shards" in stderr and "rerun the same command to resume" in stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped"] and not summary["complete"]
    assert not (out / "_LOCK").exists()  # released on the way out
    stopped = len(list((out / "shards").glob("*.parquet")))

    proc = start_driver(args, env)
    wait_for_commits(out, stopped, proc)
    kill_driver(proc)  # and its worker, which may commit the shard it was making until then
    assert proc.returncode == -signal.SIGKILL
    lock = json.loads((out / "_LOCK").read_text())  # a dead driver's lock, its heartbeat still fresh
    assert lock["pid"] == proc.pid
    assert not (out / "_SUCCESS").exists()
    committed_before = {p.name for p in (out / "shards").glob("*.parquet")}
    assert stopped < len(committed_before) < CHAOS_ROWS // ROWS_PER_SHARD

    log = io.StringIO()
    again = run_job(
        job(prompts, tiny_model, out, workers=1), progress_stream=log
    )  # at once: the lock's process is gone
    assert again.complete and again.shards_skipped == len(committed_before)
    assert f"pid {proc.pid}: that process no longer exists on this host" in log.getvalue()
    # Nothing of the weights' node copy is left by the three runs: the killed runs' workers left theirs with no
    # live user, which the next worker to join reclaims (`reclaim`, here until the last of the killed driver's
    # late starters is gone); the rerun's workers left theirs as they closed. A copy still there is held by
    # this pytest process only: an in-process worker of another test on the same model, never closed.
    from fleetgen.workers.pipeline.segment import reclaim

    base = Path(os.environ["FLEETGEN_SHM_DIR"])
    shm = base / f"fleetgen-{os.geteuid()}"  # this user's directory of segments
    deadline = time.monotonic() + 30
    while (held := _held_by_others(shm)) and time.monotonic() < deadline:
        reclaim(base)
        time.sleep(0.5)
    assert not held, held
    assert check(out, clean) == {
        "rows": CHAOS_ROWS,
        "missing": 0,
        "duplicates": 0,
        "stray_objects": 0,
        "sha_mismatches": 0,
        "tmp_files": 0,
        "verify_deep": "clean",
    }


def test_second_driver_refuses_naming_the_first(tiny_model, tmp_path, ray_cluster):
    from fleetgen.jobs.lock import OutputLock
    from fleetgen.workers.output.storage import Output

    prompts = write_prompts(tmp_path / "p.parquet", ["a", "b"])
    first = OutputLock(Output(str(tmp_path / "out")))
    first.acquire()
    try:
        with pytest.raises(StorageError) as err:
            run_job(job(prompts, tiny_model, tmp_path / "out", workers=1), progress_stream=io.StringIO())
        assert "is in use by another fleetgen driver" in str(err.value) and first.owner in str(err.value)
    finally:
        first.release()
    log = io.StringIO()
    lock = tmp_path / "out" / "_LOCK"
    lock.write_text(json.dumps({"token": "dead", "owner": "old-host pid 1", "started": 0, "heartbeat": 0}))
    assert run_job(job(prompts, tiny_model, tmp_path / "out", workers=1), progress_stream=log).complete
    assert "took over a stale lock of old-host pid 1" in log.getvalue()


ROWS_TAKEN = 24  # in shards of 2


@pytest.mark.chaos
def test_a_driver_whose_output_is_taken_over_stops_and_its_workers_commit_nothing_more(
    tiny_model, tmp_path, ray_cluster, monkeypatch
):
    """Another driver takes the output over mid-run (as after this one's heartbeat went stale to it):
    this driver's next beat finds the other's lock and stops, writing nothing more (the lock, the
    summary are the other's); its Ray worker, finishing its shard in `--stop-grace`, finds the lock
    names another driver and does not commit (the token the driver handed it). Once the lock
    is free a rerun finishes: every row once, `verify --deep` clean."""

    import fleetgen.jobs.lock

    monkeypatch.setattr(fleetgen.jobs.lock, "HEARTBEAT", 0.05)  # the in-process driver's beat
    # 12 shards: a warm worker on a fast machine makes a shard in ~50 ms, and 6 were all committed
    # before a 0.2 s beat looked (a clean clone's CI run)
    prompts = write_prompts(tmp_path / "p.parquet", [f"taken over {i}" for i in range(ROWS_TAKEN)])
    out = tmp_path / "out"
    taken: dict = {}

    def take_over():
        deadline = time.monotonic() + 120
        while not list(out.glob("shards/*.parquet")):
            assert time.monotonic() < deadline, "no shard committed"
            time.sleep(0.02)
        taken["lock"], taken["at"] = foreign_lock(out, "theirs", "elsewhere", 7), time.time()

    thread = threading.Thread(target=take_over, daemon=True)
    thread.start()
    log = io.StringIO()
    # one worker: the shard it takes after its first commit is mid-way when the lock changes hands
    # (0.05-0.3 s alone, seconds on a busy machine; the heartbeat looks every 0.05 s)
    settings = {"workers": 1, "rows_per_shard": 2, "max_batch": 2, "steps": 12, "max_attempts": 1, "stop_grace": 60}
    summary = run_job(job(prompts, tiny_model, out, **settings), progress_stream=log)
    thread.join()
    text = log.getvalue()
    assert summary.exit_code == 1 and not summary.complete, text
    assert "another fleetgen driver (elsewhere pid 7) took this output over" in summary.error
    assert (out / "_LOCK").read_text() == taken["lock"]  # neither written back nor removed
    assert not (out / "summary.json").exists() and not (out / "_SUCCESS").exists()
    refused = re.findall(r"not committed, the job's lock is held by another driver \(elsewhere pid 7\)", text)
    assert refused, text[-3000:]  # a worker that was mid-shard checked the token it was handed
    # nothing committed after the take-over (a commit that passed the check just before lands within ms)
    late = [p.name for p in out.glob("shards/*.parquet") if p.stat().st_mtime > taken["at"] + 0.2]
    assert not late, (late, text[-3000:])
    committed = len(list(out.glob("shards/*.parquet")))
    assert committed + len(refused) <= ROWS_TAKEN // 2 and committed < ROWS_TAKEN // 2

    (out / "_LOCK").unlink()  # the other driver is done with it
    again = run_job(job(prompts, tiny_model, out, **settings), progress_stream=io.StringIO())
    assert again.complete and again.shards_skipped == committed
    ids = [r["id"] for r in manifest_rows(out)]
    assert len(ids) == len(set(ids)) == ROWS_TAKEN
    assert verify(str(out), deep=True).clean


@pytest.mark.slow  # a job of its own: seconds
def test_pathological_row_costs_only_itself(tiny_model, tmp_path):
    """A real pipeline failure injected for one prompt (a hook on the text encoder): the batch is
    retried row by row, the bad row is an error row, the rest of the shard commits."""
    from fleetgen.jobs.sharding import plan_shards, read_footer, resolve_columns
    from fleetgen.workers.rows.shard import Columns
    from fleetgen.workers.spec import WorkerSpec
    from fleetgen.workers.worker import Worker

    prompts = write_prompts(
        tmp_path / "p.parquet", ["a red fox", "a robot", "a blue owl", "a cat"], id=["fox", "robot", "owl", "cat"]
    )
    files = [read_footer(str(prompts))]
    worker = Worker(
        WorkerSpec.of(
            "w0",
            tiny_model,
            str(tmp_path / "out"),
            GenerationSettings(family="sd", task="text-to-image", steps=2, guidance=7.5, width=64, height=64),
            resolve_columns(files, Columns()),
            max_batch=4,
            device="cpu",
        )
    )
    robot = worker.pipe.tokenizer("robot").input_ids[1]

    def reject_robots(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None and (ids == robot).any():
            raise ValueError("this pipeline cannot draw robots")

    worker.pipe.text_encoder.register_forward_pre_hook(reject_robots, with_kwargs=True)
    result = worker.run_shard(plan_shards(files, 10)[0])
    assert (result.ok, result.errors) == (3, 1)
    rows = {r["id"]: r for r in pq.read_table(tmp_path / "out" / "shards" / "shard-00000.parquet").to_pylist()}
    assert (
        rows["robot"]["status"] == "error" and rows["robot"]["error"] == "ValueError: this pipeline cannot draw robots"
    )
    assert all(rows[i]["status"] == "ok" for i in ("fox", "owl", "cat"))


def test_ids_repeated_across_shards_overwrite_nothing_and_within_a_shard_fail_it(tiny_model, tmp_path, ray_cluster):
    """Keys are shard-scoped: `a` in shards 0 and 1 gives two images; `h` twice in shard 2 fails
    that shard (naming the rows) and nothing else."""
    ids = ["a", "b", "c", "d", "a", "e", "f", "g", "h", "i", "h", "j"]
    prompts = write_prompts(tmp_path / "p.parquet", [f"prompt {i}" for i in range(12)], id=ids)
    summary = run_job(
        job(prompts, tiny_model, tmp_path / "out", rows_per_shard=4, max_attempts=1, workers=1),
        progress_stream=io.StringIO(),
    )
    assert (summary.shards_committed, summary.images_ok) == (2, 8)
    [failure] = summary.failures
    assert failure["shard"] == "shard-00002"
    assert "1 id(s) of column `id` repeat within the shard (`h` at rows 8, 10;" in failure["error"]
    assert (tmp_path / "out" / "images" / "shard-00000" / "a.png").read_bytes() != (
        tmp_path / "out" / "images" / "shard-00001" / "a.png"
    ).read_bytes()
    assert verify(str(tmp_path / "out"), deep=True).clean


def test_missing_bucket_fails_fast_naming_the_url(s3_server, tiny_model, tmp_path):
    prompts = write_prompts(tmp_path / "p.parquet", ["a"])
    with pytest.raises(StorageError) as err:
        run_job(job(prompts, tiny_model, "s3://no-such-bucket/out"), progress_stream=io.StringIO())
    assert "s3://no-such-bucket/out/" in str(err.value)


def test_straggler_is_given_to_an_idle_worker_and_only_the_winners_bytes_are_stored(tiny_model, tmp_path, ray_cluster):
    """Shard A (40 rows) and shard B (4 rows): the worker done with B takes A as well; whichever
    commits first wins, the other attempt stops and its staging goes: the stored bytes are the
    winner's (verify --deep), and no object is stored twice or left behind. (A losing attempt of
    another batch size, whose bytes differ, is in tests/jobs/test_verify.py.)"""
    from fleetgen.cluster.warm import free_parked

    free_parked()  # both workers start alike (cold), so that neither has taken A and B before the other is up
    (tmp_path / "in").mkdir()
    write_prompts(tmp_path / "in" / "a.parquet", [f"long shard {i}" for i in range(40)])
    write_prompts(tmp_path / "in" / "b.parquet", [f"short shard {i}" for i in range(4)])
    log = io.StringIO()
    fast = run_job(
        job(
            tmp_path / "in",
            tiny_model,
            tmp_path / "out",
            workers=2,
            rows_per_shard=40,
            max_batch=2,
            output_format="webdataset",
            host_copy="worker",  # both load at once (with the node's copy the second waits for the first's)
        ),
        progress_stream=log,
    )
    assert fast.complete and fast.images_ok == 44
    assert fast.speculative_attempts == 1 and "straggler: shard-00000" in log.getvalue()
    rows = manifest_rows(tmp_path / "out")
    assert len(rows) == len({r["id"] for r in rows}) == 44
    written = sorted(
        p.relative_to(tmp_path / "out").as_posix()
        for p in (tmp_path / "out").rglob("*")
        if p.is_file() and p.parts[-2] in ("images", "data", "shard-00000", "shard-00001")
    )
    assert written == ["data/shard-00000.tar", "data/shard-00001.tar"]  # no stray object, staging or temporary file
    assert verify(str(tmp_path / "out"), deep=True).clean
