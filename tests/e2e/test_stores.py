"""One behavioural suite, every store: a local folder, S3 (moto), GCS (fake-gcs-server) and Azure
Blob (Azurite), each a real server on loopback behind the fault-injecting proxy (tests/stores.py),
as fsspec's own tests run one suite over many backends. What the commit protocol rests on —
create-if-absent that a race cannot split and a lost answer cannot fool — and what is built on it:
a commit whose answer is lost, an outage, a lock two drivers race for, a driver taken over, a
winner finished by `verify --fix`. Workers run in this process (no Ray); whole jobs per store are in
test_trust_jobs.py."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from fleetgen.cli import main
from fleetgen.errors import ShardError, StorageError
from fleetgen.jobs.lock import OutputLock
from fleetgen.jobs.verify import verify
from fleetgen.workers.output import policy
from fleetgen.workers.output.commit import attempt_of
from fleetgen.workers.output.layout import LOCK
from fleetgen.workers.output.storage import Output
from tests.conftest import run_args, setup_job, write_prompts

RACES = 100


@pytest.fixture
def quick_retries(monkeypatch):
    """The storage policy's backoff at 10 ms: the same attempts, seconds sooner."""
    monkeypatch.setattr(policy, "BACKOFF", 0.01)


def faulted(store) -> None:
    if store.proxy is None:
        pytest.skip("a local disk answers every call: nothing to lose")


@pytest.mark.slow  # 100 races: 10-18 s a store; the fast lane has the lost answer and the lock race
def test_racing_creates_have_exactly_one_winner(store):
    """Two writers create one key at once, 100 times: exactly one is told it won each time, and the
    object holds the winner's bytes."""
    if store.name == "s3":
        # moto answers If-None-Match by a check, then a write, in a threaded server
        # (moto/s3/responses.py, 5.2.5): two racing PUTs can both land there (seen once in ~10 runs),
        # where S3 itself is atomic. fake-gcs-server and Azurite gave one winner in every run here.
        pytest.skip("moto's conditional PUT is not atomic under concurrent requests; S3's is")
    output = Output(store.location("race"))
    gate = threading.Barrier(2)

    def create(key: str, data: bytes) -> bool:
        gate.wait()
        return output.create(key, data)

    winners = 0
    with ThreadPoolExecutor(2) as pool:
        for i in range(RACES):
            key, mine, theirs = f"shards/s{i}.parquet", f"a{i}".encode(), f"b{i}".encode()
            won = list(pool.map(create, [key, key], [mine, theirs]))
            assert won.count(True) == 1, (i, won)
            assert output.get(key) == (mine if won[0] else theirs)
            winners += 1
    assert winners == RACES
    if store.proxy is not None:
        assert store.proxy.counts["requests"] >= 2 * RACES  # through the proxy, not around it


def test_a_create_whose_answer_is_lost_reads_back_as_ours(store, quick_retries):
    """The store applies the create and the connection is reset before its answer: the retry is told
    the key exists (412 / 409); read back, the object is ours, so the create won. Another writer's
    create of the same key then loses."""
    faulted(store)
    output = Output(store.location("lost-create"))
    store.rule("reset_after", **store.create_rule())
    assert output.create("shards/x.parquet", b"ours")
    assert store.proxy.counts["reset_after"] == 1
    assert not output.create("shards/x.parquet", b"theirs")
    assert output.get("shards/x.parquet") == b"ours"


def test_a_commit_whose_answer_is_lost_is_still_this_attempts(store, quick_retries, tiny_model, tmp_path):
    """A shard's manifest create loses its answer: the attempt reads it back, finds its own manifest
    and moves its images; `verify --deep` is clean. A second attempt of the shard then loses, and
    removes only its own staging."""
    faulted(store)
    out = store.location("lost-commit")
    worker, shards = setup_job(tmp_path, tiny_model, out, "files")
    store.rule("reset_after", **store.create_rule("shards"))
    result = worker.run_shard(shards[0])
    assert store.proxy.counts["reset_after"] == 1
    assert not result.committed_by_other and result.ok == 3
    report = verify(out, deep=True)
    assert report.clean and report.images == 3, report.text()
    again, _ = setup_job(tmp_path, tiny_model, out, "files")
    assert again.run_shard(shards[0]).committed_by_other
    assert verify(out, deep=True).clean


@pytest.mark.slow  # make test; the fast lane keeps the lost answers, the outage, the refusals
def test_a_commit_whose_moves_fail_keeps_its_staging_for_the_driver(store, quick_retries, tiny_model, tmp_path):
    """The manifest is committed, then every request touching the staging fails: the attempt says
    its move did not finish and deletes nothing; the driver's sweep (`finish_attempts`) then
    finishes the move and `verify --deep` is clean."""
    from fleetgen.workers.output.parts import finish_attempts

    faulted(store)
    out = store.location("moves-fail")
    worker, shards = setup_job(tmp_path, tiny_model, out, "files")
    committed = store.rule("latency", **store.create_rule("shards"))  # no fault: marks the commit
    store.proxy.delay = 0.0
    store.rule("reset_before", path="_attempts", times=10**6, after=committed)
    with pytest.raises(ShardError, match="committed, but its objects did not all reach their final keys"):
        worker.run_shard(shards[0])
    store.proxy.reset()
    output = Output(out)
    assert output.exists("shards/shard-00000.parquet") and output.find("_attempts")
    assert finish_attempts(output) == (1, 0)
    assert verify(out, deep=True).clean


@pytest.mark.parametrize("op", ["put", "create", "listing"])
def test_an_outage_is_retried_then_one_storage_error_naming_the_url(store, quick_retries, op):
    faulted(store)
    url = store.location(f"outage-{op}")
    output = Output(url)
    output.put("a.parquet", b"x")
    store.proxy.down = True
    calls = {
        "put": lambda: output.put("k", b"x"),
        "create": lambda: output.create("c", b"x"),
        "listing": lambda: output.listing("shards"),
    }
    with pytest.raises(StorageError) as err:
        calls[op]()
    message = str(err.value)
    assert "\n" not in message and url in message and "after 4 attempts" in message, message


@pytest.mark.slow  # make test; the fast lane keeps the lost answers, the outage, the refusals
def test_two_drivers_starting_together_one_holds_the_lock(store):
    """Two drivers claim a free output at once, 5 times: one holds it, the other is told who."""
    for i in range(5):
        output = Output(store.location(f"lock-{i}"))
        locks = [OutputLock(output), OutputLock(output)]
        gate = threading.Barrier(2)

        def claim(lock: OutputLock, gate: threading.Barrier = gate) -> str:
            gate.wait()
            try:
                lock.acquire()
                return "held"
            except StorageError as err:
                return str(err)

        with ThreadPoolExecutor(2) as pool:
            outcomes = list(pool.map(claim, locks))
        assert outcomes.count("held") == 1, outcomes
        other = next(o for o in outcomes if o != "held")
        assert "claimed at the same moment by" in other or "in use by another fleetgen driver" in other, other
        for lock, outcome in zip(locks, outcomes, strict=True):
            if outcome == "held":
                lock.release()


@pytest.mark.slow  # make test; the fast lane keeps the lost answers, the outage, the refusals
def test_a_worker_whose_driver_was_taken_over_does_not_commit(store, tiny_model, tmp_path):
    """Once another driver's lock replaces its driver's, a worker's attempt gives up and leaves
    nothing on the store."""
    out = store.location("take-over")
    output = Output(out)
    worker, shards = setup_job(tmp_path, tiny_model, out, "files", lock_token="mine")
    lock = {"host": "here", "pid": 1, "owner": "here pid 1", "started": 0, "heartbeat": 0}
    output.put(LOCK, json.dumps({**lock, "token": "mine"}).encode())
    assert worker.run_shard(shards[0]).ok == 3
    output.put(LOCK, json.dumps({**lock, "token": "theirs", "owner": "there pid 2"}).encode())
    with pytest.raises(ShardError, match=r"lock is held by another driver \(there pid 2\)"):
        worker.run_shard(shards[1])
    assert not output.exists("shards/shard-00001.parquet")
    assert not [k for k in output.find("") if k.startswith(("_attempts/", "images/shard-00001"))]


@pytest.mark.slow  # make test; the fast lane keeps the lost answers, the outage, the refusals
def test_a_winner_that_died_moving_is_finished_by_verify_fix(store, tiny_model, tmp_path, capsys):
    """The commit landed, the moves did not (the worker died): `verify` names the missing images and
    the staging; `verify --fix` finishes the move from the staging instead of redoing the shard."""
    out = store.location("fix")
    output = Output(out)
    worker, shards = setup_job(tmp_path, tiny_model, out, "files")
    worker.run_shard(shards[0])
    attempt = attempt_of(output.get("shards/shard-00000.parquet"))
    images = output.find("images/shard-00000")
    assert len(images) == 3
    for key in images:
        output.move(key, f"_attempts/shard-00000/{attempt}/{key}")
    report = verify(out)
    assert report.counts["missing"] == 3 and report.counts["leftover"] == 1, report.text()
    assert main(["verify", out, "--deep", "--fix"]) == 0
    assert verify(out, deep=True).clean
    assert output.find("images/shard-00000") == images and not output.find("_attempts")


def test_a_backend_that_cannot_create_atomically_is_refused_unless_accepted(tiny_model, tmp_path, capsys):
    """`memory://` (any fsspec backend without create-if-absent): one line, exit 2, before any worker
    starts, naming the option; accepted, a worker commits there by a check, then a write."""
    prompts = write_prompts(tmp_path / "p.parquet", ["a fox"])
    assert main(["run", *run_args(str(prompts), "memory://unsafe/out", tiny_model)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--allow-unsafe-commits" in err and "cannot commit atomically on `memory://`" in err, err
    worker, shards = setup_job(tmp_path, tiny_model, "memory://unsafe/out", "files")
    assert not worker.output.atomic_create
    assert worker.run_shard(shards[0]).ok == 3


HINTS = {
    "s3": "set AWS_ACCESS_KEY_ID",
    "gcs": "set GOOGLE_APPLICATION_CREDENTIALS",
    "azure": "set AZURE_STORAGE_CONNECTION_STRING",
}


def test_a_refused_caller_is_told_at_once_what_to_set(store):
    """The store answers 401/403 in its own dialect (S3's AccessDenied, GCS' 401 for an anonymous
    caller, Azure's AuthenticationFailed): no retry, one line with the store's credentials to set."""
    faulted(store)
    url = store.location("refused")
    store.rule("denied", times=10**6)
    with pytest.raises(StorageError) as err:
        Output(url).check()
    message = str(err.value)
    assert "\n" not in message and url in message and HINTS[store.name] in message, message
    assert store.proxy.counts["denied"] <= 2, store.proxy.counts  # refused, not retried four times


def test_a_denied_credential_is_one_line_naming_what_to_set(_azure_stack, monkeypatch):
    """Azurite checks the account key as Azure does: a wrong one is refused (403), and the job's
    first look at its output says so in one line, with what to set."""
    from tests.stores import AZURE_KEY, azure_connection

    wrong = azure_connection(_azure_stack.ports["proxy"]).replace(AZURE_KEY, "d3Jvbmc=" * 11)
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", wrong)
    import adlfs

    adlfs.AzureBlobFileSystem.clear_instance_cache()
    try:
        with pytest.raises(StorageError) as err:
            Output("az://denied/out").check()
    finally:
        adlfs.AzureBlobFileSystem.clear_instance_cache()
    message = str(err.value)
    assert "\n" not in message and "az://denied/out" in message, message
    assert "set AZURE_STORAGE_CONNECTION_STRING" in message, message


def test_a_store_server_whose_port_was_taken_is_told_apart_from_one_that_started():
    """The harness itself (tests/stores.py): a server that finds its port taken (another pytest worker's
    emulator, a Ray process) exits, and the process listening there is not taken for it; one that binds is."""
    import socket
    import subprocess
    import sys

    from tests.stores import free_port, wait_listening

    def server(port):
        return subprocess.Popen(
            [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        late = server(taken.getsockname()[1])
        try:
            assert wait_listening(taken.getsockname()[1], late, "late") is False
        finally:
            late.kill()
            late.wait()
    ours = server(free_port())
    try:
        assert wait_listening(int(ours.args[3]), ours, "ours") is True
    finally:
        ours.kill()
        ours.wait()
