"""The 2025-26 families (FLUX.2 dev and klein, Qwen-Image, Z-Image, HunyuanImage 2.1, Chroma, HiDream) on
tiny pipelines of their real classes: sizes, negatives, guidance, long prompts, warnings."""

import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from PIL import Image as PILImage

from fleetgen.errors import ShardError
from fleetgen.jobs.sharding import plan_shards, read_footer, resolve_columns
from fleetgen.workers.families.detect import FAMILIES
from fleetgen.workers.families.model_dir import size_multiple
from fleetgen.workers.pipeline.calls import call_kwargs
from fleetgen.workers.pipeline.load import pipe_size_multiple
from fleetgen.workers.rows.batches import Look
from fleetgen.workers.rows.shard import Columns
from fleetgen.workers.spec import GenerationSettings, WorkerSpec
from fleetgen.workers.worker import Worker
from tests.conftest import CARDS, write_prompts

# What each model's card (its published example call) and the pipeline's `__call__` say, written
# here independently of the table: (steps, guidance, dtype, how a negative prompt is taken).


@pytest.fixture(scope="module")
def models(frontier_models):
    return frontier_models


ROOT = Path(__file__).resolve().parents[3]


LONG = " ".join(["a red fox in the forest at night"] * 20)  # 160 words: 162 tokens here


def _columns(path):
    files = [read_footer(str(path))]
    return plan_shards(files, 100)[0], resolve_columns(files, Columns())


def _run(model, out, family, path, **settings) -> dict:
    """One shard through a worker in this process (no Ray): {id: its manifest row}."""
    shard, columns = _columns(path)
    base = {"steps": 2, "guidance": FAMILIES[family].guidance, "width": 64, "height": 64, "family": family}
    spec = WorkerSpec.of(
        "w0",
        model,
        str(out),
        GenerationSettings(**{"task": "text-to-image", **base, **settings}),
        columns,
        max_batch=2,
        device="cpu",
    )
    Worker(spec).run_shard(shard)
    return {r["id"]: r for r in pq.read_table(Path(out) / "shards").to_pylist()}


@pytest.mark.parametrize("family", sorted(CARDS))
def test_each_makes_the_size_asked_and_records_what_it_used(family, models, tmp_path):
    """128x64 (not square: HiDream rescales any size to its default area unless pinned)."""
    path = write_prompts(tmp_path / "p.parquet", ["a red fox", "a blue owl"], id=["a", "b"])
    rows = _run(models[family], tmp_path / "out", family, path, width=128, height=64)
    assert {r["status"] for r in rows.values()} == {"ok"}, rows
    for r in rows.values():
        assert (r["width"], r["height"], r["steps"], r["guidance"]) == (128, 64, 2, FAMILIES[family].guidance)
        assert PILImage.open(tmp_path / "out" / r["image"]).size == (128, 64)


@pytest.mark.slow
def test_a_pipeline_that_rescales_is_an_error_row_never_a_wrong_record(models, tmp_path):
    """HiDream called without the area pin (as the generic entry calls it): it makes its default
    area, and the rows say so instead of recording the asked size over other pixels."""
    path = write_prompts(tmp_path / "p.parquet", ["a red fox", "a blue owl"], id=["a", "b"])
    with pytest.raises(ShardError, match="FleetgenError: HiDreamImagePipeline made 360x180 where 128x64 was asked"):
        _run(models["hidream"], tmp_path / "out", "generic", path, width=128, height=64, guidance=5.0)
    assert not list((tmp_path / "out").rglob("*.png"))  # every row failed: the shard is retried, nothing stored


@pytest.mark.parametrize("family", ["z-image", "chroma", "hidream", "hunyuanimage"])
def test_negatives_change_the_images_where_the_family_applies_them(family, models, tmp_path):
    plain = write_prompts(tmp_path / "p.parquet", ["a red fox"], id=["a"])
    negative = write_prompts(tmp_path / "n.parquet", ["a red fox"], id=["a"], negative_prompt=["blurry dark"])
    a = _run(models[family], tmp_path / "plain", family, plain)["a"]
    b = _run(models[family], tmp_path / "neg", family, negative)["a"]
    assert a["status"] == b["status"] == "ok" and a["sha256"] != b["sha256"]


def test_qwen_image_guidance_is_its_true_cfg_with_a_blank_negative(models, tmp_path):
    """Its guidance goes to `true_cfg_scale`, which runs only with a negative prompt: " " stands in
    for rows without one (as its card does), so guidance 4 and guidance 1 differ."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(models["qwen-image"])
    kwargs = call_kwargs(
        pipe,
        FAMILIES["qwen-image"],
        ["a", "b"],
        [None, "dark"],
        Look(64, 64, 2, 4.0),
        true_cfg_scale=None,
        generator=None,
    )
    assert kwargs["true_cfg_scale"] == 4.0 and "guidance_scale" not in kwargs
    assert kwargs["negative_prompt"] == [" ", "dark"]
    path = write_prompts(tmp_path / "p.parquet", ["a red fox"], id=["a"])
    four = _run(models["qwen-image"], tmp_path / "g4", "qwen-image", path)["a"]
    one = _run(models["qwen-image"], tmp_path / "g1", "qwen-image", path, guidance=1.0)["a"]
    assert four["sha256"] != one["sha256"]


def test_hunyuanimage_guidance_reaches_its_guiders(models, tmp_path):
    path = write_prompts(tmp_path / "p.parquet", ["a red fox"], id=["a"])
    a = _run(models["hunyuanimage"], tmp_path / "a", "hunyuanimage", path)["a"]
    b = _run(models["hunyuanimage"], tmp_path / "b", "hunyuanimage", path, guidance=7.0)["a"]
    again = _run(models["hunyuanimage"], tmp_path / "c", "hunyuanimage", path)["a"]
    assert a["sha256"] != b["sha256"] and a["sha256"] == again["sha256"]


@pytest.mark.parametrize(("family", "limit"), [("hidream", 128), ("flux2", 512), ("qwen-image", 512)])
def test_a_long_prompt_is_noted_by_its_encoders_limit(family, limit, models, tmp_path):
    prompt = LONG if limit < 162 else " ".join([LONG] * 4)
    path = write_prompts(tmp_path / "p.parquet", [prompt], id=["long"])
    row = _run(models[family], tmp_path / "out", family, path)["long"]
    assert row["status"] == "ok"
    assert row["warning"].startswith(f"prompt truncated to {limit} of ")


def test_size_multiples_agree_between_the_configs_and_the_loaded_pipeline(models):
    from diffusers import DiffusionPipeline

    for family in ("flux2", "qwen-image", "z-image", "hunyuanimage", "chroma", "hidream"):
        multiple, reason = size_multiple(models[family])
        pipe = DiffusionPipeline.from_pretrained(models[family])
        assert multiple == pipe_size_multiple(pipe, FAMILIES[family].size_floor), (family, reason)
    assert size_multiple(models["hunyuanimage"])[0] == 64  # twice its VAE's scale, as its pipeline demands


@pytest.mark.slow
def test_a_pipelines_own_warning_reaches_the_log_once_per_worker(models, tmp_path):
    """FLUX.2 klein distilled warns on every call that guidance above 1 is ignored: one line in the
    worker's stderr for three calls (a worker of its own, as an actor is)."""
    path = write_prompts(tmp_path / "p.parquet", ["a", "b", "c", "d", "e"])
    script = (
        "import sys; from tests.workers.families.test_frontier import _run; "
        "_run(sys.argv[1], sys.argv[2], 'flux2-klein', sys.argv[3], guidance=4.0)"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, models["flux2-klein"], str(tmp_path / "out"), str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if "diffusers says:" in line]
    assert lines == ["[fleetgen] w0: diffusers says: Guidance scale 4.0 is ignored for step-wise distilled models."]
