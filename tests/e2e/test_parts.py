"""Commits inside a shard (workers/output/parts.py), on every store: a local folder, S3 (moto), GCS
(fake-gcs-server) and Azure (Azurite), each behind the fault proxy. Workers run in this process (no
Ray), driven event by event so that two attempts of one shard interleave where a test says; whole
jobs that are SIGKILLed or SIGTERMed mid-shard are in test_parts_jobs.py."""

from __future__ import annotations

import pytest

from fleetgen.errors import ShardError
from fleetgen.jobs.verify import verify
from fleetgen.workers.output.layout import part_prefix
from fleetgen.workers.output.parts import chain_end, finish_attempts, parts_counts, read_chain
from fleetgen.workers.output.storage import Output
from fleetgen.workers.spec import BatchDone, PartCommitted, ShardResult
from tests.conftest import setup_job

EVERY_WINDOW = 1e-6  # seconds: a part at every window's end (a window is one batch of one row here)
PROMPTS = [f"a harbour at dusk, number {i}" for i in range(6)]


def _reference(tmp_path, tiny_model, fmt: str) -> dict[str, str]:
    """{id: sha256} of shard 0 made whole, in one attempt: what every run in parts must store."""
    (tmp_path / "ref").mkdir(exist_ok=True)
    worker, shards = setup_job(tmp_path / "ref", tiny_model, tmp_path / "ref" / "out", fmt, PROMPTS, max_batch=1)
    worker.run_shard(shards[0])
    rows = Output(str(tmp_path / "ref" / "out")).read_parquet("shards/shard-00000.parquet").to_pylist()
    worker.close()
    return {r["id"]: r["sha256"] for r in rows}


def _stored(out: str) -> dict[str, str]:
    rows = Output(out).read_parquet("shards/shard-00000.parquet", ["id", "status", "sha256"]).to_pylist()
    assert len(rows) == len({r["id"] for r in rows}), rows  # every row once
    return {r["id"]: r["sha256"] for r in rows}


def _parts_worker(tmp_path, tiny_model, out, fmt="files", name="a"):
    (tmp_path / name).mkdir(exist_ok=True)
    return setup_job(tmp_path / name, tiny_model, out, fmt, PROMPTS, max_batch=1, commit_interval=EVERY_WINDOW)


@pytest.mark.parametrize("fmt", ["files", "webdataset", "parquet"])
def test_a_shard_commits_in_parts_then_one_manifest_with_the_bytes_of_a_whole_commit(tmp_path, tiny_model, fmt):
    """Rows 0 and 1 commit as parts as they are made; row 2 and the parts become the shard's one
    manifest (and one tar or Parquet file), the parts and staging gone; the stored bytes are those
    of the shard made and committed whole; `verify --deep` is clean."""
    reference = _reference(tmp_path, tiny_model, fmt)
    out = str(tmp_path / "out")
    worker, shards = _parts_worker(tmp_path, tiny_model, out, fmt)
    output = Output(out)
    events = []
    for event in worker.iter_shard(shards[0]):
        events.append(event)
        if isinstance(event, PartCommitted):
            assert chain_end(output, "shard-00000") == event.end  # committed as it is made
            assert not output.exists("shards/shard-00000.parquet")
    parts = [(e.first, e.end, e.made) for e in events if isinstance(e, PartCommitted)]
    assert parts == [(0, 1, 1), (1, 2, 1)]
    result = events[-1]
    assert isinstance(result, ShardResult) and result.counts["ok"] == 3 and result.redone == 0
    assert _stored(out) == reference
    assert not output.find(part_prefix("shard-00000")) and not output.find("_attempts")
    if fmt != "files":
        assert output.list("data") == [f"shard-00000.{'tar' if fmt == 'webdataset' else 'parquet'}"]
    report = verify(out, deep=True)
    assert report.clean and report.images == 3, report.text()


def test_a_new_attempt_starts_after_the_committed_parts(tmp_path, tiny_model):
    """An attempt ends after its first part (its worker lost); the next makes only the rows after
    it, and the manifest holds the first attempt's row as its part committed it."""
    reference = _reference(tmp_path, tiny_model, "files")
    out = str(tmp_path / "out")
    first, shards = _parts_worker(tmp_path, tiny_model, out)
    events = first.iter_shard(shards[0])
    while not isinstance(next(events), PartCommitted):
        pass
    next(events)  # row 1 made, not committed
    events.close()  # the attempt is gone: what it made since its part is thrown away
    assert chain_end(Output(out), "shard-00000") == 1
    second, _ = _parts_worker(tmp_path, tiny_model, out, name="b")
    made = [e for e in second.iter_shard(shards[0]) if isinstance(e, BatchDone)]
    assert sum(e.made for e in made) == 2  # rows 1 and 2; row 0 is the first attempt's part
    assert _stored(out) == reference
    assert verify(out, deep=True).clean


def test_two_attempts_racing_parts_commit_every_row_once(store, tmp_path, tiny_model):
    """Two attempts of one shard, interleaved: both make row 0, one commits its part first; the other
    loses that part's create, throws its row 0 away and goes on after the winner's part. Then they
    race to the end: one manifest, every row once, the bytes of a whole commit, on every store."""
    reference = _reference(tmp_path, tiny_model, "files")
    out = store.location("parts-race")
    a, shards = _parts_worker(tmp_path, tiny_model, out, name="a")
    b, _ = _parts_worker(tmp_path, tiny_model, out, name="b")
    first, second = a.iter_shard(shards[0]), b.iter_shard(shards[0])
    assert isinstance(next(first), BatchDone) and isinstance(next(second), BatchDone)  # both made row 0
    assert isinstance(next(first), PartCommitted)  # a's part [0, 1)
    moved = next(second)  # b loses the create of part 0, and makes row 1 instead
    assert isinstance(moved, BatchDone) and moved.made == 1
    assert [(p.first, p.end) for p in read_chain(Output(out), "shard-00000")] == [(0, 1)]  # a's, and b's next
    results = {}
    live = {"a": first, "b": second}
    while live:
        for name, gen in list(live.items()):
            try:
                event = next(gen)
            except StopIteration:
                del live[name]
                continue
            if isinstance(event, ShardResult):
                results[name] = event
    assert sorted(r.committed_by_other for r in results.values()) == [False, True]
    assert _stored(out) == reference
    assert sum(r.redone for r in results.values()) >= 1  # b's row 0 at least
    report = verify(out, deep=True)
    assert report.clean and report.images == 3, report.text()
    assert not Output(out).find("parts")


def test_a_crash_between_the_manifest_and_its_parts_is_finished_by_the_sweep(store, tmp_path, tiny_model):
    """The manifest built from the parts is committed, then every request touching the staging fails
    (the worker dies there): the parts stay beside the manifest. The driver's sweep (or `verify
    --fix`) moves the parts' objects and removes the parts; `verify --deep` is clean."""
    if store.proxy is None:
        pytest.skip("a local disk answers every call: nothing to lose")
    out = store.location("parts-crash")
    worker, shards = _parts_worker(tmp_path, tiny_model, out)
    committed = store.rule("latency", **store.create_rule("shards"))  # no fault: marks the commit
    store.proxy.delay = 0.0
    store.rule("reset_before", path="_attempts", times=10**6, after=committed)
    with pytest.raises(ShardError, match="committed, but its objects did not all reach their final keys"):
        worker.run_shard(shards[0])
    store.proxy.reset()
    output = Output(out)
    assert output.exists("shards/shard-00000.parquet") and output.list(part_prefix("shard-00000"))
    assert parts_counts(output, {"shard-00000"}) == {}  # status: the manifest counts, its leftover parts not again
    finished, _ = finish_attempts(output)
    assert finished == 3  # two parts' staging and the tail's
    assert not output.find("parts") and not output.find("_attempts")
    assert verify(out, deep=True).clean


def test_verify_checks_parts_where_they_wait_and_fix_cuts_a_damaged_one(tmp_path, tiny_model):
    """A lost attempt left two parts. `verify --deep` hashes their images in their staging (clean,
    nothing there a leftover); a flipped byte in the second part's image is a mismatch, and `--fix`
    removes that part and what follows, so the next attempt makes those rows again."""
    reference = _reference(tmp_path, tiny_model, "files")
    out = str(tmp_path / "out")
    first, shards = _parts_worker(tmp_path, tiny_model, out)
    events = first.iter_shard(shards[0])
    parts = 0
    while parts < 2:
        parts += isinstance(next(events), PartCommitted)
    events.close()
    report = verify(out, deep=True)
    assert report.clean and report.images == 2 and report.hashed == 2, report.text()
    staged = sorted((tmp_path / "out" / "_attempts").rglob("r1.png"))
    assert len(staged) == 1
    data = bytearray(staged[0].read_bytes())
    data[60] ^= 1
    staged[0].write_bytes(bytes(data))
    report = verify(out, deep=True, fix=True)
    assert report.counts["mismatch"] == 1 and "shard-00000/r1" in report.examples["mismatch"][0], report.text()
    assert chain_end(Output(out), "shard-00000") == 1
    second, _ = _parts_worker(tmp_path, tiny_model, out, name="b")
    second.run_shard(shards[0])
    assert _stored(out) == reference
    assert verify(out, deep=True).clean
