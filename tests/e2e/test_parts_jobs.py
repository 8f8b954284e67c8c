"""A lost worker costs seconds, not a shard: whole jobs on the session's local Ray whose only worker is
SIGKILLed (an OOM kill, a preempted node) or SIGTERMed (a pod's or a spot node's notice) in the middle
of a one-shard job that commits in parts (workers/output/parts.py). Real processes, real signals."""

from __future__ import annotations

import io
import json
import re
import signal
import threading
import time

import pytest

from bench.chaos import Signaller, check
from fleetgen.jobs.driver import run_job
from fleetgen.workers.output.parts import chain_end
from fleetgen.workers.output.storage import Output
from tests.conftest import fast_settings, make_job, run_one_shard, write_prompts

ROWS, BATCH, STEPS = 24, 2, 12  # a batch takes 0.3-1 s at 12 steps on a 2-core machine
EVERY_WINDOW = 1e-6  # a part at every window's end: a window is one batch here


@pytest.fixture(scope="module")
def parts_input(tmp_path_factory, tiny_model, ray_cluster):
    """ROWS prompts, the images of one clean whole-shard attempt at the job's batches (the reference),
    and how long a batch took in it (this machine's pace: the kill test's interval follows it)."""
    root = tmp_path_factory.mktemp("parts")
    prompts = write_prompts(root / "p.parquet", [f"a lighthouse in fog, number {i}" for i in range(ROWS)])
    settings = fast_settings(steps=STEPS)
    worker, clean = run_one_shard(tiny_model, root / "clean", prompts, settings, rows=ROWS, max_batch=BATCH, threads=1)
    worker.close()
    batch_s = sum(r["seconds"] for r in clean.values()) / (ROWS / BATCH)  # each image's share of its batch
    return prompts, {k: r["sha256"] for k, r in clean.items()}, batch_s


def _run(prompts, model, out, sig: int, parts: int, since: int = 0, interval: float = EVERY_WINDOW, **kw):
    signaller = Signaller(out, sig, parts, since)
    signaller.start()
    job = make_job(
        prompts,
        model,
        out,
        rows_per_shard=ROWS,
        max_batch=BATCH,
        steps=STEPS,
        commit_interval=interval,
        cpu_threads=1,
        **kw,
    )
    summary = run_job(job, progress_stream=(log := io.StringIO()))
    signaller.done.set()
    signaller.join()
    assert signaller.sent and not signaller.sent["committed"], (signaller.sent, signaller.seen)  # mid-shard
    return summary, signaller.sent, log.getvalue()


@pytest.mark.ray
def test_a_worker_sigkilled_mid_shard_makes_again_only_what_it_made_since_its_last_part(
    parts_input, tiny_model, tmp_path
):
    prompts, clean, batch_s = parts_input
    out = tmp_path / "out"
    # a part about every third batch, at this machine's pace (a fixed interval outran a fast machine's
    # shard): killed after its first part, with a batch's images made since
    interval = 2.5 * batch_s
    summary, sent, log = _run(
        prompts, tiny_model, out, signal.SIGKILL, parts=1, since=BATCH, interval=interval, max_restarts=3
    )
    assert summary.complete and summary.images_ok == ROWS, log
    assert sent["rows"] >= BATCH  # what its parts held when it was killed: not made again
    # made twice: what it had made since its last part (stored, or a batch the writer had yet to store,
    # or one finished as the kill landed); a whole-shard commit would have made all of it again
    assert sent["since"] <= summary.images_redone <= sent["since"] + 2 * BATCH, (sent, summary.images_redone, log)
    assert {w["worker"]: w["images_redone"] for w in summary.workers}["w0"] == summary.images_redone
    assert check(out, clean) == {
        "rows": ROWS,
        "missing": 0,
        "duplicates": 0,
        "stray_objects": 0,
        "sha_mismatches": 0,
        "tmp_files": 0,
        "verify_deep": "clean",
    }
    assert not (out / "parts").exists() or not list((out / "parts").rglob("*"))


@pytest.mark.ray
def test_a_worker_sigtermed_mid_shard_commits_what_it_made_and_another_finishes(parts_input, tiny_model, tmp_path):
    prompts, clean, _ = parts_input
    out = tmp_path / "out"
    summary, sent, log = _run(prompts, tiny_model, out, signal.SIGTERM, parts=2, max_restarts=0)
    assert summary.complete and summary.images_ok == ROWS, log
    assert summary.images_redone == 0, log  # the batch in flight was finished and committed
    assert "w0 released: told to stop (SIGTERM)" in log, log
    assert check(out, clean)["sha_mismatches"] == 0 and check(out, clean)["verify_deep"] == "clean"
    events = json.loads((out / "fleet.json").read_text())["events"]
    assert any(e["worker"] == "w1" and e["event"] == "ready" for e in events), events  # another took the rest


@pytest.mark.ray
def test_a_run_stopped_mid_shard_resumes_after_its_parts_and_counts_them_done(parts_input, tiny_model, tmp_path):
    """A run stopped once its shard has a part (`stop`, as on SIGTERM, no grace): the rerun says what it
    found in parts, its progress starts there (never below), and every row is stored once."""
    prompts, clean, _ = parts_input
    out = tmp_path / "out"
    stop = threading.Event()

    def stop_after_a_part():
        deadline = time.monotonic() + 120
        while not list((out / "parts").rglob("*.parquet")) and time.monotonic() < deadline:
            time.sleep(0.01)
        stop.set()

    threading.Thread(target=stop_after_a_part, daemon=True).start()
    job = make_job(
        prompts,
        tiny_model,
        out,
        rows_per_shard=ROWS,
        max_batch=BATCH,
        steps=STEPS,
        commit_interval=EVERY_WINDOW,
        cpu_threads=1,
    )
    first = run_job(job, progress_stream=io.StringIO(), stop=stop)
    assert not first.complete and stop.is_set()
    rows = chain_end(Output(str(out)), "shard-00000")
    assert 0 < rows < ROWS
    log = io.StringIO()
    second = run_job(job, progress_stream=log, progress_interval=0.0)
    text = log.getvalue()
    assert second.complete and second.images_ok == ROWS, text
    assert f"resuming: {rows} rows of 1 open shard(s) committed in parts; each goes on from there" in text, text
    shown = [int(n) for n in re.findall(rf"rows (\d+)/{ROWS}", text)]
    assert shown and min(shown) >= rows and shown[-1] == ROWS, (rows, shown)
    assert check(out, clean)["sha_mismatches"] == 0 and check(out, clean)["verify_deep"] == "clean"
