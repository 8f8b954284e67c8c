"""What a job does with an image-input model, decided on the driver before any worker starts:
the task (detected from the pipeline class, or `--task`), the input columns it needs, the options
that do not apply refused with the option that fixes them; and the planner's count of the VAE's
encodes and of an edit model's reference tokens."""

from __future__ import annotations

import pytest

from fleetgen.errors import ConfigError
from fleetgen.jobs.config import JobConfig, validate
from fleetgen.jobs.models import describe, resolve_defaults
from fleetgen.workers.families.detect import FAMILIES, choose_task, identify
from fleetgen.workers.rows.shard import Columns
from tests.conftest import write_prompts


def resolve(model, tmp_path, columns: Columns | None = None, **options):
    prompts = write_prompts(tmp_path / "p.parquet", ["a red fox"])
    config = JobConfig.of(input=str(prompts), output=str(tmp_path / "o"), model=str(model), steps=4, **options)
    return resolve_defaults(validate(config), columns or Columns.of("prompt", None, None, None))


def test_a_task_class_is_its_familys_and_its_task():
    family, why = identify({"_class_name": "StableDiffusionInpaintPipeline"})
    assert family.name == "sd" and choose_task(family, None, "StableDiffusionInpaintPipeline")[0].name == "inpaint"
    kontext, _ = identify({"_class_name": "FluxKontextPipeline"})
    assert kontext.name == "flux-kontext" and kontext.tasks[0].name == "edit"
    flux, _ = identify({"_class_name": "FluxImg2ImgPipeline"}, {"guidance_embeds": False})
    assert flux.name == "flux-schnell"  # a task class of a shared family: told apart as its base is
    assert choose_task(FAMILIES["sd"], "image-to-image", "StableDiffusionPipeline")[0].pipeline == (
        "StableDiffusionImg2ImgPipeline"
    )
    with pytest.raises(ConfigError, match=r"`--task edit`: sd \(StableDiffusionPipeline\) does text-to-image, "):
        choose_task(FAMILIES["sd"], "edit", "StableDiffusionPipeline")


@pytest.mark.slow  # imports every pipeline class of diffusers: seconds
def test_every_task_names_a_diffusers_class_that_takes_what_it_says():
    import inspect

    import diffusers

    for family in FAMILIES.values():
        for task in family.tasks:
            params = inspect.signature(getattr(diffusers, task.pipeline).__call__).parameters
            assert ("image" in params) == task.takes_images or task.name == "text-to-image", (family.name, task)
            assert ("mask_image" in params) == task.mask, (family.name, task)
            if task.strength is not None:
                assert params["strength"].default == pytest.approx(task.strength), (family.name, task)
            if task.pins_area:
                assert task.pins_area in params


def test_the_task_and_its_inputs_must_agree(tiny_model, tmp_path):
    image = Columns.of("prompt", None, None, None, image="input_image")
    resolved, _, sources = resolve(tiny_model, tmp_path, image, task="image-to-image")
    assert (resolved.generation.task, resolved.generation.strength, sources["strength"]) == (
        "image-to-image",
        0.8,
        "task default",
    )
    assert "task image-to-image (`--task image-to-image`" in describe(resolved, FAMILIES["sd"], sources)
    with pytest.raises(ConfigError, match=r"no `input_image` column: name the column .* `--image-column NAME`"):
        resolve(tiny_model, tmp_path, task="image-to-image")
    with pytest.raises(ConfigError, match=r"image column `input_image`, but sd text-to-image .* `--image-column none`"):
        resolve(tiny_model, tmp_path, image)
    with pytest.raises(ConfigError, match=r"no `mask_image` column"):
        resolve(tiny_model, tmp_path, image, task="inpaint")
    with pytest.raises(ConfigError, match=r"`--strength`: sd text-to-image .* takes no strength"):
        resolve(tiny_model, tmp_path, strength=0.5)
    with pytest.raises(ConfigError, match=r"strength 0.2 at 4 steps leaves no denoising step"):
        resolve(tiny_model, tmp_path, image, task="image-to-image", strength=0.2)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"task": "upscale"}, "`--task` must be one of text-to-image, image-to-image, inpaint, edit"),
        ({"strength": 1.5}, "`--strength` must be 0 to 1"),
        ({"resize": "zoom"}, "`--resize` must be one of crop, pad, fit"),
        ({"store_inputs": True}, "`--store-inputs` puts each input beside its image in webdataset or parquet"),
    ],
)
def test_bad_image_options_are_refused(options, message, tiny_model, tmp_path):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        validate(JobConfig.of(input="x", output=str(tmp_path), model=str(tiny_model), **options))


def test_the_planner_counts_encodes_and_reference_tokens():
    import torch

    from fleetgen.offload.architectures import build_on_meta
    from fleetgen.offload.cost import Workload, _activations, _forwards, _tokens
    from fleetgen.offload.profile import profile_modules

    prof = profile_modules("flux.1-dev", build_on_meta("flux.1-dev"), torch.bfloat16)
    transformer, vae = prof.components["transformer"], prof.components["vae"]
    text, edit = Workload(width=1024, height=1024), Workload(width=1024, height=1024, input_images=1, in_sequence=True)
    img2img = Workload(width=1024, height=1024, input_images=1)
    assert _tokens(transformer, prof, edit) == 2 * _tokens(transformer, prof, text) == 2 * 4096
    assert _tokens(transformer, prof, img2img) == 4096  # SD-style img2img: the input starts the latents
    assert _activations(transformer, prof, edit) == 2 * _activations(transformer, prof, text)
    assert (_forwards(vae, text), _forwards(vae, img2img), _forwards(transformer, edit)) == (1, 2, 30)


def _flux2_workload(**kw):
    from fleetgen.jobs.planning import plan_workload

    base = {"width": 1024, "height": 1024, "steps": None, "guidance": None, "true_cfg_scale": None}
    return plan_workload("flux.2-dev", **{**base, "max_batch": 1, "offload": "auto", **kw})


def test_fleetgen_plan_plans_an_edit_with_its_references(capsys):
    from fleetgen.cli import main
    from fleetgen.jobs.planning import RowsAsk, plan_rows

    edit, family = _flux2_workload(max_batch=8, task="edit", references=3)
    assert (edit.input_images, edit.in_sequence, edit.max_batch) == (3, True, 1)
    text, _ = _flux2_workload()
    peaks = [
        plan_rows(RowsAsk("flux.2-dev", ("141GiB",), "128GiB", "bfloat16", w))[1][0]["peak_bytes"] for w in (text, edit)
    ]
    assert peaks[1] > peaks[0]  # three references' tokens beside the image's own
    with pytest.raises(ConfigError, match=r"`--references` must be 1 to 10 for flux2 edit"):
        _flux2_workload(task="edit", references=11)
    assert (
        main(["plan", "--model", "sdxl", "--gpu-memory", "24GiB", "--task", "inpaint", "--host-memory", "64GiB"]) == 0
    )
    assert "24GiB" in capsys.readouterr().out
