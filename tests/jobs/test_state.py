"""jobs/state.py: what job.json records about the job's makers."""

import json

from fleetgen.jobs import state


def test_versions_are_the_installed_packages_own_and_a_package_without_metadata_is_none():
    """job.json's versions come from package metadata (a driver never imports torch or diffusers): they
    are the versions the modules report, and a package installed without metadata reads as None."""
    import diffusers
    import torch

    recorded = state.versions()
    assert recorded["torch"] == str(torch.__version__) and recorded["diffusers"] == diffusers.__version__
    assert state._installed("fleetgen-no-such-package") is None


def test_a_job_recorded_before_the_settings_table_resumes():
    """job.json's fingerprint keeps its spellings (`loras`, `scores`, every column role by name): the
    generation settings and columns of a job made by the previous release compare equal to the same
    job's today, so a rerun resumes it instead of refusing it as another job."""
    from fleetgen.workers.rows.batches import Adapter
    from fleetgen.workers.rows.shard import Columns
    from fleetgen.workers.spec import GenerationSettings

    before = {  # as the release before it wrote them (JSON: tuples are lists)
        "generation": {
            **dict(steps=4, guidance=5.0, width=64, height=64, seed=7, image_format="png", output_format="files"),
            **dict(family="sd", true_cfg_scale=None, quantize="none", images_per_prompt=2, prompt_template=None),
            **dict(loras=[{"source": "org/style", "scale": 0.5}], task="text-to-image", strength=None, resize="crop"),
            **dict(store_inputs=False, store_frames=False, num_frames=None, fps=None, video_format="mp4", crf=18),
            **dict(cache="none", attention="exact", scores="none", keep="none", best_of=1, rank_by=None),
        },
        "columns": {
            **dict(prompt="prompt", id="id", seed=None, negative_prompt=None, width=None, height=None, steps="steps"),
            **dict(guidance=None, lora=None, lora_scale=None, strength=None, num_frames=None, fps=None, image=None),
            **dict(mask=None, num_images=None, carry=["label"], template_fields=[]),
        },
    }
    settings = GenerationSettings(
        family="sd", task="text-to-image", steps=4, guidance=5.0, width=64, height=64, seed=7, images_per_prompt=2,
        lora=(Adapter("org/style", 0.5),),
    )  # fmt: skip
    columns = Columns.of("prompt", "id", None, None, steps="steps", carry=("label",))
    now = json.loads(json.dumps({"generation": settings.record(), "columns": columns.record()}))
    assert state._differences(before, now) == []
    assert state._differences(before, {**now, "columns": {**now["columns"], "steps": None}}) == [
        "columns.steps differs: steps vs None"
    ]
