"""`fleetgen report` and `fleetgen status` on real job outputs; the page opened in headless Chromium."""

import io
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from jobs.cli import main
from jobs.config import JobConfig, validate
from jobs.driver import run_job
from tests.conftest import FAST, write_prompts

pytestmark = pytest.mark.ray
ARTIFACTS = Path(os.environ.get("FLEETGEN_ARTIFACTS", Path(__file__).resolve().parents[1] / "test-artifacts"))


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
            [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={profile}", "--virtual-time-budget=5000", *extra, page.as_uri()],
            capture_output=True, text=True, timeout=120, check=True).stdout
    finally:
        shutil.rmtree(profile, ignore_errors=True)


@pytest.mark.parametrize("output_format", ["files", "parquet"])
def test_report_renders_with_every_image_loaded(ray_cluster, tiny_model, tmp_path, capsys, output_format):
    prompts = write_prompts(tmp_path / "p.parquet", [f"report <prompt> {i}" for i in range(30)] + [None])
    out = tmp_path / "out"
    config = validate(JobConfig(input=str(prompts), output=str(out), model=tiny_model, rows_per_shard=8, workers=2,
                                output_format=output_format, **FAST))
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
    (out / "job.json").write_text(json.dumps({"fingerprint": {"model": "m", "input": [{"rows": 10}],
                                                              "generation": {"rows_per_shard": 5}}, "shards_total": 2}))
    assert main(["status", str(out)]) == 1
    text = capsys.readouterr().out
    assert "stopped or failed (no driver running; rerun the same command to resume)" in text
    assert "shards 0/2 committed, rows 0/10" in text
    assert main(["status", str(tmp_path / "nothing")]) == 2
    assert "holds no fleetgen job" in capsys.readouterr().err
