"""`fleetgen score OUT` (jobs/score.py): a finished job's stored images scored after the fact, in every
output format: the same numbers as the pass's for the same bytes, a table per scorer and shard committed
once, a rerun that skips what is scored, and one line with exit 2 for what cannot be scored."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from fleetgen.cli import main
from tests.workers.pipeline.test_scoring import run


@pytest.mark.parametrize(
    "output_format", ["files", *(pytest.param(f, marks=pytest.mark.slow) for f in ("webdataset", "parquet"))]
)
def test_scoring_a_finished_job_gives_the_pass_scores_and_resumes(
    output_format, tiny_model, tiny_clip, tmp_path, capsys
):
    manifest, out, _ = run(tiny_model, tmp_path, f"clip={tiny_clip}", output_format=output_format)
    assert main(["score", str(out), "--score", f"clip={tiny_clip}", "--device", "cpu", "--batch", "4"]) == 0
    said = capsys.readouterr().out
    assert "scored 6 images with clip in 1 shards (0 already scored, 0 score errors)" in said
    table = pq.read_table(out / "scores" / "clip" / "shard-00000.parquet").to_pylist()
    assert {r["id"] for r in table} == set(manifest)
    for r in table:  # the stored PNGs are the pass's pixels: its scores, within batch rounding
        assert r["score_clip"] == pytest.approx(manifest[r["id"]]["score_clip"], abs=1e-5) and r["score_error"] is None
    # a rerun: nothing to do; a table lost: only its shard again
    assert main(["score", str(out), "--score", f"clip={tiny_clip}", "--device", "cpu"]) == 0
    assert "scored 0 images with clip in 0 shards (1 already scored" in capsys.readouterr().out
    (out / "scores" / "clip" / "shard-00000.parquet").unlink()
    assert main(["score", str(out), "--score", f"clip={tiny_clip}", "--device", "cpu"]) == 0
    assert "scored 6 images with clip in 1 shards" in capsys.readouterr().out


def test_what_cannot_be_scored_is_one_line_and_exit_2(tiny_model, tiny_clip, tmp_path, capsys):
    from fleetgen.workers.tiny.scorers import write_tiny_scorer

    _, out, _ = run(tiny_model, tmp_path, f"clip={tiny_clip}")
    other = write_tiny_scorer(tmp_path / "other-clip", "clip", seed=1)
    assert main(["score", str(out), "--score", f"clip={tiny_clip}", "--device", "cpu"]) == 0
    capsys.readouterr()
    for args, said in [
        (["--score", f"clip={other}"], "holds clip scores by"),  # another model under the same name
        (["--score", "clipp"], "`--score` takes NAME[=MODEL],..."),
        (["--score", "clip=./nowhere"], "`--score clip=./nowhere`: no such file or directory"),
    ]:
        assert main(["score", str(out), *args, "--device", "cpu"]) == 2
        err = capsys.readouterr().err.strip()
        assert said in err and "\n" not in err, err
    assert main(["score", str(tmp_path / "nothing"), "--score", f"clip={tiny_clip}"]) == 2
    assert "holds no fleetgen job" in capsys.readouterr().err


def test_scoring_on_ray_workers_gives_the_same_tables_and_resumes(tiny_model, tiny_clip, ray_cluster, tmp_path, capsys):
    """`fleetgen score --workers 2`: three shards over two Ray workers on the session's Ray, each table the
    pass's scores; a rerun skips all three; a lost table is scored again."""
    manifest, out, _ = run(tiny_model, tmp_path, f"clip={tiny_clip}", rows=2)
    args = ["score", str(out), "--score", f"clip={tiny_clip}", "--device", "cpu", "--workers", "2"]
    assert main(args) == 0
    assert "scored 6 images with clip in 3 shards (0 already scored, 0 score errors)" in capsys.readouterr().out
    tables = sorted(p.name for p in (out / "scores" / "clip").glob("*.parquet"))
    assert tables == ["shard-00000.parquet", "shard-00001.parquet", "shard-00002.parquet"]
    import pyarrow.dataset

    for r in pyarrow.dataset.dataset(str(out / "scores" / "clip")).to_table().to_pylist():  # as the guide reads them
        assert r["score_clip"] == pytest.approx(manifest[r["id"]]["score_clip"], abs=1e-5) and r["score_error"] is None
    assert main(args) == 0
    assert "scored 0 images with clip in 0 shards (3 already scored" in capsys.readouterr().out
    (out / "scores" / "clip" / "shard-00001.parquet").unlink()
    assert main(args) == 0
    assert "scored 2 images with clip in 1 shards (2 already scored" in capsys.readouterr().out
