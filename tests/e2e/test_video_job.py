"""A video job as a user runs it: `fleetgen run` on a tiny Wan pipeline with the family's defaults
where none are given, killed after its first commit and run again: only the unfinished clips are
made, every clip decodes, `verify --deep` is clean, `status` and the dataset card speak of clips."""

from __future__ import annotations

import io
import json
import os
import tarfile

import pytest

from fleetgen.cli import main
from fleetgen.jobs.driver import run_job
from fleetgen.workers.output.video import read_clip
from fleetgen.workers.tiny import write_tiny_model
from tests.conftest import kill_driver, make_job, run_args, start_driver, wait_for_commits, write_prompts

ROWS = 12


@pytest.mark.slow
def test_a_killed_video_job_resumes_and_redoes_only_unfinished_clips(ray_address, tmp_path, capsys):
    model = str(write_tiny_model(tmp_path / "wan", family="wan"))
    prompts = write_prompts(
        tmp_path / "p.parquet", [f"a red fox number {i}" for i in range(ROWS)], id=[f"r{i}" for i in range(ROWS)]
    )
    out = tmp_path / "out"
    video = {"steps": 4, "width": 64, "height": 48, "num_frames": 9, "rows_per_shard": 2, "workers": 1}
    args = run_args(prompts, out, model, output_format="webdataset", **video)
    env = {**os.environ, "RAY_ADDRESS": ray_address}
    proc = start_driver(args, env)
    wait_for_commits(out, 0, proc)
    kill_driver(proc)  # and its worker, which may commit the shard it was making until then
    committed = {p.name: p.stat().st_mtime_ns for p in (out / "shards").glob("*.parquet")}
    assert 0 < len(committed) < ROWS // 2, "the job ended before the kill: make it longer"
    tars = {p.name: p.stat().st_mtime_ns for p in (out / "data").glob("*.tar")}

    log = io.StringIO()
    config = make_job(prompts, model, out, output_format="webdataset", **video)
    summary = run_job(config, progress_stream=log)
    assert summary.complete and summary.shards_skipped == len(committed) and summary.unit == "clip"
    assert sum(w["images"] for w in summary.workers) == ROWS - 2 * len(committed)  # only unfinished clips
    assert "clips" in log.getvalue() and "s/clip" in log.getvalue()
    for name, mtime in committed.items():  # committed shards untouched: their manifests and tars
        assert (out / "shards" / name).stat().st_mtime_ns == mtime
        tar = name.replace(".parquet", ".tar")
        assert (out / "data" / tar).stat().st_mtime_ns == tars[tar]

    ids = []
    for path in sorted((out / "data").glob("*.tar")):
        with tarfile.open(path) as tar:
            for member in tar:
                if member.name.endswith(".mp4"):
                    clip = read_clip(tar.extractfile(member).read())
                    assert (clip.frames, clip.fps, clip.width, clip.height) == (9, 16.0, 64, 48)
                    ids.append(member.name.removesuffix(".mp4"))
    assert sorted(ids) == sorted(f"r{i}" for i in range(ROWS))  # every row once

    assert main(["verify", str(out), "--deep"]) == 0
    assert main(["status", str(out)]) == 0
    assert f"{ROWS} clips, 0 row errors" in capsys.readouterr().out
    card = (out / "README.md").read_text()
    assert f"**{ROWS} clips**" in card and "9 frames at 16 fps, mp4" in card
    job = json.loads((out / "job.json").read_text())["fingerprint"]["generation"]
    assert (job["task"], job["num_frames"], job["fps"], job["video_format"]) == ("text-to-video", 9, 16.0, "mp4")
