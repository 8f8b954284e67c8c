"""The planner on video: a clip's tokens are every latent frame's, Wan 2.2's two experts run on
alternate step ranges (one live at a time), the VAE decodes one clip at a time; the shipped Wan
architectures planned from 16 to 141 GiB, monotone in memory, each plan naming the experts and
the decode, under a second each."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch

from fleetgen.jobs.planning import RowsAsk, plan_rows, plan_workload
from fleetgen.latents import expert_shares, latent_frames, vae_temporal
from fleetgen.offload import DeviceSpec, Workload, plan, profile_modules
from fleetgen.offload.architectures import build_on_meta, pipeline_settings
from fleetgen.offload.cost import Placement, _activations, _call_seconds, _forwards, _tokens
from fleetgen.offload.planner import TIE  # plans within it compare as equal: the tie goes to fewer bytes moved

BUDGETS = ["16GiB", "24GiB", "48GiB", "80GiB", "141GiB"]


@pytest.fixture(scope="module")
def a14b():
    model = "wan2.2-t2v-a14b"
    return profile_modules(model, build_on_meta(model), torch.bfloat16, pipeline_config=pipeline_settings(model))


def test_latent_frames_and_the_experts_shares():
    assert vae_temporal({"temperal_downsample": [False, True, True]}) == 4
    assert vae_temporal({"scale_factor_temporal": 4}) == 4 and vae_temporal({"block_out_channels": [1]}) == 1
    assert [latent_frames(n, 4) for n in (0, 1, 5, 81, 121)] == [1, 1, 2, 21, 31]
    shares = expert_shares(0.875, 12.0)  # T2V-A14B's boundary and shift
    assert shares["transformer"] == pytest.approx(0.632, abs=1e-3) and sum(shares.values()) == pytest.approx(1)
    assert expert_shares(0.875, 1.0)["transformer"] == pytest.approx(0.125)  # unshifted: the boundary itself
    assert expert_shares(None, 12.0) == {}


def test_a_clip_costs_every_latent_frame_and_each_expert_its_steps(a14b):
    image = Workload(width=1280, height=720, steps=40, cfg=False)
    clip = Workload(width=1280, height=720, steps=40, cfg=False, frames=81)
    t, t2, vae = (a14b.components[n] for n in ("transformer", "transformer_2", "vae"))
    assert _tokens(t, a14b, clip) == 21 * _tokens(t, a14b, image) == 21 * 80 * 45
    assert (_forwards(t, clip, a14b), _forwards(t2, clip, a14b), _forwards(vae, clip, a14b)) == (25, 15, 1)
    # the decode holds one latent frame's four output frames of feature maps, and the clip itself
    assert _activations(vae, a14b, clip) > 4 * _activations(vae, a14b, image)


def test_wan22_a14b_is_planned_at_every_budget_and_more_memory_never_predicts_slower(a14b):
    work, family = plan_workload(
        "wan2.2-t2v-a14b",
        width=None,
        height=None,
        steps=None,
        guidance=None,
        true_cfg_scale=None,
        max_batch=8,
        offload="auto",
    )
    assert (family.name, work.frames, work.width, work.height, work.steps, work.cfg_calls) == (
        "wan2.2",
        81,
        1280,
        720,
        40,
        True,
    )
    seconds = []
    for gib in (16, 24, 48, 80, 141):
        device = DeviceSpec(budget=gib << 30, host_budget=128 << 30)
        started = time.perf_counter()
        p = plan(a14b, device, work)
        assert time.perf_counter() - started < 1.0
        assert p.peak_bytes <= device.budget * 0.9
        assert "two experts alternate (transformer 63% of the steps, transformer_2 37%" in p.reason
        assert "the VAE decodes one clip at a time: 81 frames at 1280x720" in p.reason
        seconds.append(p.seconds_per_image)
    assert all(b <= a * (1 + TIE) for a, b in zip(seconds, seconds[1:], strict=False)), seconds
    # 16 GiB holds neither 26.6 GiB expert: both stream, one on the device at a time
    small = plan(a14b, DeviceSpec(budget=16 << 30, host_budget=128 << 30), work)
    assert small.modes["transformer"] != "resident" and small.modes["transformer_2"] != "resident"


def test_fleetgen_plan_says_clips_per_hour(capsys):
    from fleetgen.cli import main

    assert main(["plan", "--model", "wan2.2-ti2v-5b", "--gpu-memory", "24GiB", "--host-memory", "64GiB"]) == 0
    out = capsys.readouterr().out
    assert "clips/h" in out and "121 frames at 1280x704" in out
    work, _ = plan_workload(
        "wan2.2-ti2v-5b",
        width=None,
        height=None,
        steps=None,
        guidance=None,
        true_cfg_scale=None,
        max_batch=1,
        offload="auto",
        num_frames=41,
    )
    summary, rows = plan_rows(RowsAsk("wan2.2-ti2v-5b", tuple(BUDGETS), "64GiB", "bfloat16", work))
    assert summary["frames"] == 41 and all("error" not in r for r in rows)


def test_hunyuanvideo15_is_planned_from_its_published_configs():
    work, family = plan_workload(
        "hunyuanvideo-1.5",
        width=None,
        height=None,
        steps=None,
        guidance=None,
        true_cfg_scale=None,
        max_batch=4,
        offload="auto",
    )
    assert (family.name, work.frames, work.width, work.height, work.cfg_calls) == (
        "hunyuanvideo-1.5",
        121,
        848,
        480,
        True,
    )
    summary, rows = plan_rows(RowsAsk("hunyuanvideo-1.5", tuple(BUDGETS), "128GiB", "bfloat16", work))
    assert round(summary["components"]["transformer"]["params"] / 1e9, 1) == 8.3  # HunyuanVideo 1.5: 8.3 B
    assert all("error" not in r and r["peak_bytes"] <= parse_gib(r["gpu_memory"]) * 0.9 for r in rows)
    assert "121 frames at 848x480" in rows[0]["reason"]


def parse_gib(text: str) -> int:
    return int(text.removesuffix("GiB")) << 30


def test_ltx2_is_planned_from_its_published_configs_with_every_pass_counted():
    """LTX-2 19 B: Gemma 3 12B, the connectors and vocoder of diffusers' `ltx2` pipeline module
    (model_index.json names them so), and per step the cond+uncond batch plus two calls of their own
    (spatio-temporal guidance, modality isolation) at the pipeline's defaults."""
    work, family = plan_workload(
        "ltx-2", width=None, height=None, steps=None, guidance=None, true_cfg_scale=None, max_batch=4, offload="auto"
    )
    assert (family.name, work.frames, work.width, work.height, work.steps, work.cfg, work.cfg_calls) == (
        "ltx-2",
        121,
        768,
        512,
        30,
        True,
        2,
    )
    summary, rows = plan_rows(RowsAsk("ltx-2", tuple(BUDGETS), "128GiB", "bfloat16", work))
    params = {k: round(c["params"] / 1e9, 1) for k, c in summary["components"].items()}
    assert (params["transformer"], params["text_encoder"]) == (18.9, 12.2)  # "19 B" and Gemma 3 12B
    assert {"connectors", "vocoder", "audio_vae", "vae"} <= set(params)
    # its VAE decodes all 121 frames at once (~18 GiB of feature maps): 16 GiB holds no plan, and says so
    assert "Nothing fits 16.0 GiB" in rows[0]["error"] and "at 768x512" in rows[0]["error"]
    assert all("error" not in r and r["peak_bytes"] <= parse_gib(r["gpu_memory"]) * 0.9 for r in rows[1:])
    assert "121 frames at 768x512" in rows[1]["reason"]
    # the two extra passes: a step's transformer compute is 4 batches' worth, not guidance's 2
    model = profile_modules("ltx-2", build_on_meta("ltx-2"), torch.bfloat16)
    device, t, resident = DeviceSpec(141 << 30, 128 << 30), model.components["transformer"], Placement("resident")
    steps = [_call_seconds(t, resident, model, replace(work, cfg_calls=n), device, 1) for n in (2, 0)]
    per_step = [(s / _forwards(t, work, model) - device.speed.forward_seconds) for s in steps]
    assert per_step[0] == pytest.approx(2 * per_step[1])
