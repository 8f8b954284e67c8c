"""`fleetgen plan` on the 2025-26 architectures (config-only, on the `meta` device): their sizes
against the published ones, the dimensions the profile reads, and FLUX.2 dev planned for four
devices on three hosts, each plan naming the budget that binds it."""

import json
import time

import pytest
import torch

from fleetgen.cli import main
from fleetgen.jobs.planning import RowsAsk, plan_rows, plan_workload
from fleetgen.offload import profile_modules
from fleetgen.offload.planner import TIE  # plans within it compare as equal: the tie goes to fewer bytes moved
from tests.offload.exhaustive import exhaustive_key, plan_key

# Parameter counts as their publishers state them (model cards, the encoders' hub pages), with the
# precision they are stated to: a figure given as "20B" is checked to ±0.5 B, "8.29B" to 2 %.
PUBLISHED = {
    ("flux.2-dev", "transformer"): "32B",  # FLUX.2 [dev] card: a 32 billion parameter transformer
    ("flux.2-dev", "text_encoder"): "24B",  # Mistral Small 3.1 24B
    ("flux.2-klein-4b", "transformer"): "4B",  # FLUX.2 [klein] 4B
    ("flux.2-klein-4b", "text_encoder"): "4.02B",  # Qwen3-4B
    ("qwen-image", "transformer"): "20B",  # Qwen-Image card: a 20B MMDiT
    ("qwen-image", "text_encoder"): "8.29B",  # Qwen2.5-VL-7B-Instruct
    ("z-image-turbo", "transformer"): "6B",  # Z-Image card: 6B parameters
    ("z-image-turbo", "text_encoder"): "4.02B",  # Qwen3-4B
    ("hunyuanimage-2.1", "transformer"): "17B",  # HunyuanImage-2.1 card: 17B
    ("hunyuanimage-2.1", "text_encoder"): "8.29B",  # Qwen2.5-VL-7B-Instruct
    ("chroma1-hd", "transformer"): "8.9B",  # Chroma1-HD card: 8.9B
    ("chroma1-hd", "text_encoder"): "4.76B",  # T5-XXL encoder
    ("hidream-i1", "transformer"): "17B",  # HiDream-I1 card: 17B
    ("hidream-i1", "text_encoder_3"): "4.76B",  # T5-XXL encoder
    ("hidream-i1", "text_encoder_4"): "8.03B",  # Llama-3.1-8B-Instruct
    ("ltx-2", "transformer"): "19B",  # LTX-2 card: a 19B audio-video model (14 B video + 5 B audio stream)
    ("ltx-2", "text_encoder"): "12B",  # Gemma 3 12B (its vision tower included: the class loads it)
}
# What the profile must read from each architecture: (VAE scale, latent pixels per token, latent
# channels, {component: activation width}).
DIMENSIONS = {
    "flux.2-dev": (8, 2, 32, {"transformer": 6144, "text_encoder": 5120}),  # Mistral 3's width, not its vocabulary
    "flux.2-klein-4b": (8, 2, 32, {"text_encoder": 2560}),
    "qwen-image": (8, 2, 16, {"transformer": 3072, "text_encoder": 3584}),  # Qwen2.5-VL; a Wan-style VAE
    "z-image-turbo": (8, 2, 16, {"transformer": 3840}),  # patch under `all_patch_size`
    "hunyuanimage-2.1": (32, 1, 64, {"transformer": 3584, "text_encoder_2": 1472}),  # a 32x VAE
    "chroma1-hd": (8, 2, 16, {"transformer": 3072}),  # packs 2x2 latents as FLUX.1 does
    "hidream-i1": (8, 2, 16, {"transformer": 2560, "text_encoder_4": 4096}),
    "ltx-2": (32, 1, 128, {"transformer": 4096, "text_encoder": 3840}),  # a 32x VAE, patch 1
}


def _tolerance(stated: str) -> float:
    digits = stated.removesuffix("B")
    decimals = len(digits.split(".")[1]) if "." in digits else 0
    value = float(digits) * 1e9
    return max(0.02 * value, 0.5 * 10 ** (9 - decimals))


@pytest.fixture(scope="module")
def profiles(meta_build):
    return {name: profile_modules(name, meta_build(name), torch.bfloat16) for name in DIMENSIONS}


@pytest.mark.parametrize(("arch", "component"), sorted(PUBLISHED))
def test_parameter_counts_are_the_published_ones(arch, component, profiles):
    stated = PUBLISHED[arch, component]
    params = profiles[arch].components[component].params
    assert abs(params - float(stated.removesuffix("B")) * 1e9) <= _tolerance(stated), f"{params / 1e9:.3f} B"


@pytest.mark.parametrize("arch", sorted(DIMENSIONS))
def test_the_profile_reads_each_architectures_dimensions(arch, profiles):
    scale, patch, latents, widths = DIMENSIONS[arch]
    prof = profiles[arch]
    assert (prof.vae_scale, prof.patch, prof.latent_channels) == (scale, patch, latents)
    assert {n: prof.components[n].hidden for n in widths} == widths


def test_flux2_dev_on_four_devices_and_three_hosts_names_the_binding_budget():
    work, family = plan_workload(
        "flux.2-dev",
        width=1024,
        height=1024,
        steps=None,
        guidance=None,
        true_cfg_scale=None,
        max_batch=8,
        offload="auto",
    )
    assert family.name == "flux2" and not work.cfg  # guidance-distilled: one pass per step
    seen = {}
    for host in ("64GiB", "128GiB", "256GiB"):
        started = time.perf_counter()
        summary, rows = plan_rows(RowsAsk("flux.2-dev", ("24GiB", "48GiB", "80GiB", "141GiB"), host, "bfloat16", work))
        for row in rows:
            assert row["binds"] or row.get("error") is None  # a refusal always names its budget
            seen[host, row["gpu_memory"]] = row
        assert time.perf_counter() - started < 4 * 1.0 + 10  # the profile once, then under 1 s a plan
    # 105 GiB of bf16 weights cannot even load on a 64 GiB host, whatever the GPU
    assert all(seen["64GiB", g]["error"].startswith("Nothing loads (host RAM binds)") for g in ("24GiB", "141GiB"))
    # 128 GiB: loads; the transformer's pinned copy leaves too little host RAM to stream the text encoder
    small = seen["128GiB", "24GiB"]
    assert small["modes"]["text_encoder"].endswith("+disk") and "host RAM" in small["binds"]
    # 256 GiB: both stream from RAM; only the device binds
    assert "+disk" not in seen["256GiB", "24GiB"]["modes"]["text_encoder"]
    assert seen["256GiB", "24GiB"]["binds"] == ["device memory"]
    # an H200's 141 GiB holds the transformer; whether the text encoder stays too (at a smaller batch) or
    # streams (freeing room for batch 8) is a close call the model leaves to the workers' trials
    big = seen["256GiB", "141GiB"]
    assert big["modes"]["transformer"] == big["modes"]["vae"] == "resident"
    assert big["modes"]["text_encoder"] == "resident" or big["batch_size"] == 8


def test_each_plan_takes_under_a_second(profiles):
    from fleetgen.offload import DeviceSpec, Workload, plan

    for arch, prof in profiles.items():
        for budget in (24, 48, 80, 141):
            started = time.perf_counter()
            try:
                plan(prof, DeviceSpec(budget=budget << 30, host_budget=256 << 30), Workload(width=1024, height=1024))
            except Exception:  # noqa: BLE001 - a refusal is a plan too: it must be as quick
                pass
            assert time.perf_counter() - started < 1.0, (arch, budget)


def test_plan_cli_on_a_frontier_architecture(capsys):
    assert main(["plan", "--model", "qwen-image", "--gpu-memory", "24GiB", "--host-memory", "128GiB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["family"] == "qwen-image" and out["dtype"] == "bfloat16"
    assert out["load_host_bytes"] == sum(c["bytes"] for c in out["components"].values())
    assert out["plans"][0]["binds"] and "binds:" in out["plans"][0]["reason"]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["sd-1.5", "sdxl", "flux.1-dev", "flux.2-dev", "qwen-image", "chroma1-hd"])
def test_the_search_finds_what_the_exhaustive_one_finds(arch, meta_build):
    """Wherever every product is small enough to try (four components or fewer), the pruned search
    returns a plan exactly as fast, moving as many bytes, offloading as many components — over a
    grid of device and host budgets, refusals included."""
    from fleetgen.errors import OffloadError
    from fleetgen.offload import DeviceSpec, Workload, plan

    prof = profile_modules(arch, meta_build(arch), torch.bfloat16)
    w = Workload(width=1024, height=1024, steps=20, max_batch=4, phases="off")  # the per-batch search
    for gib in (4, 12, 24, 48, 80):
        for host in (16, 64, 256):
            device = DeviceSpec(budget=gib << 30, host_budget=host << 30)
            expected = exhaustive_key(prof, device, w)
            try:
                got = plan(prof, device, w)
            except OffloadError:
                assert expected is None, (arch, gib, host)
                continue
            assert plan_key(got) == expected, (arch, gib, host)


@pytest.mark.parametrize("arch", sorted(DIMENSIONS))
def test_more_device_memory_never_predicts_slower(arch, profiles):
    from fleetgen.errors import OffloadError
    from fleetgen.offload import DeviceSpec, Workload, plan

    last = None
    for gib in (8, 16, 24, 32, 48, 64, 80, 96, 141):
        try:
            p = plan(profiles[arch], DeviceSpec(budget=gib << 30, host_budget=256 << 30), Workload(max_batch=4))
        except OffloadError:
            assert last is None, f"{arch}: {gib} GiB fails although a smaller budget fitted"
            continue
        if last is not None:
            assert p.seconds_per_image <= last.seconds_per_image * (1 + TIE), (arch, gib, p.modes, last.modes)
        last = p
    assert last is not None
