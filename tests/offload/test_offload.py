"""offload/: shipped architectures, the planner over a matrix, equivalence on CPU, stats, guards."""

import hashlib
import json
import os

import pytest
import torch

from fleetgen.errors import ConfigError, OffloadError
from fleetgen.offload import (
    DeviceSpec,
    OffloadPlan,
    OffloadStats,
    Placement,
    Workload,
    apply,
    pipeline_modules,
    plan,
    profile_modules,
    profile_pipeline,
)
from fleetgen.offload.architectures import NAMES
from fleetgen.offload.cost import MARGIN
from fleetgen.offload.hooks import unapply
from fleetgen.offload.planner import TIE  # plans within it compare as equal: the tie goes to fewer bytes moved
from fleetgen.units import parse_size
from fleetgen.workers.tiny.flux import build_tiny_flux

GiB = 2**30


@pytest.fixture(scope="module")
def profiles(meta_build):
    return {n: profile_modules(n, meta_build(n), torch.bfloat16) for n in NAMES}


def test_stored_profiles_are_the_meta_builds(profiles):
    """`fleetgen plan` reads each shipped architecture's stored profile (no torch, no diffusers); it
    must be what the meta build profiles to. After changing a config or the profiler, rewrite them:
    `python -m fleetgen.offload.profiles`."""
    from dataclasses import replace

    from fleetgen.latents import expert_shares
    from fleetgen.offload.architectures import pipeline_settings, resolve
    from fleetgen.offload.profiles import stored_profile

    for name, built in profiles.items():
        settings = pipeline_settings(name)  # the fixture's profiles leave out the experts' step shares
        shares = expert_shares(settings.get("boundary_ratio"), settings.get("flow_shift"))
        expected = replace(built, step_shares={n: s for n, s in shares.items() if n in built.components})
        assert stored_profile(resolve(name), "bfloat16", False, ()) == expected, f"rewrite {name}'s profiles.json"


@pytest.mark.slow
@pytest.mark.parametrize(("name", "dtype", "upcast"), [("sdxl", "float16", True), ("flux.2-dev", "float32", False)])
def test_stored_profiles_hold_every_dtype_and_format(name, dtype, upcast, meta_build):
    from fleetgen.offload.architectures import pipeline_settings, resolve
    from fleetgen.offload.profiles import stored_profile
    from fleetgen.offload.weight_formats import CHOOSABLE
    from fleetgen.workers.pipeline.load import DTYPES

    built = profile_modules(name, meta_build(name), DTYPES[dtype], upcast, CHOOSABLE, pipeline_settings(name))
    assert stored_profile(resolve(name), dtype, upcast, CHOOSABLE) == built
    assert stored_profile(resolve(name), dtype, upcast, ("gguf:/x.gguf",)) is None  # a GGUF file's: built


@pytest.mark.parametrize("side", [32, 64])
def test_a_unets_flops_count_its_levels_as_torchs_flop_counter_does(side):
    """The cost model's FLOPs for a UNet (2 × `token_params` × tokens) against torch's FlopCounterMode
    over a real forward of the tiny SDXL's UNet: within 15 %, where counting every parameter over the
    full resolution's tokens is several times over (SDXL at 1024²: 84 TFLOP a sample against 6.8;
    the first H200 run's SDXL plans took offloading for free behind that compute: BENCHMARKS.md)."""
    from torch.utils.flop_counter import FlopCounterMode

    from fleetgen.offload.profile import profile_component
    from fleetgen.workers.tiny.sd import build_tiny_sdxl

    unet = build_tiny_sdxl(0).unet
    c = profile_component("unet", unet, 4)
    cfg = unet.config
    text = torch.zeros(1, 77, cfg.cross_attention_dim)
    added = {"text_embeds": torch.zeros(1, cfg.projection_class_embeddings_input_dim - 6 * cfg.addition_time_embed_dim)}
    added["time_ids"] = torch.zeros(1, 6)
    with FlopCounterMode(display=False) as counted, torch.no_grad():
        unet(torch.zeros(1, 4, side, side), 1, encoder_hidden_states=text, added_cond_kwargs=added)
    tokens = side * side
    assert 2 * c.token_params * tokens == pytest.approx(counted.get_total_flops(), rel=0.15)
    assert 2 * c.params * tokens > 2.5 * counted.get_total_flops()
    assert profile_component("text_encoder", build_tiny_sdxl(0).text_encoder, 4).token_params == 0  # not a UNet


def test_shipped_architectures_match_published_sizes(profiles):
    params = {n: {c: p.params for c, p in prof.components.items()} for n, prof in profiles.items()}
    assert params["flux.1-dev"]["transformer"] == pytest.approx(11.9e9, rel=0.005)
    assert params["flux.1-dev"]["text_encoder_2"] == pytest.approx(4.76e9, rel=0.005)  # T5-XXL encoder
    assert params["sdxl"]["unet"] == pytest.approx(2.567e9, rel=0.002)
    assert params["sdxl"]["text_encoder"] + params["sdxl"]["text_encoder_2"] == pytest.approx(0.817e9, rel=0.01)
    assert params["sd-1.5"]["unet"] == pytest.approx(0.8595e9, rel=0.002)
    assert params["sd3-medium"]["transformer"] == pytest.approx(2.03e9, rel=0.01)
    assert profiles["flux.1-dev"].components["transformer"].bytes == pytest.approx(11.9e9 * 2, rel=0.005)
    # text encoders split by layer, not one group; T5 shares its embedding (tied)
    t5 = profiles["flux.1-dev"].components["text_encoder_2"]
    assert len(t5.blocks) == 24 and t5.tied and t5.block_modules == ("encoder",)


BUDGETS = [4, 8, 12, 16, 24, 32, 48, 80]


@pytest.mark.parametrize("name", ["sd-1.5", "sdxl", "flux.1-dev"])
@pytest.mark.parametrize("size", [512, 1024])
def test_planner_fits_budget_and_more_memory_is_never_slower(profiles, name, size):
    work = Workload(width=size, height=size, steps=28, max_batch=8)
    last = None
    for gib in BUDGETS:
        device = DeviceSpec(budget=gib * GiB, host_budget=64 * GiB)
        try:
            p = plan(profiles[name], device, work)
        except OffloadError as err:
            assert last is None, f"{gib} GiB fails although a smaller budget fitted"
            assert "needs" in str(err) and "GiB" in str(err)
            continue
        assert p.peak_bytes <= device.budget * (1 - MARGIN)
        assert p.host_bytes <= device.host_budget
        assert set(p.placements) == set(profiles[name].components)
        assert p.reason and f"batch {p.batch_size}" in p.reason
        if last is not None:
            assert p.seconds_per_image <= last.seconds_per_image * (1 + TIE), (gib, p.modes, last.modes)
        last = p
    assert last is not None and all(m == "resident" for m in last.modes.values())  # 80 GiB holds everything


def test_nothing_fits_names_the_need(profiles):
    with pytest.raises(OffloadError) as err:
        plan(
            profiles["flux.1-dev"],
            DeviceSpec(budget=2 * GiB, host_budget=64 * GiB, name="gpu-3"),
            Workload(width=1024, height=1024),
        )
    msg = str(err.value)
    assert msg.startswith("Nothing fits 2.0 GiB on gpu-3") and "needs" in msg and "1024x1024" in msg
    with pytest.raises(OffloadError, match="Raise `--host-memory`"):
        plan(profiles["sdxl"], DeviceSpec(budget=8 * GiB, host_budget=GiB), Workload(offload="leaf", loaded=True))
    with pytest.raises(OffloadError, match=r"Nothing loads \(host RAM binds\).*`--quantize auto`"):
        plan(profiles["sdxl"], DeviceSpec(budget=8 * GiB, host_budget=GiB), Workload(offload="leaf"))
    with pytest.raises(OffloadError, match="or `--offload auto`"):
        plan(profiles["sdxl"], DeviceSpec(budget=8 * GiB, host_budget=64 * GiB), Workload(offload="none"))


def test_forced_modes_and_streams_follow_the_device(profiles):
    prof = profiles["sdxl"]
    forced = plan(prof, DeviceSpec(budget=24 * GiB, host_budget=64 * GiB, streams=False), Workload(offload="block"))
    assert all(m.startswith("block_level(") and "stream" not in m for m in forced.modes.values())
    disk = plan(prof, DeviceSpec(budget=24 * GiB, host_budget=GiB), Workload(offload="disk", loaded=True))
    assert all(m == "block_level(1)+disk" for m in disk.modes.values()) and disk.host_bytes == 0
    tight = plan(profiles["flux.1-dev"], DeviceSpec(budget=16 * GiB, host_budget=64 * GiB), Workload())
    assert tight.pinned_bytes > 0 and "stream" in tight.modes["transformer"]


# --- applying plans to real tiny pipelines on CPU ---------------------------------------------

P = Placement
SD_PLANS = {
    "block1": {"unet": P("block", 1), "text_encoder": P("block", 1), "vae": P("block", 1)},
    "block2": {"unet": P("block", 2), "text_encoder": P("block", 2), "vae": P("block", 2)},
    "leaf": {"unet": P("leaf"), "text_encoder": P("leaf"), "vae": P("leaf")},
    "disk": {
        "unet": P("block", 1, disk=True),
        "text_encoder": P("block", 1, disk=True),
        "vae": P("block", 1, disk=True),
    },
    "mixed": {"unet": P("leaf"), "text_encoder": P("block", 1, disk=True), "vae": P("resident")},
}
FLUX_PLANS = {
    "block1": {
        "transformer": P("block", 1),
        "text_encoder": P("block", 1),
        "text_encoder_2": P("block", 1),
        "vae": P("block", 1),
    },
    "block2": {"transformer": P("block", 2), "text_encoder_2": P("block", 2)},
    "leaf": {"transformer": P("leaf"), "text_encoder": P("leaf"), "text_encoder_2": P("leaf"), "vae": P("leaf")},
    "disk": {"transformer": P("block", 1, disk=True), "text_encoder_2": P("block", 1, disk=True)},
    "mixed": {"transformer": P("block", 2, disk=True), "text_encoder_2": P("leaf"), "vae": P("block", 1)},
}


def _sd(tiny_model):
    from diffusers import DiffusionPipeline

    return DiffusionPipeline.from_pretrained(tiny_model)


def _images(pipe, placements, steps=3, flux=False):
    """Generate two images with `placements` applied; returns (sha256, stats snapshot, profile)."""
    pipe.set_progress_bar_config(disable=True)
    prof = profile_pipeline(pipe)
    placed = apply(pipe, OffloadPlan(placements=placements, batch_size=2), prof, torch.device("cpu"))
    stats = OffloadStats(pipeline_modules(pipe), torch.device("cpu"))
    kwargs = {"max_sequence_length": 32, "width": 32, "height": 32} if flux else {"width": 64, "height": 64}
    images = pipe(
        prompt=["a red fox", "a blue owl"],
        num_inference_steps=steps,
        guidance_scale=5.0,
        generator=[torch.Generator().manual_seed(s) for s in (1, 2)],
        output_type="np",
        **kwargs,
    ).images
    snap = stats.snapshot()
    dirs = list(placed.dirs)
    placed.close()
    assert not any(os.path.exists(d) for d in dirs)  # disk offload files removed
    return hashlib.sha256(images.tobytes()).hexdigest(), snap, prof


@pytest.fixture(scope="module")
def sd_reference(tiny_model):
    return _images(_sd(tiny_model), {})[0]


@pytest.mark.parametrize("mode", list(SD_PLANS))
def test_every_mode_is_bit_identical_on_tiny_sd(tiny_model, sd_reference, mode):
    digest, snap, prof = _images(_sd(tiny_model), SD_PLANS[mode])
    assert digest == sd_reference
    offloaded = {n for n, p in SD_PLANS[mode].items() if p.mode != "resident"}
    assert set(snap["components"]) == offloaded


@pytest.fixture(scope="module")
def flux_reference():
    return _images(build_tiny_flux(), {}, flux=True)[0]


@pytest.mark.parametrize("mode", list(FLUX_PLANS))
def test_every_mode_is_bit_identical_on_tiny_flux(flux_reference, mode):
    assert _images(build_tiny_flux(), FLUX_PLANS[mode], flux=True)[0] == flux_reference


def test_stats_agree_with_groups_and_forwards(tiny_model):
    steps = 3
    _, snap, prof = _images(_sd(tiny_model), SD_PLANS["block2"], steps=steps)
    unet, te = prof.components["unet"], prof.components["text_encoder"]
    groups = -(-len(unet.blocks) // 2) + 1  # blocks two at a time, plus the unmatched group
    assert snap["components"]["unet"] == {
        "groups": groups,
        "onloads": steps * groups,
        "offloads": steps * groups,
        "bytes_onloaded": steps * unet.bytes,
    }
    # the text encoder runs twice per call with guidance (prompt, then the empty negative prompt)
    te_groups = -(-len(te.blocks) // 2) + 1
    assert snap["components"]["text_encoder"]["onloads"] == 2 * te_groups
    assert snap["components"]["text_encoder"]["bytes_onloaded"] == 2 * te.bytes
    _, snap, prof = _images(_sd(tiny_model), SD_PLANS["leaf"], steps=steps)
    # leaf level: a group per leaf layer plus one per module holding bare parameters (norms)
    leaf = snap["components"]["unet"]
    assert leaf["groups"] > prof.components["unet"].leaves
    assert (leaf["onloads"], leaf["bytes_onloaded"]) == (steps * leaf["groups"], steps * prof.components["unet"].bytes)


def test_stats_of_a_reapplied_plan_carry_the_counts_before_it(tiny_model):
    """After an OOM a worker re-applies a leaner plan with new stats: they carry the first plan's
    counts (once, they started from zero and a worker's file lost the transfers before its step-down)."""
    pipe = _sd(tiny_model)
    pipe.set_progress_bar_config(disable=True)
    prof, cpu = profile_pipeline(pipe), torch.device("cpu")

    def call():
        pipe(prompt="a red fox", num_inference_steps=2, width=64, height=64, output_type="np")

    placed = apply(pipe, OffloadPlan(placements=SD_PLANS["block2"], batch_size=1), prof, cpu)
    first = OffloadStats(pipeline_modules(pipe), cpu)
    call()
    before = first.snapshot()["components"]
    first.close()
    unapply(pipe, placed)  # as a worker's re-apply does
    placed = apply(pipe, OffloadPlan(placements=SD_PLANS["leaf"], batch_size=1), prof, cpu)
    second = OffloadStats(pipeline_modules(pipe), cpu).carry(first)
    call()
    after = second.snapshot()["components"]
    second.close()
    unapply(pipe, placed)
    unet = after["unet"]
    assert unet["groups"] > before["unet"]["groups"]  # the leaner plan's
    assert unet["onloads"] == before["unet"]["onloads"] + 2 * unet["groups"]  # 2 steps at leaf level, added
    assert unet["bytes_onloaded"] == 2 * before["unet"]["bytes_onloaded"]  # all of it moved each step, both plans


def test_refused_combinations_raise_before_any_work(tiny_model):
    pipe = build_tiny_flux()
    prof = profile_pipeline(pipe)
    cpu = torch.device("cpu")
    with pytest.raises(OffloadError, match="streams need a CUDA device"):
        apply(pipe, OffloadPlan({"transformer": P("block", 1, stream=True)}, 1), prof, cpu)
    with pytest.raises(OffloadError, match="corrupts tied weights"):
        apply(pipe, OffloadPlan({"text_encoder_2": P("leaf", disk=True)}, 1), prof, cpu)
    from diffusers.hooks import HookRegistry

    assert (
        getattr(pipe.transformer, "_diffusers_hook", None) is None
        or HookRegistry.check_if_exists_or_initialize(pipe.transformer).get_hook("group_offloading") is None
    )
    peft = pytest.importorskip("peft")
    sd = _sd(tiny_model)
    sd.unet.add_adapter(peft.LoraConfig(r=4, target_modules=["to_q", "to_v"]))
    with pytest.raises(OffloadError, match="LoRA"):
        apply(sd, OffloadPlan({"unet": P("block", 1, disk=True)}, 1), profile_pipeline(sd), cpu)


def test_sizes():
    assert parse_size("24GiB", "--gpu-memory") == 24 * GiB
    assert parse_size("80GB", "--gpu-memory") == 80 * 10**9
    assert parse_size("1.5 gib", "--gpu-memory") == int(1.5 * GiB)
    for bad in ("24", "GiB", "24 parsecs", "-1GiB"):
        with pytest.raises(ConfigError, match=f"`--gpu-memory` must be a size like `24GiB`, got `{bad}`."):
            parse_size(bad, "--gpu-memory")


def test_plan_command_json(capsys):
    from fleetgen.cli import main

    code = main(
        [
            "plan",
            "--model",
            "flux.1-dev",
            "--gpu-memory",
            "24GiB",
            "--gpu-memory",
            "80GiB",
            "--gpu-memory",
            "2GiB",
            "--host-memory",
            "64GiB",
            "--json",
        ]
    )
    out = json.loads(capsys.readouterr().out)
    assert code == 1  # 2 GiB cannot hold it
    small, big, tiny = out["plans"]
    assert small["modes"]["transformer"] != "resident" and small["peak_bytes"] <= 24 * GiB
    assert all(m == "resident" for m in big["modes"].values())
    assert "Nothing fits 2.0 GiB" in tiny["error"]
    assert main(["plan", "--model", "sdxl", "--gpu-memory", "12GiB", "--host-memory", "64GiB"]) == 0
    text = capsys.readouterr().out
    assert "sdxl (sdxl family) at float16: unet UNet2DConditionModel 2.57 B params" in text and "12GiB:" in text


def test_plans_count_the_denoiser_twice_only_where_guidance_runs_it_twice(capsys):
    """FLUX.1-dev is guidance-distilled: its guidance is an input, one pass per step; with
    `--true-cfg-scale` > 1 (negative prompts) it runs twice, as CFG families always do."""
    from fleetgen.cli import main

    def plan(*args) -> dict:
        assert (
            main(["plan", "--gpu-memory", "80GiB", "--host-memory", "64GiB", "--max-batch", "1", "--json", *args]) == 0
        )
        return json.loads(capsys.readouterr().out)

    def compute(out: dict, name: str) -> float:
        return out["plans"][0]["predicted_terms"][name]["compute"]

    distilled, true_cfg = plan("--model", "flux.1-dev"), plan("--model", "flux.1-dev", "--true-cfg-scale", "4")
    assert distilled["family"] == "flux"
    # the transformer's compute doubles; the text encoders' and the VAE's do not
    assert compute(true_cfg, "transformer") == pytest.approx(2 * compute(distilled, "transformer"))
    assert compute(true_cfg, "vae") == pytest.approx(compute(distilled, "vae"))
    sd_cfg, sd_plain = plan("--model", "sd-1.5", "--guidance", "7.5"), plan("--model", "sd-1.5", "--guidance", "1")
    assert sd_cfg["family"] == "sd"
    assert compute(sd_cfg, "unet") == pytest.approx(2 * compute(sd_plain, "unet"))
    assert sd_cfg["plans"][0]["predicted_seconds_per_image"] > sd_plain["plans"][0]["predicted_seconds_per_image"]


def test_stale_disk_dirs_of_dead_workers_are_swept(tmp_path, monkeypatch):
    import subprocess
    import tempfile

    from fleetgen.offload.hooks import DISK_PREFIX, sweep_stale_disk_dirs

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid now names no process
    stale = tmp_path / f"{DISK_PREFIX}{dead.pid}-w0-unet-x"
    live = tmp_path / f"{DISK_PREFIX}{os.getpid()}-w0-unet-y"
    stale.mkdir()
    live.mkdir()
    sweep_stale_disk_dirs()
    assert not stale.exists() and live.exists()


def test_plan_command_on_a_pipeline_directory(tiny_model, capsys):
    """Any pipeline directory plans, e.g. the one `fleetgen tiny-model` writes (its saved
    text-encoder config names its own model_type)."""
    from fleetgen.cli import main

    assert (
        main(
            [
                "plan",
                "--model",
                tiny_model,
                "--gpu-memory",
                "1GiB",
                "--width",
                "64",
                "--height",
                "64",
                "--host-memory",
                "1GiB",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "text_encoder CLIPTextModel" in text and "1GiB: " in text and "nothing fits" not in text


def test_components_with_lora_adapters_are_never_planned_to_disk(profiles):
    """Disk offload with LoRA layers computes wrong images (notes): the planner leaves it out for a
    component that holds adapters, and says so when nothing else fits."""
    from dataclasses import replace

    prof = profiles["sdxl"]
    tight = DeviceSpec(budget=8 * GiB, host_budget=GiB)
    assert "disk" in plan(prof, tight, Workload(loaded=True)).modes["unet"]
    lora = replace(prof, components={**prof.components, "unet": replace(prof.components["unet"], adapters=True)})
    assert "disk" not in plan(lora, DeviceSpec(budget=8 * GiB, host_budget=64 * GiB), Workload()).modes["unet"]
    with pytest.raises(OffloadError):
        plan(lora, tight, Workload(loaded=True))


def test_after_an_oom_a_leaner_placement_is_found_even_where_a_step_down_overshoots():
    """Activation-heavy plans: from the smallest budget that holds everything resident, a 25 % step
    lands where nothing fits; the budgets between still hold a leaner placement, which is chosen."""
    from fleetgen.workers.pipeline.plans import STEP_DOWN, choose_plan, device_spec, leaner_plan

    profile = profile_pipeline(build_tiny_flux())
    probe = {"host_available_bytes": 2**34, "free_bytes": None, "bandwidth": 2e10, "flops": 1e12}
    work = Workload(width=64, height=64, steps=2, cfg=False, max_batch=1, offload="auto", loaded=True)

    def device(budget):
        return device_spec(torch.device("cpu"), probe, budget, None)

    def at(budget):
        return choose_plan(profile, work, device(budget))

    low, high = 1, 2**30  # the smallest budget whose plan is all resident
    while high - low > 1:
        middle = (low + high) // 2
        try:
            resident = set(at(middle).to_dict()["modes"].values()) == {"resident"}
        except OffloadError:
            resident = False
        low, high = (low, middle) if resident else (middle, high)
    current = at(high)
    with pytest.raises(OffloadError):
        at(int(high * STEP_DOWN))  # the plain step overshoots: what the bisection is for
    leaner = leaner_plan(profile, current, work, device(high))
    assert leaner.placements != current.placements and leaner.budget < high
    assert set(leaner.to_dict()["modes"].values()) != {"resident"}
