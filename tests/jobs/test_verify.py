"""Every byte accounted for: `fleetgen verify` finds each kind of problem and `--fix` + a rerun
repairs it; the commit protocol keeps a losing, failing or redone attempt from touching a winner's
bytes. Workers run in-process (no Ray): the same code a job runs per shard."""

import io
import json
import os
import socket
import tarfile
import threading
import time

import pyarrow.parquet as pq
import pytest

import fleetgen.jobs.lock
import fleetgen.jobs.state
import fleetgen.jobs.summary
from fleetgen.cli import main
from fleetgen.errors import ShardError
from fleetgen.jobs.verify import verify
from fleetgen.workers.output.commit import ATTEMPT_KEY, attempt_of
from fleetgen.workers.spec import ShardResult
from tests.conftest import foreign_lock, setup_job


def files_under(out):
    return sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())


def staged(out, shard, n, timeout=30.0):
    """Wait until `n` objects are staged for `shard` (the worker's writer thread stores them)."""
    deadline = time.monotonic() + timeout
    while sum(p.startswith(f"_attempts/{shard}/") for p in files_under(out)) < n:
        assert time.monotonic() < deadline, files_under(out)
        time.sleep(0.05)


def damage(out, fmt):
    """One missing image, one image with a flipped byte, one orphan, and leftovers."""
    if fmt == "files":
        (out / "images" / "shard-00000" / "r1.png").unlink()
        p = out / "images" / "shard-00001" / "r4.png"
        data = bytearray(p.read_bytes())
        data[60] ^= 1
        p.write_bytes(bytes(data))
        (out / "images" / "shard-00001" / "stray.png").write_bytes(b"x")
    elif fmt == "webdataset":
        for shard, drop, flip in (("shard-00000", "r1.png", None), ("shard-00001", None, "r4.png")):
            path = out / "data" / f"{shard}.tar"
            with tarfile.open(path) as tar:
                members = [(m, tar.extractfile(m).read()) for m in tar]
            with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
                for m, data in members:
                    if m.name == drop:
                        continue
                    if m.name == flip:
                        data = bytes([data[0] ^ 1]) + data[1:]
                    tar.addfile(m, io.BytesIO(data))
        (out / "data" / "shard-00007.tar").write_bytes(b"orphan")
    else:
        import pyarrow.compute as pc

        table = pq.read_table(out / "data" / "shard-00000.parquet")
        pq.write_table(table.filter(pc.not_equal(table.column("id"), "r1")), out / "data" / "shard-00000.parquet")
        (out / "data" / "shard-00007.parquet").write_bytes(b"orphan")
    (out / "shards" / "shard-00009.parquet.tmp-0123abcd").write_bytes(b"torn")
    (out / "_attempts" / "shard-00001" / "0f0f0f0f0f0f").mkdir(parents=True)
    (out / "_attempts" / "shard-00001" / "0f0f0f0f0f0f" / "x").write_bytes(b"staged")


@pytest.mark.parametrize("fmt", ["files", "webdataset", "parquet"])
def test_verify_finds_each_problem_and_fix_plus_rerun_repairs_it(tiny_model, tmp_path, fmt):
    out = tmp_path / "out"
    worker, shards = setup_job(tmp_path, tiny_model, out, fmt)
    for shard in shards:
        worker.run_shard(shard)
    clean = verify(str(out), deep=True)
    assert clean.clean and clean.images == 6 and clean.hashed == 6, clean.text()
    damage(out, fmt)

    shallow = verify(str(out))
    assert shallow.counts["missing"] == 1 and shallow.examples["missing"][0].startswith("shard-00000/r1")
    assert shallow.counts["leftover"] == 2 and shallow.counts["orphan"] >= 1
    deep = verify(str(out), deep=True)
    assert deep.counts["missing"] == 1
    assert deep.counts["mismatch"] == (1 if fmt != "parquet" else 0), deep.text()  # the flipped byte: --deep only
    code = main(["verify", str(out), "--deep", "--fix", "--json", str(tmp_path / "v.json")])
    assert code == 1 and json.loads((tmp_path / "v.json").read_text())["clean"] is False
    fixed = json.loads((tmp_path / "v.json").read_text())
    assert fixed["uncommitted"] == (["shard-00000", "shard-00001"] if fmt != "parquet" else ["shard-00000"])
    assert not (out / "_attempts").exists()
    assert verify(str(out), deep=True).clean  # nothing left but shards to redo
    for shard in shards:  # the rerun: shards without a manifest are redone
        if not (out / "shards" / f"{shard.id}.parquet").exists():
            worker.run_shard(shard)
    after = verify(str(out), deep=True)
    assert after.clean and after.images == 6, after.text()


def test_a_run_that_has_not_finished_never_sweeps_the_staging_of_an_attempt_that_may_still_commit(tiny_model, tmp_path):
    """A driver killed mid-run leaves workers that die seconds after it (elsewhere, when Ray gets to
    them): one stages its last batch, the next run starts and sweeps, then that worker commits. The
    sweep of a run that has not finished (its start; its end with shards left) leaves staging that no
    manifest names alone, so what the late commit names is stored. A complete run's end removes it:
    no attempt can win a shard that is committed."""
    from fleetgen.jobs.state import sweep
    from fleetgen.workers.output.storage import Output

    out = tmp_path / "out"
    worker, shards = setup_job(tmp_path, tiny_model, out, "files", max_batch=3)
    late = worker.iter_shard(shards[0])
    assert next(late).images == 3  # every image made; its commit is the next step
    staged(out, "shard-00000", 3)
    sweep(Output(str(out)), discard=False)  # the next run starts: shard-00000 is not committed
    *_, result = late  # the late worker commits
    assert result.ok == 3 and not result.committed_by_other
    report = verify(str(out), deep=True)
    assert report.counts["missing"] == 0 and report.images == 3, report.text()

    killed = worker.iter_shard(shards[1])  # an attempt whose process dies after staging (never resumed)
    assert next(killed).images == 3
    staged(out, "shard-00001", 3)
    sweep(Output(str(out)), discard=False)  # a run ends with shard-00001 left: the staging stays
    assert any(p.startswith("_attempts/shard-00001/") for p in files_under(out))
    other, _ = setup_job(tmp_path, tiny_model, out, "files", max_batch=3)
    assert other.run_shard(shards[1]).ok == 3  # the next run makes it: now every shard is committed
    sweep(Output(str(out)), discard=True)  # a complete run's end: the dead attempt's staging goes
    assert not any(p.startswith("_attempts/") for p in files_under(out))
    assert verify(str(out), deep=True).clean
    del killed


def test_a_worker_whose_driver_no_longer_holds_the_lock_does_not_commit(tiny_model, tmp_path):
    """A worker commits only while the job's lock names its driver: once the lock is taken over (the
    driver SIGKILLed, a rerun started) or released (the driver stopped), its attempt gives up and
    leaves nothing, so a worker that outlives its driver never commits under the next run's feet."""
    from fleetgen.workers.output.layout import LOCK
    from fleetgen.workers.output.storage import Output

    out = tmp_path / "out"
    worker, shards = setup_job(tmp_path, tiny_model, out, "files", max_batch=3, lock_token="mine")
    output = Output(str(out))
    foreign_lock(out, "mine", "here", 1)
    assert worker.run_shard(shards[0]).ok == 3  # its driver's lock: committed

    foreign_lock(out, "theirs", "there", 2)  # taken over
    with pytest.raises(ShardError, match=r"not committed, the job's lock is held by another driver \(there pid 2\)"):
        worker.run_shard(shards[1])
    output.remove(LOCK)  # released
    with pytest.raises(ShardError, match="not committed, the job's lock was released"):
        worker.run_shard(shards[1])
    assert not (out / "shards" / "shard-00001.parquet").exists()
    assert not any(p.startswith(("_attempts/", "images/shard-00001")) for p in files_under(out))


def test_a_losing_attempt_never_replaces_the_winners_bytes(tiny_model, tmp_path):
    """Two attempts at one shard with different batch sizes (so their bytes differ), interleaved:
    the loser writes a batch after the winner committed; only the winner's bytes are stored."""
    out = tmp_path / "out"
    slow, shards = setup_job(tmp_path, tiny_model, out, "files", max_batch=1)
    fast, _ = setup_job(tmp_path, tiny_model, out, "files", max_batch=3)
    loser = slow.iter_shard(shards[0])
    assert next(loser).images == 1  # the loser's first image is made (in its staging)
    *_, won = fast.iter_shard(shards[0])
    assert won.ok == 3 and not won.committed_by_other
    winner_bytes = {p: (out / p).read_bytes() for p in files_under(out) if p.startswith("images/")}
    assert any(p.startswith("_attempts/") for p in files_under(out))  # the loser's staging, still running
    assert next(loser).committed_by_other  # it sees the commit at its next batch and stops
    loser.close()
    assert not (out / "_attempts" / "shard-00000").exists() or not any((out / "_attempts").rglob("*.png"))
    assert {p: (out / p).read_bytes() for p in files_under(out) if p.startswith("images/")} == winner_bytes
    manifest = (out / "shards" / "shard-00000.parquet").read_bytes()
    assert attempt_of(manifest) and pq.read_schema(io.BytesIO(manifest)).metadata[ATTEMPT_KEY]
    assert {r["batch"] for r in pq.read_table(out / "shards").to_pylist()} == {3}
    assert verify(str(out), deep=True).clean

    # Both attempts reach the commit: the second's manifest create fails, it removes its staging.
    again = setup_job(tmp_path, tiny_model, tmp_path / "two", "files", max_batch=1)[0]
    other = setup_job(tmp_path, tiny_model, tmp_path / "two", "files", max_batch=3)[0]
    a = again.iter_shard(shards[1])
    events = [next(a) for _ in range(3)]  # all three of its batches made, not yet committed
    assert all(not isinstance(e, ShardResult) for e in events)
    assert not other.run_shard(shards[1]).committed_by_other
    assert next(a).committed_by_other
    assert {r["batch"] for r in pq.read_table(tmp_path / "two" / "shards").to_pylist()} == {3}
    assert verify(str(tmp_path / "two"), deep=True).clean


@pytest.mark.parametrize("fmt", ["webdataset", "parquet"])
def test_an_attempt_failing_every_row_on_s3_leaves_the_committed_bytes(s3_server, tiny_model, tmp_path, fmt):
    import s3fs

    fs = s3fs.S3FileSystem()
    bucket = f"fleetgen-verify-{fmt}"
    fs.mkdir(bucket)
    out = f"s3://{bucket}/out"
    worker, shards = setup_job(tmp_path, tiny_model, out, fmt)
    bad, _ = setup_job(tmp_path, tiny_model, out, fmt)
    assert worker.output.atomic_create

    def broken(module, args, kwargs):
        raise RuntimeError("the GPU fell off the bus")

    bad.pipe.unet.register_forward_pre_hook(broken, with_kwargs=True)
    failing = bad.iter_shard(shards[0])
    assert next(failing).errors == 3  # its one batch failed, row by row; it has not reached its commit
    worker.run_shard(shards[0])  # meanwhile another attempt commits
    key = f"{bucket}/out/data/shard-00000.{'tar' if fmt == 'webdataset' else 'parquet'}"
    before = fs.cat(key)
    with pytest.raises(ShardError, match="every row failed"):
        next(failing)  # ... and the failing one raises: what it opened is aborted, its staging removed
    fs.invalidate_cache()
    assert fs.cat(key) == before
    assert not fs.exists(f"{bucket}/out/_attempts") or not fs.find(f"{bucket}/out/_attempts")
    assert not fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads")
    # A manifest create that loses on S3 is a conditional PUT (If-None-Match), not a check-then-write.
    assert not worker.output.create("shards/shard-00000.parquet", b"late")
    assert verify(out, deep=True).clean


def test_a_redone_shard_leaves_no_image_of_a_row_that_became_an_error(tiny_model, tmp_path):
    out = tmp_path / "out"
    long = " ".join(["a very long prompt about a red fox"] * 20)  # > 77 CLIP tokens
    worker, shards = setup_job(tmp_path, tiny_model, out, "files", prompts=["a cat", long, "a dog"])
    worker.run_shard(shards[0])
    assert (out / "images" / "shard-00000" / "r1.png").exists()
    (out / "shards" / "shard-00000.parquet").unlink()  # e.g. `verify --fix` un-committed it
    strict, _ = setup_job(tmp_path, tiny_model, out, "files", prompts=["a cat", long, "a dog"], strict_prompts=True)
    result = strict.run_shard(shards[0])
    assert (result.ok, result.errors) == (2, 1)
    assert not (out / "images" / "shard-00000" / "r1.png").exists()
    assert verify(str(out), deep=True).clean


def test_a_winner_that_died_moving_its_objects_is_finished_by_fix(tiny_model, tmp_path):
    """The commit landed, the move did not: verify names the missing images and the staging;
    `--fix` finishes the move (the staging is whole) instead of redoing the shard."""
    out = tmp_path / "out"
    worker, shards = setup_job(tmp_path, tiny_model, out, "files")
    worker.run_shard(shards[0])
    attempt = attempt_of((out / "shards" / "shard-00000.parquet").read_bytes())
    staged = out / "_attempts" / "shard-00000" / attempt
    (staged / "images").mkdir(parents=True)
    (out / "images" / "shard-00000").rename(staged / "images" / "shard-00000")
    report = verify(str(out))
    assert report.counts["missing"] == 3 and report.counts["leftover"] == 1
    fixed = verify(str(out), deep=True, fix=True)
    assert fixed.clean and not fixed.uncommitted, fixed.text()
    assert len(list((out / "images" / "shard-00000").glob("*.png"))) == 3


def test_a_lock_of_a_dead_driver_on_this_host_is_taken_over_at_once(tmp_path):
    from fleetgen.jobs.lock import OutputLock
    from fleetgen.workers.output.storage import Output

    dead = os.fork()
    if dead == 0:
        os._exit(0)
    os.waitpid(dead, 0)  # a pid that no longer exists
    output = Output(str(tmp_path))
    foreign_lock(tmp_path, "x", socket.gethostname(), dead)
    lock = OutputLock(output)
    assert "no longer exists on this host" in lock.acquire()
    lock.release()
    foreign_lock(tmp_path, "y", "elsewhere", 1)
    with pytest.raises(Exception, match="in use by another fleetgen driver"):
        OutputLock(output).acquire()


def test_a_heartbeat_that_finds_its_lock_taken_over_stops_and_never_writes_it_back(tmp_path, monkeypatch):
    """A driver whose heartbeat went stale to another (a partition, a paused process) is taken over:
    its next beat reads the other driver's lock, tells the driver (which stops, writing nothing more)
    and beats no more; its release leaves the other's lock in place."""
    from fleetgen.jobs.lock import OutputLock
    from fleetgen.workers.output.storage import Output

    monkeypatch.setattr(fleetgen.jobs.lock, "HEARTBEAT", 0.05)
    lost, said = [], []
    lock = OutputLock(Output(str(tmp_path)), say=said.append, on_lost=lambda *a, **k: lost.append((a, k)))
    lock.acquire()
    theirs = foreign_lock(tmp_path, "theirs", "elsewhere", 7)
    deadline = time.monotonic() + 10
    while not lost:
        assert time.monotonic() < deadline, said
        time.sleep(0.01)
    time.sleep(0.3)  # six beats' time: none writes
    assert not lock._thread.is_alive() and (tmp_path / "_LOCK").read_text() == theirs
    assert lost == [(("another fleetgen driver (elsewhere pid 7) took this output over",), {"taken_over": True})]
    assert said == [
        "another fleetgen driver (elsewhere pid 7) took this output over; this run stops and leaves the output to it"
    ]
    lock.release()
    assert (tmp_path / "_LOCK").read_text() == theirs


def test_counts_come_from_footers_and_the_index_never_from_manifest_rows(tiny_model, tmp_path):
    """The driver, `status` and the card count from each manifest's footer, and from
    `OUT/counts.parquet` for manifests whose version (size, mtime/ETag) it recorded."""
    from fleetgen.jobs.state import shard_counts, write_counts_index
    from fleetgen.workers.output.storage import Output

    out = tmp_path / "out"
    long = " ".join(["a very long prompt about a red fox"] * 20)
    worker, shards = setup_job(
        tmp_path, tiny_model, out, "files", prompts=["a", "b", long, "c", "d", "e"], strict_prompts=True
    )
    for shard in shards:
        worker.run_shard(shard)
    output = Output(str(out))
    counts = shard_counts(output)
    assert counts == {
        "shard-00000": {"rows": 3, "images": 3, "ok": 2, "error": 1, "filtered": 0},
        "shard-00001": {"rows": 3, "images": 3, "ok": 3, "error": 0, "filtered": 0},
    }
    write_counts_index(output, counts)
    manifest = out / "shards" / "shard-00000.parquet"
    st = manifest.stat()
    manifest.write_bytes(b"\0" * st.st_size)  # unreadable, same size and mtime: never opened
    os.utime(manifest, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert shard_counts(output) == counts
    os.utime(manifest, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # another version: read again
    with pytest.raises(Exception):  # noqa: B017 - pyarrow's error for a file of zeros
        shard_counts(output)


def test_the_end_of_a_run_counts_from_reports_and_looks_only_at_unreported_shards(tiny_model, tmp_path, monkeypatch):
    """The driver's summary adds what workers reported to its start listing; a shard attempted
    without a report (its worker lost after the commit) is looked at (its manifest's version, then
    its footer); shards not attempted come from the start listing."""
    from fleetgen.jobs.state import list_manifests
    from fleetgen.jobs.summary import _summarise
    from fleetgen.workers.output.storage import Output

    out = tmp_path / "out"
    worker, shards = setup_job(tmp_path, tiny_model, out, "files", prompts=["a", "b", "c", "d", "e", "f"])
    first = worker.run_shard(shards[0])
    output = Output(str(out))
    start = list_manifests(output)
    reported = worker.run_shard(shards[1])
    assert reported.version == list_manifests(output)["shard-00001"] and reported.counts["ok"] == 3
    opened = []
    real = fleetgen.jobs.state._footer_counts
    monkeypatch.setattr(fleetgen.jobs.state, "_footer_counts", lambda o, s: opened.append(s) or real(o, s))

    def run(todo, stopped, listing, committed):
        from fleetgen.jobs.progress import Progress
        from fleetgen.jobs.summary import Run

        stop = threading.Event()
        if stopped:
            stop.set()
        return Run(output, shards, todo, listing, Progress(2, 6, stream=io.StringIO()), stop, committed=committed)

    summary, counts = _summarise(run([shards[1]], False, start, {"shard-00001": reported}))
    assert summary.shards_committed == 2 and summary.images_ok == 6 and opened == ["shard-00000"]
    assert first.version == start["shard-00000"]
    opened.clear()
    (out / "counts.parquet").unlink()
    summary, counts = _summarise(run(shards, False, {}, {}))  # no report arrived
    assert summary.shards_committed == 2 and summary.images_ok == 6 and sorted(opened) == ["shard-00000", "shard-00001"]
    assert counts["shard-00001"] == reported.counts
    summary, _ = _summarise(run(shards, True, {}, {}))  # stopping: no looking around
    assert summary.shards_committed == 0
    monkeypatch.setattr(fleetgen.jobs.summary, "PROBE_AT_MOST", 1)  # many unreported: one listing instead
    summary, _ = _summarise(run(shards, False, {}, {}))
    assert summary.shards_committed == 2


def test_the_sweep_removes_what_a_killed_local_writer_left_of_a_manifest_or_a_status_record(tmp_path):
    """A local put is a temporary file renamed into place; a worker killed between the two (the
    chaos test caught one writing `workers/w1.json`) leaves `<key>.tmp-<id>`. Every run's sweep removes
    those under shards/ and workers/, and nothing whole."""
    from fleetgen.jobs.state import sweep
    from fleetgen.workers.output.storage import TMP_MARK, Output

    out = Output(str(tmp_path / "out"))
    out.put("workers/w0.json", b"{}")
    out.put("shards/shard-00000.parquet", b"x")
    for key in ("workers/w1.json", "shards/shard-00001.parquet"):
        (tmp_path / "out" / f"{key}{TMP_MARK}d01c0689").write_bytes(b"half")
    sweep(out, discard=False)
    assert sorted(files_under(tmp_path / "out")) == ["shards/shard-00000.parquet", "workers/w0.json"]


def test_verify_holds_one_shards_rows_however_many_shards_are_damaged(tmp_path):
    """A job whose every image is missing (a wrong location, or a store that lost them): `verify`'s
    memory is one shard's rows, not every damaged shard's (it kept them all: 1.4 GiB at 2 M rows)."""
    import tracemalloc

    import pyarrow as pa

    from fleetgen.workers.output.commit import COUNTS_KEY
    from fleetgen.workers.output.layout import MANIFEST_SCHEMA

    rows = 256
    records = [
        {"id": f"{i:06d}", "row_id": f"{i:06d}", "status": "ok", "prompt": "p", "sha256": "0" * 64, "size": 9}
        for i in range(rows)
    ]

    def peak(shards: int) -> int:
        out = tmp_path / f"out{shards}"
        (out / "shards").mkdir(parents=True)
        (out / "job.json").write_text(json.dumps({"fingerprint": {"generation": {"output_format": "files"}}}))
        counts = json.dumps({"rows": rows, "images": rows, "ok": rows, "error": 0, "filtered": 0})
        for s in range(shards):
            image = [f"images/shard-{s:05d}/{r['id']}.png" for r in records]
            rows_of = [{**r, "image": k} for r, k in zip(records, image, strict=True)]
            table = pa.Table.from_pylist(rows_of, schema=MANIFEST_SCHEMA).replace_schema_metadata({COUNTS_KEY: counts})
            pq.write_table(table, out / "shards" / f"shard-{s:05d}.parquet")
        tracemalloc.start()
        try:
            report = verify(str(out))
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
            assert report.counts["missing"] == shards * rows

    few, many = peak(4), peak(40)
    assert many < 2 * few, (few, many)
