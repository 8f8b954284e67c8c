"""The docs work as written: the guides (docs/guides/) run block by block, in a fresh directory, with the
`fleetgen` this checkout installs on PATH (as after `make demo`'s install or `pip install -e .`); every
`fleetgen` command of the README and the docs parses. The README's `ray job submit` line is submitted by
copy in tests/e2e/test_submit.py."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


DOCS = ROOT / "docs"


def pages() -> list[Path]:
    """The README and every page of the docs."""
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def blocks(guide: str) -> list[tuple[str, str]]:
    """(language, code) of each fenced block of a guide (docs/guides/<guide>.md)."""
    return re.findall(r"```(\w+)\n(.*?)```", (DOCS / "guides" / f"{guide}.md").read_text(), flags=re.S)


def shell(code: str, cwd: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "-euo", "pipefail", "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )


@pytest.fixture
def user_env(ray_address, tmp_path) -> dict:
    """A user's shell: `fleetgen` and `python` on PATH; this session's Ray (saves starting one per
    command; the commands are the README's, unchanged)."""
    return {
        **os.environ,
        "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
        "RAY_ADDRESS": ray_address,
        "PYTHONPATH": str(ROOT),
    }


def walk_through(guide: str, user_env: dict, tmp_path: Path) -> tuple[str, subprocess.CompletedProcess, dict]:
    """A walk-through of three blocks run as written: the Python that makes the input, the shell
    commands, the Python that loads the result. Returns (the commands, what they printed, the last
    block's namespace)."""
    found = blocks(guide)
    assert [lang for lang, _ in found] == ["python", "bash", "python"]
    (_, make_input), (_, commands), (_, load) = found
    done = subprocess.run(
        [sys.executable, "-c", make_input], cwd=tmp_path, env=user_env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    done = shell(commands, tmp_path, user_env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    namespace: dict = {}
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        exec(compile(load, f"docs/guides/{guide}.md", "exec"), namespace)  # noqa: S102 - the guide's own code
    finally:
        os.chdir(cwd)
    return commands, done, namespace


def test_synthesising_a_dataset_runs_as_written(user_env, tmp_path):
    _, done, namespace = walk_through("synthesis", user_env, tmp_path)
    assert "18 images (0 row errors)" in done.stdout and "1/1 shards committed" in done.stdout
    assert "clean" in done.stdout.splitlines()[-1]  # `fleetgen verify out/animals --deep`
    first = namespace["ds"][0]
    assert (first["id"], first["row_id"], first["prompt"]) == ("cat-photo-0", "cat-photo", "a photo of a cat")
    assert (first["label"], first["style"], first["class_id"]) == ("cat", "photo", 0)
    assert first["image"].size == (64, 64) and len(namespace["ds"]) == 18
    assert all(-1 <= r["score_clip"] <= 1 for r in namespace["ds"])  # `--score clip=./tiny-clip`, every image


def test_editing_a_folder_of_images_runs_as_written(user_env, tmp_path):
    commands, done, namespace = walk_through("editing", user_env, tmp_path)
    assert "4 images (0 row errors)" in done.stdout and "clean" in done.stdout.splitlines()[-1]
    assert "task image-to-image (`--task image-to-image`" in done.stderr  # the driver's log
    before, after, ds = namespace["before"], namespace["after"], namespace["ds"]
    assert before.size == after.size == (64, 64) and len(ds) == 4
    rows = {r["id"]: r for r in ds}
    assert before.convert("RGB").getpixel((32, 32)) == (255, 0, 0)  # photos/0.png, red, cropped to 64x64
    assert rows["0"]["inputs"][0]["source"] == str(tmp_path / "photos" / "0.png")
    assert [round(rows[k]["strength"], 2) for k in "0123"] == [0.3, 0.5, 0.7, 0.9]
    # the same job again: nothing to do; then an input replaced under its path refuses the resume
    run_line = commands.split("fleetgen run", 1)[1].split("fleetgen verify")[0].replace("\\\n", " ")
    again = shell("fleetgen run" + run_line, tmp_path, user_env)
    assert again.returncode == 0 and "resuming: 1 of 1 shards already committed" in again.stderr
    # the report pairs each output with its input, read from where the worker read it
    report = shell("fleetgen report out/night", tmp_path, user_env)
    assert report.returncode == 0, report.stderr[-2000:]
    page = (tmp_path / "out" / "night" / "report.html").read_text()
    assert page.count('<img class="input" src="data:image/png;base64,') == 4
    from PIL import Image

    Image.new("RGB", (96, 80), "purple").save(tmp_path / "photos" / "2.png")
    refused = shell("fleetgen run" + run_line, tmp_path, user_env)
    assert refused.returncode == 2, refused.stdout[-2000:] + refused.stderr[-2000:]
    assert "1 input image(s) changed" in refused.stderr and "photos/2.png" in refused.stderr
    assert "--overwrite" in refused.stderr
    shell("fleetgen report out/night", tmp_path, user_env)  # a changed input is named, not shown as the one used
    page = (tmp_path / "out" / "night" / "report.html").read_text()
    assert page.count('<img class="input"') == 3 and "photos/2.png (gone or changed)" in page


@pytest.mark.slow
def test_a_ray_data_pipeline_runs_as_written(user_env, tmp_path):
    """docs/guides/ray-data.md: a filter, the stage, three of Ray Data's own sinks, the fleet's records."""
    import pyarrow.parquet as pq
    import webdataset as wds
    from PIL import Image

    from fleetgen.cluster.warm import free_parked

    free_parked()  # the stage's actors run on the session's Ray, in this process (the last block is exec'd)
    _, _, namespace = walk_through("ray-data", user_env, tmp_path)
    rows = pq.read_table(tmp_path / "out" / "parquet").to_pylist()
    assert sorted(r["id"] for r in rows) == ["cat", "dog", "owl"]  # the filter ran before the stage
    assert all(r["status"] == "ok" and r["width"] == 64 and r["label"] in (0, 1, 2) for r in rows)
    images = {r["id"]: r["image"] for r in rows}
    samples = list(
        wds.WebDataset(sorted(map(str, (tmp_path / "out" / "webdataset").glob("*.tar"))), shardshuffle=False)
    )
    assert {s["__key__"]: s["png"] for s in samples} == images  # the same bytes through Ray Data's webdataset sink
    pngs = sorted((tmp_path / "out" / "png").glob("*.png"))
    assert len(pngs) == 3 and all(Image.open(p).size == (64, 64) for p in pngs)
    assert "plans by device kind:" in namespace["fleetgen"].ray_data.fleet(str(tmp_path / "out" / "stats"))


def test_the_plan_example_runs_as_written(tmp_path):
    text = (DOCS / "fitting.md").read_text()
    line = next(line for line in text.splitlines() if line.startswith("fleetgen plan --model"))
    done = shell(line, tmp_path, {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "flux.1-dev" in done.stdout and "80GiB" in done.stdout


def test_every_fleetgen_command_in_the_readme_and_the_docs_parses():
    """Each `fleetgen ...` line of a code block is a command the CLI takes (options that exist,
    values of the right type), so a renamed flag fails here, not in a user's shell."""
    from fleetgen.cli import _parser

    text = "\n".join(p.read_text() for p in pages())
    code = "\n".join(c for _, c in re.findall(r"```(\w+)\n(.*?)```", text, flags=re.S))
    lines = []
    for raw in code.replace("\\\n", " ").splitlines():
        line = raw.split("#", 1)[0].strip()
        if line.startswith(("fleetgen ", ".venv/bin/fleetgen ")):
            lines.append(line.split("fleetgen ", 1)[1])
    assert len(lines) >= 4, lines
    import shlex

    for line in lines:
        try:
            _parser().parse_args(shlex.split(line))
        except SystemExit as err:
            raise AssertionError(f"a documented command does not parse: fleetgen {line}") from err


def test_making_video_runs_as_written(user_env, tmp_path):
    _, done, namespace = walk_through("video", user_env, tmp_path)
    assert "3 clips (0 row errors)" in done.stdout and "clean" in done.stdout.splitlines()[-1]
    assert "5 frames at 16 fps (given)" in done.stderr  # the driver's log
    assert {f.size for f in namespace["frames"]} == {(64, 48)}  # the last sample's frames, as the guide decodes them
    import webdataset as wds

    from fleetgen.workers.output.video import read_clip

    tar = str(tmp_path / "out" / "clips" / "data" / "shard-00000.tar")
    clips = {s["__key__"]: read_clip(s["mp4"]) for s in wds.WebDataset(tar, shardshuffle=False)}
    assert {k: (c.frames, c.fps) for k, c in clips.items()} == {"fox": (9, 16.0), "owl": (5, 8.0), "ship": (13, 16.0)}
