"""The settings that change pixels (--cache, --quantize, --attention) as a job sees them: parsed once where the
job is configured, refused in one line before any worker, and part of the job's fingerprint (a resume with
another value is refused; jobs made before a setting existed still resume)."""

import io
import json

import pytest

from fleetgen.caches import CacheSpec, parse_cache
from fleetgen.errors import ConfigError, OffloadError, StorageError
from fleetgen.jobs.config import JobConfig, validate
from fleetgen.jobs.models import resolve_adapters, resolve_defaults
from fleetgen.jobs.sharding import read_footer, resolve_columns
from fleetgen.jobs.state import _differences
from fleetgen.offload.weight_formats import parse_quantize
from fleetgen.workers.rows.shard import Columns
from fleetgen.workers.spec import GenerationSettings
from tests.conftest import make_job, run_one_shard, write_prompts

STEPS = 12


FBC = "first-block:0.3"  # skips a few of 12 steps of the tiny FLUX.1 (random weights): measured below, not assumed


def _run(model, out, path, quantize="none", **spec):
    settings = GenerationSettings(
        task="text-to-image", steps=4, guidance=5.0, width=64, height=64, family="sd", quantize=parse_quantize(quantize)
    )
    return run_one_shard(model, out, path, settings, **{"max_batch": 1, **spec})


@pytest.fixture
def prompts(tmp_path):
    return write_prompts(tmp_path / "p.parquet", ["a red fox", "a blue boat"], id=["a", "b"])


def test_the_setting_is_parsed_to_one_spelling_and_refused_in_one_line():
    assert parse_cache(None) == CacheSpec() and parse_cache(" none ").label == "none"
    assert (
        parse_cache("first-block").label == "first-block:0.05"
        and parse_cache("First-Block:threshold=0.08").label == "first-block:0.08"
    )
    assert parse_cache("taylorseer").label == "taylorseer:interval=5,warmup=3,order=1"
    assert parse_cache("taylorseer:order=2,interval=4").label == "taylorseer:interval=4,warmup=3,order=2"
    assert parse_cache("MagCache").label == "magcache:threshold=0.06,max_skip=3,retention=0.2"
    assert parse_cache("magcache:max_skip=2,threshold=0.1").label == "magcache:threshold=0.1,max_skip=2,retention=0.2"
    for text, message in (
        ("first-block:2", "more than 0 and at most 1"),
        ("first-block:x", "the threshold is a number"),
        ("taylorseer:every=3", "takes interval=, warmup= and order="),
        ("taylorseer:interval=0", "must be 1 or more"),
        ("magcache:threshold=0", "threshold > 0, max_skip >= 1"),
        ("magcache:max_skip=1.5", "max_skip=, a whole number"),
        ("magcache:every=2", "magcache takes threshold="),
        ("teacache", "must be none, first-block"),
    ):
        with pytest.raises(ConfigError, match=message):
            parse_cache(text)
    with pytest.raises(ConfigError, match="must be none, first-block"):
        validate(JobConfig.of(input="x", output="y", model="org/m", cache="fast"))
    # by the step alone, as diffusers' hook decides: 3 warm-up steps, then every 5th of the rest
    assert parse_cache("taylorseer").computed_share(10) == pytest.approx(5 / 10)  # steps 0, 1, 2, 4 and 9
    assert parse_cache("first-block").computed_share(10) is None  # the data decides
    assert parse_cache("magcache").computed_share(10) is None and not parse_cache("magcache").per_call


def test_what_cannot_take_a_cache_is_refused_before_any_worker(tiny_model, tiny_flux, tmp_path):
    prompts = write_prompts(tmp_path / "p.parquet", ["a red fox"])
    sd = JobConfig.of(input=str(prompts), output=str(tmp_path / "o"), model=tiny_model, cache="first-block")
    with pytest.raises(
        ConfigError, match=r"UNet2DConditionModel takes no step cache.*Families whose pipelines take first-block: flux,"
    ):
        resolve_defaults(sd, Columns())
    nothing = JobConfig.of(input=str(prompts), output="o", model=tiny_flux, cache="taylorseer:warmup=8", steps=8)
    with pytest.raises(ConfigError, match="computes every one of the 8 steps"):
        resolve_defaults(nothing, resolve_columns([read_footer(str(prompts))], Columns()))


def test_the_cache_is_part_of_the_fingerprint_and_old_jobs_resume():
    assert _differences({"generation": {"steps": 2}}, {"generation": {"steps": 2, "cache": "none"}}) == []
    assert _differences({"generation": {"steps": 2}}, {"generation": {"steps": 2, "cache": FBC}}) == [
        f"generation.cache differs: none vs {FBC}"
    ]


@pytest.mark.ray
def test_a_resume_across_a_cache_change_is_refused(tiny_flux, tmp_path, ray_cluster):
    from fleetgen.jobs.driver import run_job

    prompts = write_prompts(tmp_path / "p.parquet", ["a red fox", "a blue owl"])
    out = tmp_path / "out"
    job = make_job(prompts, tiny_flux, out, cache=" First-Block:0.3 ", steps=STEPS)
    assert run_job(job, progress_stream=io.StringIO()).complete
    assert json.loads((out / "job.json").read_text())["fingerprint"]["generation"]["cache"] == FBC
    with pytest.raises(StorageError, match=f"generation.cache differs: {FBC} vs none"):
        run_job(make_job(prompts, tiny_flux, out, steps=STEPS), progress_stream=io.StringIO())


def test_the_mapping_is_parsed_and_refused_in_one_line():
    assert (
        parse_quantize("none").mapping == {}
        and parse_quantize(None).mapping == {}
        and parse_quantize("auto").mapping == {}
    )
    assert parse_quantize(" transformer=fp8 , text_encoder=int8").pinned().label == "text_encoder=int8,transformer=fp8"
    assert parse_quantize(" auto ").pinned().label == "auto" and parse_quantize(None).pinned().label == "none"
    for text, message in (
        ("transformer=int3", "the formats are fp8, int8, nf4, bnb-int8"),
        ("transformer", r"takes none, auto or COMPONENT=FORMAT"),
        ("unet=fp8,unet=fp8", "names `unet` twice"),
    ):
        with pytest.raises(ConfigError, match=message):
            parse_quantize(text)
    with pytest.raises(ConfigError, match="the formats are fp8"):
        validate(JobConfig.of(input="x", output="y", model="org/m", quantize="unet=q3"))
    # the combination table, before any worker: torchao cannot go to disk, bitsandbytes stays resident
    with pytest.raises(ConfigError, match=r"unet=int8` with `--offload disk`: diffusers refuses disk offload"):
        validate(JobConfig.of(input="x", output="y", model="org/m", quantize="unet=int8", offload="disk"))
    with pytest.raises(ConfigError, match=r"unet=nf4` with `--offload block`: bitsandbytes weights"):
        validate(JobConfig.of(input="x", output="y", model="org/m", quantize="unet=nf4", offload="block"))


def test_what_cannot_be_quantized_is_refused_before_any_worker(tiny_model, tmp_path):
    prompts = write_prompts(tmp_path / "p.parquet", ["a red fox"])
    config = JobConfig.of(input=str(prompts), output=str(tmp_path / "o"), model=tiny_model, quantize="transformer=fp8")
    with pytest.raises(ConfigError, match=r"has no component `transformer` \(its model components: .*unet"):
        resolve_defaults(config, Columns())
    text = JobConfig.of(input=str(prompts), output="o", model=tiny_model, quantize="text_encoder=fp8")
    with pytest.raises(ConfigError, match=r"fp8 serves unet, transformer.* only; pipelines read"):
        resolve_defaults(text, Columns())
    vae = JobConfig.of(input=str(prompts), output="o", model=tiny_model, quantize="vae=int8")
    with pytest.raises(ConfigError, match=r"int8 serves unet, .*text_encoder.* only; the VAE"):
        resolve_defaults(vae, Columns())
    for quantize in ("unet=fp8", "auto"):
        lora = JobConfig.of(input=str(prompts), output="o", model=tiny_model, quantize=quantize, lora=(str(prompts),))
        with pytest.raises(ConfigError, match="`--quantize` with LoRA adapters is not supported yet"):
            resolve_adapters(lora, Columns(), [])
    # bitsandbytes on a CPU worker: one line, before the weights load
    with pytest.raises(OffloadError, match=r"w0: `--quantize` unet=nf4: nf4 needs a CUDA device \(bitsandbytes\)"):
        _run(tiny_model, tmp_path / "nf4", prompts, "unet=nf4")
    assert not (tmp_path / "nf4" / "shards").exists()


def test_the_mapping_is_part_of_the_jobs_fingerprint(tiny_model, tmp_path, ray_cluster):
    from fleetgen.jobs.driver import run_job

    prompts = write_prompts(tmp_path / "p.parquet", ["a red fox", "a blue owl"])
    out = tmp_path / "out"
    done = run_job(make_job(prompts, tiny_model, out, quantize=" unet=fp8 "), progress_stream=io.StringIO())
    assert done.complete
    generation = json.loads((out / "job.json").read_text())["fingerprint"]["generation"]
    assert generation["quantize"] == "unet=fp8"
    with pytest.raises(StorageError, match="generation.quantize differs: unet=fp8 vs none"):
        run_job(make_job(prompts, tiny_model, out), progress_stream=io.StringIO())


def test_a_job_started_before_quantize_existed_still_resumes():
    from fleetgen.jobs.state import _differences

    new = {"generation": {"steps": 2, "quantize": "none"}}
    assert _differences({"generation": {"steps": 2}}, new) == []
    assert _differences({"generation": {"steps": 2}}, {"generation": {"steps": 2, "quantize": "unet=fp8"}}) == [
        "generation.quantize differs: none vs unet=fp8"
    ]


def test_only_an_inexact_kernel_is_in_the_fingerprint(tiny_model, tmp_path):
    prompts = write_prompts(tmp_path / "p.parquet", ["a"])

    def settings(attention):
        return make_job(prompts, tiny_model, tmp_path / "o", attention=attention, family="sd").generation

    assert {settings(a).attention.label for a in ("native", "auto", "flash")} == {"exact"}
    old = {"generation": {"steps": 2}}  # a job.json from before `--attention`: any exact kernel
    assert _differences(old, {"generation": {"steps": 2, "attention": "exact"}}) == []
    assert _differences(old, {"generation": {"steps": 2, "attention": settings("sage").attention.label}}) == [
        "generation.attention differs: exact vs sage"
    ]
