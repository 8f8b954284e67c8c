"""Which family a model is and what it defaults to (jobs/models.py): detection, the cards' defaults, flags over
them, and what a family cannot do refused before any worker, in one line; whole family jobs end to end."""

import io
import json

import pyarrow.parquet as pq
import pytest

from fleetgen.errors import ConfigError
from fleetgen.jobs.config import JobConfig, validate
from fleetgen.jobs.driver import run_job
from fleetgen.jobs.models import describe, resolve_defaults
from fleetgen.workers.families.detect import FAMILIES
from fleetgen.workers.rows.shard import Columns
from tests.conftest import run_one_shard, write_prompts
from tests.workers.families.test_families import _shard, _worker

TINY = {"width": 64, "height": 64, "device": "cpu", "workers": 1}


@pytest.fixture(scope="module")
def models(family_models):
    return family_models


@pytest.mark.slow  # each family's own default steps (20 to 50)
@pytest.mark.parametrize("family", ["sdxl", "sd3", "flux", "pixart-sigma", "sana"])
def test_each_family_resolves_its_defaults_and_runs(family, models, tmp_path):
    """The driver's resolution (what the job's log line says), then a worker in this process making
    the images at those defaults; the whole job on Ray, for one family, is the next test."""
    prompts = write_prompts(tmp_path / "p.parquet", ["a red fox", "a blue owl"])
    config = validate(JobConfig.of(input=str(prompts), output=str(tmp_path / "out"), model=models[family], **TINY))
    resolved, found, sources = resolve_defaults(config, _shard(prompts)[1])
    expected = FAMILIES[family]
    assert (found.name, resolved.generation.family, sources["steps"]) == (family, family, "family default")
    assert (resolved.generation.steps, resolved.generation.guidance) == (expected.steps, expected.guidance)
    line = f"model family {family} ({expected.pipelines[0]}): steps {expected.steps} (family default)"
    assert describe(resolved, found, sources).startswith(line)
    worker, rows = run_one_shard(models[family], tmp_path / "out", prompts, resolved.generation, max_batch=2, threads=1)
    worker.close()
    assert [r["status"] for r in rows.values()] == ["ok", "ok"]
    assert {r["steps"] for r in rows.values()} == {expected.steps}


def test_a_family_job_records_its_defaults(models, ray_cluster, tmp_path):
    prompts = write_prompts(tmp_path / "p.parquet", ["a red fox", "a blue owl"])
    log = io.StringIO()
    config = validate(JobConfig.of(input=str(prompts), output=str(tmp_path / "out"), model=models["sd3"], **TINY))
    summary = run_job(config, progress_stream=log, progress_interval=0)
    assert summary.complete and summary.images_ok == 2
    expected = FAMILIES["sd3"]
    job = json.loads((tmp_path / "out" / "job.json").read_text())
    assert job["family"]["name"] == "sd3" and job["family"]["sources"]["steps"] == "family default"
    generation = job["fingerprint"]["generation"]
    assert (generation["steps"], generation["guidance"], generation["family"]) == (
        expected.steps,
        expected.guidance,
        "sd3",
    )
    assert f"model family sd3 ({expected.pipelines[0]}): steps {expected.steps} (family default)" in log.getvalue()
    rows = pq.read_table(tmp_path / "out" / "shards").to_pylist()
    assert {r["steps"] for r in rows} == {expected.steps}


def test_flags_win_over_family_defaults(models, tmp_path):
    config = JobConfig.of(input="x", output="y", model=models["flux"], steps=3)
    resolved, family, sources = resolve_defaults(config, Columns.of("prompt", None, None, None))
    assert (family.name, resolved.generation.steps, resolved.generation.guidance) == ("flux", 3, 3.5)
    assert sources == {
        "steps": "given",
        "guidance": "family default",
        "dtype": "family default",
        "family": "FluxPipeline: its transformer has a guidance embedding (FLUX.1-dev)",
        "task": "FluxPipeline does text-to-image",
    }


def test_flux_negative_prompts_need_true_cfg_and_then_change_the_images(models, tmp_path):
    with_neg = write_prompts(
        tmp_path / "neg.parquet", ["a red fox", "a blue owl"], id=["a", "b"], negative_prompt=["blurry", "dark"]
    )
    config = validate(
        JobConfig.of(
            input=str(with_neg),
            output=str(tmp_path / "refused"),
            model=models["flux"],
            width=64,
            height=64,
            device="cpu",
        )
    )
    with pytest.raises(ConfigError, match="ignores negative prompts unless `--true-cfg-scale` is above 1"):
        run_job(config, progress_stream=io.StringIO())
    assert not (tmp_path / "refused").exists()  # refused before anything was written

    shard, columns = _shard(with_neg)
    shas = {}
    for name, cfg in (("plain", None), ("true-cfg", 4.0)):
        worker = _worker(models["flux"], tmp_path / name, "flux", columns, true_cfg_scale=cfg)
        worker.run_shard(shard)
        shas[name] = {r["id"]: r["sha256"] for r in pq.read_table(tmp_path / name / "shards").to_pylist()}
    assert all(shas["plain"][k] != shas["true-cfg"][k] for k in ("a", "b"))  # the negatives took effect


def test_safety_checker_flags_are_filtered_rows(tmp_path, ray_cluster):
    """A real StableDiffusionSafetyChecker at tiny size, made to flag everything: the rows are
    `filtered` with `nsfw` set, nothing is stored for them, and the summary counts them apart."""
    import torch
    from diffusers.pipelines.stable_diffusion.safety_checker import StableDiffusionSafetyChecker
    from transformers import CLIPConfig, CLIPImageProcessor

    from fleetgen.workers.tiny import build_tiny_pipeline

    pipe = build_tiny_pipeline()
    torch.manual_seed(0)
    checker = StableDiffusionSafetyChecker(
        CLIPConfig(
            text_config={
                "hidden_size": 16,
                "intermediate_size": 32,
                "num_attention_heads": 2,
                "num_hidden_layers": 1,
                "vocab_size": 99,
            },
            vision_config={
                "hidden_size": 16,
                "intermediate_size": 32,
                "num_attention_heads": 2,
                "num_hidden_layers": 1,
                "image_size": 32,
                "patch_size": 8,
            },
            projection_dim=16,
        )
    )
    with torch.no_grad():
        checker.concept_embeds_weights.fill_(-10.0)  # every cosine distance is above these thresholds: flagged
    pipe.register_modules(safety_checker=checker, feature_extractor=CLIPImageProcessor(size=32, crop_size=32))
    pipe.register_to_config(requires_safety_checker=True)
    model = tmp_path / "checked"
    pipe.save_pretrained(model)

    path = write_prompts(tmp_path / "p.parquet", ["a red fox", "a blue owl"], id=["a", "b"])
    shard, columns = _shard(path)
    result = _worker(str(model), tmp_path / "out", "sd", columns).run_shard(shard)
    assert (result.ok, result.errors) == (0, 2)
    rows = pq.read_table(tmp_path / "out" / "shards").to_pylist()
    assert {(r["status"], r["nsfw"], r["image"]) for r in rows} == {("filtered", True, None)}
    assert not list((tmp_path / "out").rglob("*.png"))

    summary = run_job(
        validate(
            JobConfig.of(
                input=str(path),
                output=str(tmp_path / "job"),
                model=str(model),
                steps=2,
                width=64,
                height=64,
                device="cpu",
                workers=1,
            )
        ),
        progress_stream=io.StringIO(),
    )
    assert (summary.images_ok, summary.images_filtered, summary.images_error) == (0, 2, 0)
    from fleetgen.jobs.status import job_state, status_text

    assert "2 filtered by the safety checker" in status_text(job_state(str(tmp_path / "job")))
