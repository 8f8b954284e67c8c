"""The 2025-26 families as jobs see them (jobs/models.py): detected and resolved to their cards' defaults, told
apart where they share a class, what each cannot do refused before any worker; a frontier job verified deep."""

import importlib.util
import io
import json

import pytest

from fleetgen.errors import ConfigError
from fleetgen.jobs.config import JobConfig, validate
from fleetgen.jobs.models import check_generic, describe, resolve_defaults
from fleetgen.workers.families.detect import FAMILIES, identify_dir
from fleetgen.workers.rows.shard import Columns
from fleetgen.workers.tiny import TINY_FAMILIES
from tests.conftest import CARDS, write_prompts

# What each model's card (its published example call) and the pipeline's `__call__` say, written
# here independently of the table: (steps, guidance, dtype, how a negative prompt is taken).


@pytest.fixture(scope="module")
def models(frontier_models):
    return frontier_models


def replace_device(config: JobConfig) -> JobConfig:

    return config.with_options(device="cpu", workers=1)


def test_every_entry_has_a_tiny_model_and_a_cli_choice():
    from fleetgen.cli import _parser
    from fleetgen.workers.families.table import NO_TINY

    # none added without a reason (family_table.py)
    assert NO_TINY == {"qwen-image-edit", "qwen-image-edit-plus", "wan-ti2v"}
    table = [f for f in FAMILIES if f != "generic" and f not in NO_TINY]
    assert sorted(TINY_FAMILIES) == sorted(table)
    tiny = next(a for a in _parser()._subparsers._group_actions[0].choices["tiny-model"]._actions if a.dest == "family")
    assert sorted(tiny.choices) == sorted(table)


@pytest.mark.parametrize("family", sorted(CARDS))
def test_detected_and_resolved_to_the_cards_defaults(family, models, tmp_path):
    prompts = write_prompts(tmp_path / "p.parquet", ["a red fox"])
    config = JobConfig.of(input=str(prompts), output=str(tmp_path / "o"), model=models[family])
    resolved, found, sources = resolve_defaults(config, Columns.of("prompt", None, None, None))
    steps, guidance, dtype, negative = CARDS[family]
    assert (found.name, resolved.generation.steps, resolved.generation.guidance, found.dtype, found.negative) == (
        family,
        steps,
        guidance,
        dtype,
        negative,
    )
    line = describe(resolved, found, sources)
    assert f"model family {family} ({found.pipelines[0]}): steps {steps} (family default)" in line
    assert sources["family"] and f"why {family}: " in line  # the detection says why
    assert found.text_encoder and found.sizes and found.note


def test_shared_classes_are_told_apart_and_an_unsure_guess_names_the_flag(models, tmp_path):
    import shutil

    for family in ("flux2-klein", "flux2-klein-base", "hunyuanimage", "hunyuanimage-distilled"):
        assert identify_dir(models[family])[0].name == family  # from the checkpoint's configs
    unnamed = shutil.copytree(models["z-image"], tmp_path / "zimg")
    assert identify_dir(unnamed) == (
        FAMILIES["z-image"],
        "ZImagePipeline: its scheduler's shift is 6 (z-image ships that)",
    )
    scheduler = unnamed / "scheduler" / "scheduler_config.json"
    scheduler.write_text(json.dumps({**json.loads(scheduler.read_text()), "shift": 5.0}))  # a fine-tune's own
    found, why = identify_dir(unnamed)
    assert found.name == "z-image-turbo" and "`--family z-image` for the base model" in why
    prompts = write_prompts(tmp_path / "p.parquet", ["a red fox"])
    config = JobConfig.of(input=str(prompts), output=str(tmp_path / "o"), model=str(unnamed), family="z-image")
    resolved, found, sources = resolve_defaults(config, Columns.of("prompt", None, None, None))
    assert (found.name, resolved.generation.steps) == ("z-image", 50)
    assert sources["family"] == "`--family z-image` (detected: z-image-turbo)"
    with pytest.raises(ConfigError, match=r"`--family flux` is for FluxPipeline; this model is a ZImagePipeline"):
        resolve_defaults(JobConfig.of(input="x", output="y", model=str(unnamed), family="flux"), Columns())
    with pytest.raises(ConfigError, match="`--family` must be one of sd, sdxl"):
        resolve_defaults(JobConfig.of(input="x", output="y", model=str(unnamed), family="zimage"), Columns())


@pytest.mark.parametrize(
    ("family", "settings", "message"),
    [
        ("flux2", {}, r"flux2 \(Flux2Pipeline\) takes no negative prompts"),
        ("flux2-klein-base", {}, "takes no negative prompts"),
        ("hunyuanimage-distilled", {}, "takes no negative prompts"),
        ("z-image-turbo", {}, "applies negative prompts only with guidance above 1 .*guidance is 0"),
        ("hidream-fast", {}, "applies negative prompts only with guidance above 1"),
    ],
)
def test_a_negative_column_the_pipeline_would_ignore_is_refused(family, settings, message, models, tmp_path):
    path = write_prompts(tmp_path / "n.parquet", ["a red fox"], negative_prompt=["blurry"])
    config = validate(JobConfig.of(input=str(path), output=str(tmp_path / "o"), model=models[family], **settings))
    with pytest.raises(ConfigError, match=message):
        resolve_defaults(config, Columns.of("prompt", None, None, "negative_prompt"))


def test_settings_a_family_ignores_are_refused(models):
    with pytest.raises(ConfigError, match=r"flux2-klein \(Flux2KleinPipeline\) ignores the guidance"):
        resolve_defaults(JobConfig.of(input="x", output="y", model=models["flux2-klein"], guidance=4.0), Columns())
    with pytest.raises(ConfigError, match="qwen-image takes it as its guidance"):
        resolve_defaults(JobConfig.of(input="x", output="y", model=models["qwen-image"], true_cfg_scale=4.0), Columns())


def test_pipelines_that_are_not_text_to_image_are_refused_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"^WanPipeline makes video \(it takes `num_frames`\)"):
        check_generic("WanPipeline")
    with pytest.raises(
        ConfigError, match=r"StableDiffusionImg2ImgPipeline needs inputs besides a prompt \(`strength`\)"
    ):
        check_generic("StableDiffusionImg2ImgPipeline")
    with pytest.raises(ConfigError, match="`NoSuchPipeline` is not a pipeline of the installed diffusers"):
        check_generic("NoSuchPipeline")
    check_generic("LatentConsistencyModelPipeline")  # text-to-image: called with what it takes


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is not None, reason="torchvision is installed here")
def test_a_processor_that_needs_torchvision_is_refused_before_any_worker(models, tmp_path):
    """FLUX.2 dev's published layout has a PixtralProcessor as its tokenizer, which transformers
    builds only with torchvision (not installable beside this machine's CPU torch)."""
    import shutil

    model = shutil.copytree(models["flux2"], tmp_path / "flux2")
    index = json.loads((model / "model_index.json").read_text())
    index["tokenizer"] = ["transformers", "PixtralProcessor"]
    (model / "model_index.json").write_text(json.dumps(index))
    prompts = write_prompts(tmp_path / "p.parquet", ["a red fox"])
    with pytest.raises(
        ConfigError, match=r"its tokenizer is a PixtralProcessor, which transformers builds only with torchvision"
    ):
        resolve_defaults(JobConfig.of(input=str(prompts), output="o", model=str(model)), Columns())


@pytest.mark.parametrize("family", ["qwen-image"])
def test_a_frontier_job_end_to_end_verifies_deep(family, models, tmp_path, ray_cluster):
    from fleetgen.jobs.driver import run_job
    from fleetgen.jobs.verify import verify

    prompts = write_prompts(tmp_path / "p.parquet", ["a red fox", "a blue owl", "a green tree"])
    log = io.StringIO()
    config = JobConfig.of(
        input=str(prompts), output=str(tmp_path / "out"), model=models[family], steps=2, width=64, height=64
    )
    summary = run_job(validate(replace_device(config)), progress_stream=log)
    assert summary.complete and summary.images_ok == 3
    job = json.loads((tmp_path / "out" / "job.json").read_text())
    assert job["family"]["name"] == family and job["family"]["negative_default"] == " "
    assert "negative prompt ' ' where a row has none" in log.getvalue()
    assert verify(str(tmp_path / "out"), deep=True).clean
