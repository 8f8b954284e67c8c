"""The family table on tiny pipelines of the 2023-24 families: how each is called (workers/pipeline/calls.py)."""

import pyarrow.parquet as pq
import pytest

from fleetgen.jobs.sharding import plan_shards, read_footer, resolve_columns
from fleetgen.workers.families.detect import FAMILIES
from fleetgen.workers.rows.shard import Columns
from fleetgen.workers.spec import GenerationSettings, WorkerSpec
from fleetgen.workers.worker import Worker
from tests.conftest import write_prompts

LONG = " ".join(["a red fox in the forest at night"] * 15)  # 120 words: 122 tokens here


@pytest.fixture(scope="module")
def models(family_models):
    return family_models


def _shard(path, **columns):
    files = [read_footer(str(path))]
    return plan_shards(files, 100)[0], resolve_columns(files, Columns())


def _worker(model, out, family, columns, **settings):
    base = {"steps": 2, "guidance": FAMILIES[family].guidance, "width": 64, "height": 64, "family": family}
    return Worker(
        WorkerSpec.of(
            "w0",
            model,
            str(out),
            GenerationSettings(**{"task": "text-to-image", **base, **settings}),
            columns,
            max_batch=2,
            device="cpu",
            threads=1,
        )
    )


@pytest.mark.parametrize("family", ["sd", "flux", "pixart-sigma"])
def test_a_120_token_prompt_is_fine_for_t5_families_and_noted_for_clip_only_ones(family, models, tmp_path):
    path = write_prompts(tmp_path / "p.parquet", [LONG], id=["long"])
    shard, columns = _shard(path)
    _worker(models[family], tmp_path / "out", family, columns).run_shard(shard)
    row = pq.read_table(tmp_path / "out" / "shards").to_pylist()[0]
    assert row["status"] == "ok"
    if family == "sd":
        assert row["warning"] == "prompt truncated to 77 of 122 tokens"
    else:
        assert row["warning"] is None


def test_any_other_pipeline_is_called_with_only_what_it_takes(tmp_path):
    """The generic entry: a LatentConsistencyModelPipeline (not in the table) takes no negative
    prompt; a negative-prompt column is noted per row instead of breaking the call."""
    from diffusers import LatentConsistencyModelPipeline, LCMScheduler, UNet2DConditionModel

    from fleetgen.workers.families.detect import GENERIC, read_family
    from fleetgen.workers.tiny import build_tiny_pipeline

    sd = build_tiny_pipeline()
    unet = UNet2DConditionModel(**{**sd.unet.config, "time_cond_proj_dim": 32})
    pipe = LatentConsistencyModelPipeline(
        vae=sd.vae,
        text_encoder=sd.text_encoder,
        tokenizer=sd.tokenizer,
        unet=unet,
        scheduler=LCMScheduler(),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.save_pretrained(tmp_path / "lcm")
    assert read_family(tmp_path / "lcm") is GENERIC
    path = write_prompts(
        tmp_path / "p.parquet", ["a red fox", "a blue owl"], id=["a", "b"], negative_prompt=["blurry", None]
    )
    shard, columns = _shard(path)
    result = _worker(str(tmp_path / "lcm"), tmp_path / "out", "generic", columns, guidance=1.5).run_shard(shard)
    assert (result.ok, result.errors) == (2, 0)
    rows = {r["id"]: r for r in pq.read_table(tmp_path / "out" / "shards").to_pylist()}
    assert rows["a"]["warning"] == "negative prompt ignored: LatentConsistencyModelPipeline takes none"
    assert rows["b"]["warning"] is None
