"""The planner's choice vs no offload vs the other modes, on one CUDA GPU, with no Ray.

A random-weight FLUX.1-dev-size transformer (11.9 B params, bf16; built on the GPU, synthetic text
embeddings) runs denoising steps at 1024x1024. Each placement is measured once with no memory
limit (steps/s, peak device memory, bytes moved, achieved host→device GB/s). Then, for each budget
(emulated with `torch.cuda.set_per_process_memory_fraction`), the planner plans from the profile
and the probed bandwidth/FLOP/s, and its choice is run under that limit.

    python bench/gpu_offload.py [--budgets 80,48,24,16,12] [--steps 3] [--json out.json]
    python bench/gpu_offload.py --tiny       # the same path at tiny size, on CPU (a smoke test)

Needs torch and diffusers only (no Ray). Under 8 minutes on an H100/H200-class GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fleetgen.offload import DeviceSpec, OffloadPlan, OffloadStats, Placement, Workload, apply, plan, profile_modules  # noqa: E402
from fleetgen.offload.architectures import HERE  # noqa: E402
from fleetgen.units import format_size  # noqa: E402
from fleetgen.workers.pipeline.probe import probe  # noqa: E402

GiB = 2**30
TINY = {
    "attention_head_dim": 16,
    "num_attention_heads": 2,
    "num_layers": 2,
    "num_single_layers": 4,
    "joint_attention_dim": 32,
    "pooled_projection_dim": 32,
    "in_channels": 16,
    "axes_dims_rope": [4, 6, 6],
}


def build(device: torch.device, tiny: bool) -> torch.nn.Module:
    from diffusers import FluxTransformer2DModel

    config = json.loads((HERE / "flux.1-dev" / "transformer" / "config.json").read_text())
    if tiny:
        config.update(TINY)
    with torch.device("meta"):
        model = FluxTransformer2DModel.from_config(config)
    model = model.to_empty(device=device).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    return model.eval()


def inputs(model, device, size: int, text_tokens: int):
    c = model.config
    tokens = (size // 16) ** 2  # 8x VAE, then 2x2 packing
    g = torch.Generator(device="cpu").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device, torch.bfloat16)

    ids = torch.zeros(tokens, 3)
    ids[:, 1] = torch.arange(tokens) // (size // 16)
    ids[:, 2] = torch.arange(tokens) % (size // 16)
    return {
        "hidden_states": randn(1, tokens, c.in_channels),
        "encoder_hidden_states": randn(1, text_tokens, c.joint_attention_dim),
        "pooled_projections": randn(1, c.pooled_projection_dim),
        "timestep": torch.tensor([0.5], device=device, dtype=torch.bfloat16),
        "img_ids": ids.to(device),
        "txt_ids": torch.zeros(text_tokens, 3, device=device),
        "guidance": torch.tensor([3.5], device=device, dtype=torch.bfloat16) if c.guidance_embeds else None,
    }


def place(model, placement: Placement, profile, device):
    from fleetgen.offload.hooks import unapply

    unapply(_Holder(model))  # every offloading hook (a streamed mode's prefetch and tracker hooks too), on the CPU
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return apply(_Holder(model), OffloadPlan({"transformer": placement}, 1), profile, device)


class _Holder:
    """The one-component 'pipeline' that `apply` expects."""

    def __init__(self, model):
        self.components = {"transformer": model}


def measure(model, placement, profile, device, args, x) -> dict:
    placed = place(model, placement, profile, device)
    stats = OffloadStats({"transformer": model}, device)
    cuda = device.type == "cuda"
    try:
        with torch.no_grad():
            model(**x)  # warm up (streams trace the execution order here)
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            before = stats.snapshot()["components"].get("transformer", {}).get("bytes_onloaded", 0)
            start = time.perf_counter()
            for _ in range(args.steps):
                model(**x)
            if cuda:
                torch.cuda.synchronize()
            seconds = time.perf_counter() - start
        moved = stats.snapshot()["components"].get("transformer", {}).get("bytes_onloaded", 0) - before
        return {
            "placement": placement.label,
            "steps_per_s": args.steps / seconds,
            "seconds_per_step": seconds / args.steps,
            "peak_bytes": torch.cuda.max_memory_allocated() if cuda else None,
            "moved_bytes_per_step": moved // args.steps,
            "achieved_gb_per_s": moved / seconds / 1e9 if moved else None,
        }
    except torch.OutOfMemoryError as err:
        return {"placement": placement.label, "error": f"out of memory: {str(err).splitlines()[0][:120]}"}
    finally:
        stats.close()
        placed.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="tiny transformer on CPU: checks the script, not the GPU")
    ap.add_argument("--budgets", default="80,48,24,16,12", help="GB (GiB) budgets to emulate")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--json")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    if device.type == "cpu" and not args.tiny:
        sys.exit("No CUDA device: run with --tiny to exercise the script on CPU.")
    started = time.perf_counter()
    model = build(device, args.tiny)
    profile = profile_modules("flux.1-dev transformer", {"transformer": model}, torch.bfloat16)
    found = probe(device, torch.bfloat16)
    size = args.size if not args.tiny else 64
    x = inputs(model, device, size, 512 if not args.tiny else 16)
    total = found["total_bytes"] or 64 * GiB
    work = Workload(width=size, height=size, steps=args.steps, cfg=False, max_batch=1)
    if args.tiny:  # budgets as fractions of what no offload needs, as 32 GiB is to the full model
        unlimited = DeviceSpec(budget=2**50, host_budget=2**50, streams=False)
        need = plan(profile, unlimited, Workload(**{**work.__dict__, "offload": "none"})).peak_bytes
        scale = need / (32 * GiB)
    else:
        scale = 1.0
    result = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (tiny smoke test)",
        "params": profile.components["transformer"].params,
        "probe": found,
        "modes": {},
        "budgets": [],
    }
    print(
        f"{result['device']}: {result['params'] / 1e9:.2f} B params, bandwidth {found['bandwidth'] / 1e9:.1f} GB/s, "
        f"{found['flops'] / 1e12:.0f} TFLOP/s ({'probed' if found['measured'] else 'assumed'})",
        flush=True,
    )

    streams = device.type == "cuda"
    modes = [Placement("resident"), Placement("block", 1), Placement("leaf")]
    if streams:
        modes += [Placement("block", 1, stream=True), Placement("leaf", stream=True)]
    for m in modes:
        r = result["modes"][m.label] = measure(model, m, profile, device, args, x)
        print(
            f"  {m.label:22s} "
            + (
                r.get("error")
                or f"{r['steps_per_s']:.3f} steps/s, peak "
                f"{format_size(r['peak_bytes'] or 0)}, moved {format_size(r['moved_bytes_per_step'])}/step, "
                f"{(r['achieved_gb_per_s'] or 0):.1f} GB/s"
            ),
            flush=True,
        )

    for gb in (float(b) for b in args.budgets.split(",")):
        budget = int(gb * GiB * scale)
        spec = DeviceSpec(
            budget=budget,
            host_budget=int(found["host_available_bytes"] * 0.8),
            bandwidth=found["bandwidth"],
            flops=found["flops"],
            streams=streams,
        )
        row = {"budget_gib": gb, "budget_bytes": budget}
        try:
            chosen = plan(profile, spec, work)
        except Exception as err:  # noqa: BLE001 - reported, not fatal: the next budget still runs
            row["plan_error"] = str(err)
        else:
            row["plan"] = chosen.to_dict()
            if device.type == "cuda":
                torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total))
            row["measured"] = measure(model, chosen.placements["transformer"], profile, device, args, x)
            if device.type == "cuda":
                torch.cuda.set_per_process_memory_fraction(1.0)
            resident = result["modes"]["resident"]
            if "steps_per_s" in row["measured"] and "steps_per_s" in resident:
                row["vs_no_offload"] = row["measured"]["steps_per_s"] / resident["steps_per_s"]
        result["budgets"].append(row)
        m = row.get("measured", {})
        print(
            f"budget {gb:g} GiB: "
            + (
                row.get("plan_error")
                or f"plan {row['plan']['modes']['transformer']} -> "
                + (
                    m.get("error")
                    or f"{m['steps_per_s']:.3f} steps/s ({row.get('vs_no_offload', float('nan')):.2f}x no "
                    f"offload), peak {format_size(m['peak_bytes'] or 0)}"
                )
            ),
            flush=True,
        )
    result["seconds"] = time.perf_counter() - started
    print(f"total {result['seconds']:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
