"""fleetgen as a Ray Data stage (`fleetgen.ray_data.generate`, cluster/ray_data.py), in real Ray Data
pipelines on the session's Ray, with the tiny models: the pixels a job makes for the same rows, the
input's columns carried, options refused before anything runs, a bad row an error row, an autoscaling
pool with scores and a keep rule, video rows."""

from __future__ import annotations

import hashlib
import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import fleetgen.ray_data
from fleetgen.errors import ConfigError, InputError
from fleetgen.jobs.driver import run_job
from tests.conftest import FAST, make_job

# The tiny sizes a job's tests use, as keywords (the stage's pool: one actor unless a test says)
OPTIONS = {k: v for k, v in FAST.items() if k != "workers"}


def dataset(table: pa.Table):
    import ray

    from fleetgen.cluster.warm import free_parked

    free_parked()  # the session's parked job workers hold its CPUs: the stage's actors need them
    return ray.data.from_arrow(table)


def digest(data: bytes | None) -> str | None:
    return None if data is None else hashlib.sha256(data).hexdigest()


def test_the_same_rows_make_a_jobs_pixels_and_keep_their_columns(tiny_model, tmp_path, ray_cluster):
    """Rows with a per-row `steps` column and a carried `label`: each image's bytes are the ones `fleetgen
    run` stores for that row, with its seed and record; the input's columns come out as they went in; the
    actors' records are at `stats`, and `fleet` reads them."""
    table = pa.table(
        {
            "id": [f"r{i}" for i in range(5)],
            "prompt": [f"a lighthouse number {i}" for i in range(5)],
            "label": pa.array([10, 11, 12, 13, None], pa.int16()),
            "steps": pa.array([2, 3, 2, None, 3], pa.int32()),
        }
    )
    pq.write_table(table, tmp_path / "p.parquet")
    job = run_job(make_job(tmp_path / "p.parquet", tiny_model, tmp_path / "job"), progress_stream=io.StringIO())
    assert job.complete and job.images_ok == 5
    manifest = {r["id"]: r for r in pq.read_table(tmp_path / "job" / "shards" / "shard-00000.parquet").to_pylist()}
    said = io.StringIO()
    stage = fleetgen.ray_data.generate(
        dataset(table), tiny_model, stats=str(tmp_path / "stats"), progress=said, **OPTIONS
    ).materialize()
    out = stage.take_all()
    assert "model family sd" in said.getvalue() and "per-row settings: steps ← `steps`" in said.getvalue()
    assert sorted(r["id"] for r in out) == sorted(manifest)
    for row in out:
        made = manifest[row["id"]]
        assert row["status"] == "ok" and row["error"] is None
        assert digest(row["image"]) == row["sha256"] == made["sha256"], row["id"]  # the job's pixels, byte for byte
        assert (row["seed"], row["steps"], row["prompt"]) == (made["seed"], made["steps"], made["prompt"])
        assert row["label"] == table.column("label")[int(row["id"][1:])].as_py()  # carried as it was
        assert row["model"] == tiny_model and row["plan"] == "all resident, batch 4"
        assert row["worker"].startswith("rd-") and row["image"][:8] == b"\x89PNG\r\n\x1a\n"
    schema = stage.schema().base_schema
    assert schema.field("label").type == pa.int16() and schema.field("image").type == pa.binary()
    (record,) = (tmp_path / "stats" / "workers").glob("rd-*.json")
    first = json.loads(record.read_text())
    assert first["plan"]["batch_size"] == 4 and "restarts" not in first and first["stats"]["images"] == 5
    assert "plans by device kind:" in fleetgen.ray_data.fleet(str(tmp_path / "stats"))


def test_options_are_refused_before_anything_runs(tiny_model, tmp_path, ray_cluster):
    """A misspelt option, a job's own setting, a bad value, a dataset the seeds cannot be derived for: each
    raised by `generate` itself (nothing executed), worded as `fleetgen run` words it."""
    ds = dataset(pa.table({"id": ["a"], "prompt": ["a fox"]}))
    with pytest.raises(ConfigError, match=r"no option `stpes`\. Did you mean `steps`\?"):
        fleetgen.ray_data.generate(ds, tiny_model, stpes=4)
    with pytest.raises(ConfigError, match=r"takes no `output_format`: a Ray Data pipeline stores its rows"):
        fleetgen.ray_data.generate(ds, tiny_model, output_format="webdataset")
    with pytest.raises(ConfigError, match=r"`--steps` must be 1 or more, got `0`"):
        fleetgen.ray_data.generate(ds, tiny_model, steps=0)
    with pytest.raises(ConfigError, match="`batch_rows` must be 1 or more"):
        fleetgen.ray_data.generate(ds, tiny_model, batch_rows=0, **OPTIONS)
    with pytest.raises(ConfigError, match=r"`concurrency` must be a number of actors or `\(min, max\)`"):
        fleetgen.ray_data.generate(ds, tiny_model, concurrency=(2, 1), **OPTIONS)
    bare = dataset(pa.table({"prompt": ["a fox"]}))
    with pytest.raises(InputError, match="neither an id column .* nor a seed column"):
        fleetgen.ray_data.generate(bare, tiny_model, **OPTIONS)
    with pytest.raises(InputError, match="Input column `plan` would be carried"):
        fleetgen.ray_data.generate(dataset(pa.table({"id": ["a"], "prompt": ["x"], "plan": ["y"]})), tiny_model)
    toml = tmp_path / "job.toml"
    toml.write_text("retry_errors = true\n")
    with pytest.raises(ConfigError, match="takes no `retry_errors`: a stage resumes nothing"):
        fleetgen.ray_data.generate(ds, tiny_model, config=str(toml))


def test_an_unreadable_input_image_is_an_error_row(tiny_model, tmp_path, ray_cluster, monkeypatch):
    """Image-to-image rows, one naming a file that is not there, one with none: each of those an error row
    saying why, the others made; the pipeline does not fail. A relative path is the caller's directory's."""
    from PIL import Image

    Image.new("RGB", (40, 40), "red").save(tmp_path / "red.png")
    monkeypatch.chdir(tmp_path)
    table = pa.table(
        {
            "id": ["absolute", "relative", "gone", "none"],
            "prompt": ["w", "x", "y", "z"],
            "input_image": [str(tmp_path / "red.png"), "red.png", "nope.png", None],
        }
    )
    made = fleetgen.ray_data.generate(dataset(table), tiny_model, task="image-to-image", **OPTIONS)
    out = {r["id"]: r for r in made.take_all()}
    assert out["absolute"]["status"] == out["relative"]["status"] == "ok"
    assert out["relative"]["sha256"] == digest(out["relative"]["image"])
    assert out["relative"]["inputs"][0]["source"] == str(tmp_path / "red.png")
    assert out["gone"]["status"] == "error" and out["gone"]["image"] is None
    assert str(tmp_path / "nope.png") in out["gone"]["error"], out["gone"]["error"]
    assert out["none"]["status"] == "error" and "no input image" in out["none"]["error"]


def test_an_autoscaling_pool_scores_and_keeps_as_a_job_does(tiny_model, tiny_clip, ray_cluster):
    """`concurrency=(1, 2)` on the local Ray, two rows a call, two images a row: every image made once, a
    row each (the input's columns repeated), whichever actors Ray Data ran. `score` scores each picture in the pass; `keep` filters as a job's does: a row its rule
    rejects is `filtered`, keeps its score, says which rule and carries no picture; a row it passes is made."""
    prompts = ["a red fox", "an owl", "a ship", "a cat", "rain", "a hat"]
    table = pa.table({"id": list("abcdef"), "prompt": prompts, "label": list("ABCDEF")})
    stage = fleetgen.ray_data.generate(
        dataset(table),
        tiny_model,
        score=f"clip={tiny_clip}",
        keep="clip > 0",
        images_per_prompt=2,
        concurrency=(1, 2),
        batch_rows=2,
        **OPTIONS,
    )
    rows = stage.take_all()
    assert sorted(r["id"] for r in rows) == [f"{i}-{k}" for i in "abcdef" for k in (0, 1)]  # a row per image
    assert all(r["label"] == r["row_id"].upper() and r["id"] == f"{r['row_id']}-{r['image_index']}" for r in rows)
    assert len({r["seed"] for r in rows}) == 12 and 1 <= len({r["worker"] for r in rows}) <= 2
    for row in rows:
        assert -1 <= row["score_clip"] <= 1
        if row["score_clip"] > 0:
            assert row["status"] == "ok" and row["image"] and row["error"] is None
        else:
            assert row["status"] == "filtered" and row["image"] is None and "--keep 'clip > 0'" in row["error"]


def test_video_rows_hold_their_clips(tmp_path, ray_cluster):
    """A tiny Wan: each row's clip in `video` (an MP4 that decodes to its frames), its record's frames and fps."""
    import av

    from fleetgen import tiny_model as write

    write(str(tmp_path / "wan"), family="wan")
    table = pa.table({"id": ["fox", "owl"], "prompt": ["a fox", "an owl"], "num_frames": pa.array([5, 9], pa.int32())})
    opts = {**OPTIONS, "width": 32, "height": 32}
    rows = {r["id"]: r for r in fleetgen.ray_data.generate(dataset(table), str(tmp_path / "wan"), **opts).take_all()}
    for name, frames in (("fox", 5), ("owl", 9)):
        row = rows[name]
        assert row["status"] == "ok" and "image" not in row and row["num_frames"] == frames
        with av.open(io.BytesIO(row["video"])) as clip:
            assert sum(1 for _ in clip.decode(video=0)) == frames
        assert digest(row["video"]) == row["sha256"]
