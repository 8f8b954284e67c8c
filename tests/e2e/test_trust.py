"""Never "committed" over lost bytes: a store that loses answers, resets connections and goes away
(tests/faulty_store.py in front of a real S3 server), paths as users type them, and exit codes
scripts can trust. Workers run in this process (no Ray) here; whole jobs are in test_trust_jobs.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from fleetgen.cli import main
from fleetgen.errors import StorageError
from fleetgen.jobs.lock import OutputLock
from fleetgen.jobs.verify import verify
from fleetgen.workers.output import policy
from fleetgen.workers.output.storage import Output
from tests.conftest import setup_job
from tests.faulty_store import Rule

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def quick_retries(monkeypatch):
    """The storage policy's backoff at 10 ms: the same attempts, seconds sooner."""
    monkeypatch.setattr(policy, "BACKOFF", 0.01)


def bucket(name: str) -> str:
    import s3fs

    fs = s3fs.S3FileSystem()
    if not fs.exists(name):
        fs.mkdir(name)
    return f"s3://{name}/out"


@pytest.mark.parametrize(
    "lost",
    [pytest.param(1, id="client-retry-sees-412"), pytest.param(2, id="our-retry-sees-412", marks=pytest.mark.slow)],
)
@pytest.mark.parametrize("fmt", ["files", pytest.param("webdataset", marks=pytest.mark.slow)])  # fast lane: one format
def test_a_commit_whose_answer_is_lost_is_still_this_attempts(
    faulty_store, quick_retries, tiny_model, tmp_path, fmt, lost
):
    """The store applies the manifest's create-if-absent PUT and the connection is reset before the
    answer: the retry is told the key exists (412). The attempt reads it back, finds its own manifest
    and goes on — before, it gave up and deleted the images its committed manifest names."""
    out = bucket(f"lost-commit-{fmt}-{lost}")
    worker, shards = setup_job(tmp_path, tiny_model, out, fmt)
    faulty_store.add_rule(Rule("reset_after", method="PUT", path="/shards/", header="If-None-Match", times=lost))
    result = worker.run_shard(shards[0])
    assert faulty_store.counts["reset_after"] == lost  # the fault did happen, `lost` times
    assert not result.committed_by_other and result.ok == 3 and result.counts["ok"] == 3
    report = verify(out, deep=True)
    assert report.clean and report.images == 3, report.text()
    # A real loser still loses, and removes only its own staging.
    again, _ = setup_job(tmp_path, tiny_model, out, fmt)
    assert again.run_shard(shards[0]).committed_by_other
    assert verify(out, deep=True).clean


def test_a_move_whose_answer_is_lost_is_not_redone(faulty_store, quick_retries, tiny_model, tmp_path):
    """The winner's move of a staged image (copy, then delete) loses the delete's answer on every
    try the client makes: the retry finds the source gone and the destination there, and is done."""
    out = bucket("lost-move")
    worker, shards = setup_job(tmp_path, tiny_model, out, "files")
    faulty_store.add_rule(Rule("reset_after", method="DELETE", path="/_attempts/", times=2))
    assert worker.run_shard(shards[0]).ok == 3
    assert faulty_store.counts["reset_after"] == 2
    assert verify(out, deep=True).clean


@pytest.mark.slow
def test_a_commit_that_cannot_be_confirmed_keeps_its_staging_for_the_driver(
    faulty_store, quick_retries, tiny_model, tmp_path
):
    """The store applies the commit and then stops answering: the attempt cannot tell whether it
    won, so it deletes nothing; the driver's sweep (`finish_attempts`) then finishes the move."""
    from fleetgen.errors import ShardError
    from fleetgen.workers.output.parts import finish_attempts

    out = bucket("unconfirmed-commit")
    worker, shards = setup_job(tmp_path, tiny_model, out, "files")
    rule = faulty_store.add_rule(Rule("reset_after", method="PUT", path="/shards/", header="If-None-Match"))
    faulty_store.add_rule(Rule("reset_before", path="/shards/", times=100, after=rule))  # then shards/ is gone
    with pytest.raises(ShardError, match="could not tell whether its commit landed"):
        worker.run_shard(shards[0])
    assert rule.times == 0
    faulty_store.reset()
    output = Output(out)
    assert output.find("_attempts")  # the staged images are still there
    assert finish_attempts(output) == (1, 0)
    assert verify(out, deep=True).clean


@pytest.mark.parametrize(  # every Output method takes this path; the fast lane tries one
    "op", ["put", *(pytest.param(op, marks=pytest.mark.slow) for op in ("exists", "listing", "create"))]
)
def test_an_outage_is_retried_then_one_storage_error_naming_the_url(faulty_store, quick_retries, op):
    output = Output(bucket("outage-ops"))
    output.put("a.parquet", b"x")
    faulty_store.down = True
    calls = {
        "put": lambda: output.put("k", b"x"),
        "get": lambda: output.get("a.parquet"),
        "exists": lambda: output.exists("a.parquet"),
        "list": lambda: output.list("shards"),
        "listing": lambda: output.listing("shards"),
        "remove": lambda: output.remove("a.parquet"),
        "create": lambda: output.create("c", b"x"),
        "read_parquet": lambda: output.read_parquet("a.parquet"),
    }
    with pytest.raises(StorageError) as err:
        calls[op]()
    message = str(err.value)
    assert "\n" not in message and "s3://outage-ops/out" in message and "after 4 attempts" in message, message
    assert "EndpointConnectionError" in message or "ConnectionClosedError" in message, message


def test_no_credentials_is_one_line_with_what_to_set(s3_server, monkeypatch):
    import s3fs

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/credentials")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/config")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        with pytest.raises(
            StorageError,
            match=r"^Could not reach s3://no-creds/out: NoCredentialsError: Unable to "
            r"locate credentials \(set AWS_ACCESS_KEY_ID",
        ):
            Output("s3://no-creds/out").check()
    finally:
        s3fs.S3FileSystem.clear_instance_cache()


def test_the_lock_heartbeat_rides_out_an_outage_and_says_so(faulty_store, quick_retries, monkeypatch):

    import fleetgen.jobs.lock

    monkeypatch.setattr(fleetgen.jobs.lock, "HEARTBEAT", 0.2)
    said: list[str] = []
    output = Output(bucket("heartbeat"))
    lock = OutputLock(output, say=said.append)
    lock.acquire()
    faulty_store.down = True
    deadline = time.monotonic() + 10
    while not any("heartbeat failed" in s for s in said):
        assert time.monotonic() < deadline and lock._thread.is_alive()
        time.sleep(0.05)
    faulty_store.down = False
    while not any("heartbeat back" in s for s in said):
        assert time.monotonic() < deadline, said
        time.sleep(0.05)
    assert lock._thread.is_alive()  # it was never killed by the outage
    lock.release()
    assert not output.exists("_LOCK")
    assert "retrying every" in said[0] and "holds for 60 s" in said[0]


# -- paths as people type them ---------------------------------------------------------------------


def spellings(tmp_path: Path, monkeypatch) -> list[str]:
    """One output location, every way a user may name it (run from `tmp_path/a`, HOME `tmp_path`)."""
    real = tmp_path / "jobs" / "out"
    real.mkdir(parents=True)
    (tmp_path / "a").mkdir()
    (tmp_path / "link").symlink_to(real)
    monkeypatch.chdir(tmp_path / "a")
    monkeypatch.setenv("HOME", str(tmp_path))
    return [
        str(real),
        f"{real}/",
        "../jobs/out",
        "../jobs/./out/",
        "./../jobs/out",
        "~/jobs/out",
        f"file://{real}",
        f"file://{real}/",
        str(tmp_path / "link"),
        "../link/",
    ]


def test_every_spelling_of_a_local_output_is_one_location(tiny_model, tmp_path, monkeypatch, capsys):
    """A shard made through `../jobs/out` (the spelling that once put images under
    `out/00/<attempt>/images/...`) lands where every other spelling — and every command — looks."""
    names = spellings(tmp_path, monkeypatch)
    worker, shards = setup_job(tmp_path, tiny_model, "../jobs/out", "files")
    assert worker.run_shard(shards[0]).ok == 3
    real = tmp_path / "jobs" / "out"
    layout = sorted(p.relative_to(real).as_posix() for p in real.rglob("*") if p.is_file())
    assert layout == [
        "images/shard-00000/r0.png",
        "images/shard-00000/r1.png",
        "images/shard-00000/r2.png",
        "job.json",
        "shards/shard-00000.parquet",
        "workers/w0.json",
    ], layout
    for name in names:
        output = Output(name)
        assert output.url == str(real) and output.find("") == layout, name
        report = verify(name, deep=True)
        assert report.clean and report.images == 3, (name, report.text())
    assert main(["verify", "../link/", "--fix"]) == 0  # nothing to fix, nothing removed
    assert sorted(p.relative_to(real).as_posix() for p in real.rglob("*") if p.is_file()) == layout
    capsys.readouterr()


def test_verify_fix_changes_nothing_when_most_images_look_missing(tiny_model, tmp_path, capsys):
    """A location whose images are mostly gone is more likely the wrong place, or a store answering
    empty listings, than a job that lost its images: --fix says what it saw and keeps everything."""
    out = tmp_path / "out"
    worker, shards = setup_job(tmp_path, tiny_model, out, "files")
    for shard in shards:
        worker.run_shard(shard)
    for p in list((out / "images").rglob("*.png"))[:4]:
        p.unlink()
    assert main(["verify", str(out), "--fix"]) == 1
    text = capsys.readouterr().out
    assert "--fix refused: 4 of 6 images are missing" in text and "Nothing was changed" in text
    assert len(list((out / "shards").iterdir())) == 2  # both shards still committed
    assert main(["verify", str(out), "--fix", "--force"]) == 1
    assert not (out / "shards").exists() or not list((out / "shards").iterdir())


# -- exit codes ------------------------------------------------------------------------------------


def _exits(args: list[str], env: dict | None = None) -> tuple[int, str]:
    done = subprocess.run(
        [sys.executable, "-m", "fleetgen", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=120,
    )
    return done.returncode, done.stderr


@pytest.mark.slow
def test_parquet_reads_never_abort_the_process_at_exit(tmp_path):
    """pyarrow 26's `read_table` over a buffer aborts at exit ("terminate called without an active
    exception", exit 134) in about a third of runs; `storage.read_parquet` reads through
    `ParquetFile` and never does. 30 processes: the old way fails this with odds of 1 in ~10^5."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(256)], "x": list(range(256))}), path)
    code = (
        f"from fleetgen.workers.output.storage import read_parquet; data = open({str(path)!r}, 'rb').read(); "
        "read_parquet(data); read_parquet(data, ['id'])"
    )

    def once(_):
        return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True).returncode

    with ThreadPoolExecutor(2) as pool:
        codes = list(pool.map(once, range(30)))
    assert codes == [0] * 30, codes


_EXIT_LOOP = """
import json, os, sys
import fleetgen.jobs.status, fleetgen.jobs.verify  # imported once (no Parquet read yet: pyarrow starts no thread here)
from fleetgen.cli import main
runs = json.loads(sys.argv[1])
codes, running = {}, {}
for i, args in enumerate(runs):  # each a process of its own, forked after the imports, two at a time,
    if len(running) == 2:        # exiting through the interpreter's shutdown as `fleetgen` does
        pid, status = os.wait()
        codes[running.pop(pid)] = os.waitstatus_to_exitcode(status)
    pid = os.fork()
    if pid == 0:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        sys.exit(main(args))
    running[pid] = i
while running:
    pid, status = os.wait()
    codes[running.pop(pid)] = os.waitstatus_to_exitcode(status)
print(json.dumps([codes[i] for i in range(len(runs))]))
"""


RUNS = 40


@pytest.mark.slow
def test_status_and_verify_exit_0_forty_times(tiny_model, tmp_path):
    """Every `status` and `verify` exits 0 over a finished job, in processes that exit as `fleetgen`
    does. The abort at exit this guards against (pyarrow's, above) struck about a third of runs: 40
    runs (20 of each, 10 of them `--deep`) miss it with odds of 1 in ~10^7. (It ran 200 until they
    took two minutes of `make test`'s fifteen.)"""
    out = tmp_path / "out"
    worker, shards = setup_job(tmp_path, tiny_model, out, "parquet")
    for shard in shards:
        worker.run_shard(shard)
    # a finished job's records, as a run leaves them: status exits 0
    (out / "job.json").write_text(
        json.dumps(
            {
                "shards_total": 2,
                "fingerprint": {
                    "model": tiny_model,
                    "input": [{"url": "p.parquet", "bytes": 1, "rows": 6}],
                    "generation": {"rows_per_shard": 3, "output_format": "parquet"},
                },
            }
        )
    )
    (out / "summary.json").write_text("{}")
    (out / "_SUCCESS").write_text("")

    (out / "counts.parquet").unlink(missing_ok=True)  # status reads the manifests' footers (it does not write)
    runs = [
        ["status", str(out)] if i % 2 == 0 else ["verify", str(out), *(["--deep"] if i % 4 == 1 else [])]
        for i in range(RUNS)
    ]
    done = subprocess.run(
        [sys.executable, "-c", _EXIT_LOOP, json.dumps(runs)], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    codes = json.loads(done.stdout.strip().splitlines()[-1])
    assert codes == [0] * RUNS, [(i, c) for i, c in enumerate(codes) if c]


# -- refused up front, in one line -----------------------------------------------------------------


def _bad_inputs(tmp_path: Path, tiny_model: str, s3_server: str) -> list[tuple[list[str], dict, str]]:
    from tests.conftest import write_prompts

    prompts = str(write_prompts(tmp_path / "p.parquet", ["a", "b"]))
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    base = ["run", "--input", prompts, "--model", tiny_model, "--device", "cpu", "--steps", "1"]
    no_creds = {
        "AWS_ACCESS_KEY_ID": "",
        "AWS_SECRET_ACCESS_KEY": "",
        "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
        "AWS_CONFIG_FILE": "/nonexistent",
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    return [
        ([*base, "--output", str(afile)], {}, f"`--output` {afile} is a file, not a directory"),
        ([*base, "--output", "/proc/fleetgen-out"], {}, "`--output` /proc/fleetgen-out is not writable"),
        (
            [*base, "--output", str(tmp_path / "o"), "--width", "68"],
            {},
            "`--width` `68` is not a multiple of 8, which the model at",
        ),
        (
            [*base, "--output", "s3://fleetgen-nocreds/out"],
            no_creds,
            "NoCredentialsError: Unable to locate credentials",
        ),
        (
            [*base, "--output", "s3://fleetgen-unreachable/out"],
            {"AWS_ENDPOINT_URL": "http://127.0.0.1:9"},
            "Could not reach s3://fleetgen-unreachable/out after 2 attempts: EndpointConnectionError",
        ),
        (
            ["run", "--input", str(tmp_path / "nope.parquet"), "--output", str(tmp_path / "o"), "--model", tiny_model],
            {},
            "does not exist",
        ),
        (
            [*base, "--output", str(tmp_path / "o")],
            {"FLEETGEN_PLUGINS": "no_such_plugin"},
            "`FLEETGEN_PLUGINS` names `no_such_plugin`, which cannot be imported",
        ),
    ]


@pytest.mark.slow
def test_bad_input_is_refused_in_one_line_with_exit_2(tiny_model, tmp_path, s3_server):
    cases = _bad_inputs(tmp_path, tiny_model, s3_server)

    def one(case):
        args, env, expected = case
        return case, *_exits(args, env)

    with ThreadPoolExecutor(2) as pool:
        for (args, _, expected), code, stderr in pool.map(one, cases):
            lines = [line for line in stderr.splitlines() if line.strip() and not line.startswith("[transformers]")]
            assert code == 2 and "Traceback" not in stderr, (args, stderr[-2000:])
            assert len(lines) == 1 and lines[0].startswith("fleetgen: error: ") and expected in lines[0], (args, lines)


def test_every_cli_option_has_help_and_every_run_option_is_in_the_docs():
    import argparse
    import re

    from fleetgen.cli import _parser

    # the docs' table of `fleetgen run` options: its rows start with an option in backticks
    options = (ROOT / "docs" / "reference" / "options.md").read_text()
    table = "\n".join(line for line in options.splitlines() if line.startswith("| `--"))
    missing_help, missing_readme = [], []

    def walk(parser, path):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, [*path, name])
            elif not isinstance(action, argparse._HelpAction | argparse._VersionAction):
                if not action.help:
                    missing_help.append((path, action.option_strings or action.dest))
                if path == ["run"] and not any(
                    re.search(re.escape(f"`{o}") + r"(?![\w-])", table) for o in action.option_strings
                ):
                    missing_readme.append(action.option_strings)

    walk(_parser(), [])
    assert not missing_help and not missing_readme, (missing_help, missing_readme)
