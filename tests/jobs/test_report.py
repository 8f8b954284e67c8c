"""`fleetgen report` and `fleetgen status` on real job outputs; the page opened in headless Chromium."""

import io
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

import fleetgen.jobs.report
from fleetgen.cli import main
from fleetgen.errors import StorageError
from fleetgen.jobs.config import JobConfig, validate
from fleetgen.jobs.driver import run_job
from tests.conftest import FAST, write_prompts

ARTIFACTS = Path(os.environ.get("FLEETGEN_ARTIFACTS", Path(__file__).resolve().parents[2] / "test-artifacts"))


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if not found:
        if os.environ.get("CI"):
            pytest.fail("chromium is missing: .ci/run installs Debian's chromium package")
        pytest.skip("needs chromium (apt-get install chromium)")
    return found


def _browse(page: Path, *extra: str) -> str:
    profile = tempfile.mkdtemp()
    try:
        return subprocess.run(
            [
                chromium(),
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                f"--user-data-dir={profile}",
                "--virtual-time-budget=5000",
                *extra,
                page.as_uri(),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        ).stdout
    finally:
        shutil.rmtree(profile, ignore_errors=True)


@pytest.mark.parametrize("output_format", ["files", "parquet"])
def test_report_renders_with_every_image_loaded(ray_cluster, tiny_model, tiny_clip, tmp_path, capsys, output_format):
    styles = ["oil", "ink", "pencil"]
    prompts = write_prompts(
        tmp_path / "p.parquet",
        [f"report <prompt> {i}" for i in range(30)] + [None],
        style=[styles[i % 3] for i in range(31)],
    )
    out = tmp_path / "out"
    config = validate(
        JobConfig.of(
            input=str(prompts),
            output=str(out),
            model=tiny_model,
            rows_per_shard=8,
            output_format=output_format,
            score=f"clip={tiny_clip}",
            **FAST,
        )
    )
    assert run_job(config, progress_stream=io.StringIO()).complete

    assert main(["status", str(out)]) == 0
    status = capsys.readouterr().out
    assert "state: complete" in status and "shards 4/4 committed, rows 31/31: 30 images, 1 row errors" in status
    assert re.search(r"w0: cpu .*, batch 4, \d+ images", status)

    assert main(["report", str(out)]) == 0
    page = out / "report.html"
    text = page.read_text()
    assert "report &lt;prompt&gt; 0" in text  # prompts are escaped
    assert "prompt is null or empty" in text and "<th>img/s</th>" in text
    assert text.count('<figure class="card">') == 24
    # scored: the histogram over every image; grouped by a carried column; the sheet by the score
    import pyarrow.parquet as pq

    scores = {r["id"]: r for r in pq.read_table(out / "shards").to_pylist() if r["status"] == "ok"}
    assert "score_clip: mean" in text and "30 scored images (30 stored, 0 filtered) from 4 of 4 shards" in text
    assert main(["report", str(out), "--group-by", "style", "--sort-by", "clip"]) == 0
    text = page.read_text()
    assert "<h3>By style</h3>" in text and all(f"<tr><td>{s}</td><td>10</td>" in text for s in styles)
    shown = re.findall(r'<figure class="card">.*?<b>([^<]+)</b>', text)
    assert len(shown) == 24 and [scores[i]["score_clip"] for i in shown] == sorted(
        (scores[i]["score_clip"] for i in shown), reverse=True
    )
    assert main(["report", str(out), "--group-by", "nope"]) == 2
    assert "`--group-by nope` is not a column of the job's manifests" in capsys.readouterr().err
    # the scored job again: it resumes (nothing to make); with another scorer model it is another job
    again = run_job(config, progress_stream=io.StringIO())
    assert again.complete and again.shards_skipped == 4
    with pytest.raises(StorageError, match="scorers.clip differs"):
        run_job(config.with_options(score=f"clip={tiny_model}"), progress_stream=io.StringIO())
    dom = _browse(page, "--dump-dom")
    assert 'data-images-total="24"' in dom and 'data-images-loaded="24"' in dom
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / f"report-{output_format}.png"
    _browse(page, "--window-size=1280,1600", f"--screenshot={shot}")
    assert shot.stat().st_size > 10_000


def test_status_of_a_stopped_job_says_how_to_resume(tmp_path, capsys):
    import json

    out = tmp_path / "out"
    (out / "shards").mkdir(parents=True)
    (out / "job.json").write_text(
        json.dumps(
            {
                "fingerprint": {"model": "m", "input": [{"rows": 10}], "generation": {"rows_per_shard": 5}},
                "shards_total": 2,
            }
        )
    )
    assert main(["status", str(out)]) == 1
    text = capsys.readouterr().out
    assert "stopped or failed (no driver running; rerun the same command to resume)" in text
    assert "shards 0/2 committed, rows 0/10" in text
    assert main(["status", str(tmp_path / "nothing")]) == 2
    assert "holds no fleetgen job" in capsys.readouterr().err


def test_report_reads_a_sample_of_manifests_not_all(tmp_path, monkeypatch):
    """400 committed shards: the contact sheet reads 24 manifests spread over the job, the error
    list only manifests whose counts have errors, and stops at 50 rows."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    from fleetgen.jobs.report import not_ok_rows, sample_images
    from fleetgen.workers.output.commit import COUNTS_KEY
    from fleetgen.workers.output.layout import MANIFEST_SCHEMA
    from fleetgen.workers.output.storage import Output

    (tmp_path / "shards").mkdir()
    counts = {}
    for i in range(400):
        errors = 2 if i % 10 == 3 else 0  # 40 shards with 2 error rows each
        rows = [
            {
                "id": f"{i}-{k}",
                "row_id": f"{i}-{k}",
                "status": "error" if k < errors else "ok",
                "prompt": "p",
                "error": "bad" if k < errors else None,
                "image": None if k < errors else f"images/shard-{i:05d}/{k}.png",
            }
            for k in range(5)
        ]
        counts[f"shard-{i:05d}"] = {"rows": 5, "images": 5, "ok": 5 - errors, "error": errors, "filtered": 0}
        table = pa.Table.from_pylist(rows, schema=MANIFEST_SCHEMA).replace_schema_metadata(
            {COUNTS_KEY: json.dumps(counts[f"shard-{i:05d}"])}
        )
        pq.write_table(table, tmp_path / "shards" / f"shard-{i:05d}.parquet")
    read = []
    real = fleetgen.jobs.report.read_manifests
    monkeypatch.setattr(
        fleetgen.jobs.report, "read_manifests", lambda out, ids, cols: read.extend(ids) or real(out, ids, cols)
    )
    out = Output(str(tmp_path))
    sample = sample_images(out, counts)
    assert len(sample) == 24 and len(read) == 24 and all(r["status"] == "ok" for r in sample)
    assert int(read[0][6:]) < 20 and int(read[-1][6:]) > 380  # spread over the job
    read.clear()
    errors = not_ok_rows(out, counts)
    assert len(errors) == 50 and all(r["status"] == "error" for r in errors)
    assert len(read) == 32 and all(int(s[6:]) % 10 == 3 for s in read)  # 25 manifests hold 50: one batch of 32
