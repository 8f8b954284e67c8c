"""Every CUDA path of fleetgen, run once on a real GPU: `make gpu-check` (no Ray).

  1. the `gpu`-marked tests (streams give the same latents; offload re-applied with streams
     leaves no stale hook), bounded by a timeout;
  2. FLUX.1-dev, then SDXL, at their real sizes with random weights, built directly on the GPU from
     the configs in offload/architectures (tokenizers: the small in-memory ones, whose ids fit any
     vocabulary). For each model: all resident, then for each budget the planner's choice, through
     the same `Worker` a job uses (plan, apply, warm up, generate a shard, encode, write to a local
     output). A budget is emulated by capping PyTorch's allocator at the budget minus what the
     process holds outside it (CUDA context, library handles, kernel images: measured at start), as
     a real card of that size would offer. Per row: the allocated and reserved peaks against the
     planner's predicted peak, measured vs predicted seconds per image (the cost model is
     uncalibrated: the ratio is what calibrates it), the average host→device rate over the
     generation (bytes moved ÷ generate time: not link bandwidth), images/s relative to all
     resident, and any step-down;
  3. a real out-of-memory error: a worker planned all resident at batch 8, then held to what its
     weights take plus 512 MiB: it must step down (batch, then a leaner plan re-applied with
     streams) and still make every image;
  4. phased beside per batch (`PHASED`: FLUX.2 klein 4B at 12 GiB, Z-Image-Turbo and FLUX.1-dev at
     16 GiB, where a model runs): the same shard with `--phases off`, then `on`, each row with the
     device's measured peak per phase.

Each row is written to the JSON file as soon as it is measured (put it under `$OUT` on a lent
machine: only that comes back), and each row and each model is guarded: a failure is recorded
(type, message, the traceback's end) and the check goes on. Rows are skipped, and say so, once
`--time-limit` seconds have passed. `--dry` runs the same code at tiny size on CPU (SDXL in float16,
budgets scaled to the tiny models so that they offload; the OOM is raised by a hook, in SDXL's VAE
decode): that is `make gpu-check-dry`, part of the test suite, so the script cannot rot.

    python3 bench/gpu_check.py [--json "$OUT/gpu-check.json"] [--budgets 8,16,24] [--host-memory 96GiB]
    python3 bench/gpu_check.py --dry
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# The pipelines' own warnings ("some layers were not executed" from lazy prefetch) matter here.
os.environ.setdefault("DIFFUSERS_VERBOSITY", "warning")

from fleetgen.attention import parse_attention  # noqa: E402
from fleetgen.caches import parse_cache  # noqa: E402
from fleetgen.errors import FleetgenError  # noqa: E402
from fleetgen.jobs.sharding import plan_shards, read_footer, resolve_columns  # noqa: E402
from fleetgen.offload.hooks import offload_hooks  # noqa: E402
from fleetgen.offload.weight_formats import parse_quantize  # noqa: E402
from fleetgen.units import format_size, parse_size  # noqa: E402
from fleetgen.workers.families.detect import FAMILIES  # noqa: E402
from fleetgen.workers.rows.shard import Columns  # noqa: E402
from fleetgen.workers.spec import GenerationSettings, WorkerSpec  # noqa: E402
from fleetgen.workers.worker import Worker  # noqa: E402

GiB = 2**30
GPU_TESTS = [
    "tests/bench/test_bench.py",
    "tests/offload/test_gpu.py",
    "tests/workers/pipeline/test_phases.py",  # a phased image-to-image on the device (#40), the scorers' phase (#41)
    "tests/workers/pipeline/test_scoring.py",  # the scorers on the device (#41)
    "tests/workers/test_host_copy.py",  # the node's copy registered in place, streamed from (#60)
]  # the files holding `gpu`-marked tests (no Ray imports)
GPU_TESTS_TIMEOUT = 240  # seconds
# model: (shipped architecture, family, dtype on CUDA, tiny builder and dtype for --dry)
MODELS = {
    "sdxl": ("sdxl", "sdxl", torch.float16, "build_tiny_sdxl", torch.float16),
    "flux.1-dev": ("flux.1-dev", "flux", torch.bfloat16, "build_tiny_flux", torch.float32),
    "flux.2-dev": ("flux.2-dev", "flux2", torch.bfloat16, "build_tiny_flux2", torch.float32),
    "qwen-image": ("qwen-image", "qwen-image", torch.bfloat16, "build_tiny_qwen_image", torch.float32),
    "flux.2-klein-4b": ("flux.2-klein-4b", "flux2-klein", torch.bfloat16, "build_tiny_flux2_klein", torch.float32),
    "z-image-turbo": ("z-image-turbo", "z-image-turbo", torch.bfloat16, "build_tiny_z_image", torch.float32),
    # video: clips of VIDEO frames at VIDEO_SIZE (a 16x VAE and a patch of 2: sides multiples of 32)
    "wan2.2-ti2v-5b": ("wan2.2-ti2v-5b", "wan-ti2v", torch.bfloat16, "build_tiny_wan", torch.float32),
}
# `--models frontier`: the largest of these whose random weights fit this machine (built on the GPU,
# then moved to host RAM as a loaded checkpoint starts): FLUX.2 dev needs ~105 GiB of each.
FRONTIER = ("flux.2-dev", "qwen-image", "flux.2-klein-4b")
VIDEO = {"wan2.2-ti2v-5b": (41, 832, 480)}  # frames, width, height of the measured clips (tiny: 5 at 64x64)
# The phased rows (#40), each beside the per-batch plan at the same budget: the measured peak per phase.
PHASED = {"flux.2-klein-4b": 12, "z-image-turbo": 16, "flux.1-dev": 16}  # GiB
DEFAULT_MODELS = "flux.1-dev,sdxl,frontier,z-image-turbo,wan2.2-ti2v-5b"
OOM_HEADROOM = 512 * 2**20  # the forced OOM holds a worker to its weights plus this
HOST_SHARE = 0.7  # of MemTotal, the default host budget on CUDA (MemAvailable reads low on a VM that grows on use)


class _Once(logging.Filter):
    """Each distinct library warning once (SDXL's pipeline warns at every call as it casts its VAE back)."""

    def __init__(self):
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message in self.seen:
            return False
        self.seen.add(message)
        return True


def meminfo() -> dict:
    with open("/proc/meminfo") as f:
        info = dict(line.split(":", 1) for line in f)
    return {k: int(info[k].split()[0]) * 1024 for k in ("MemTotal", "MemAvailable") if k in info}


def release_host_cache() -> None:
    """Pinned host blocks are cached, not freed, by torch's host allocator: give them back between models."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
        if empty is not None:
            empty()
        elif hasattr(torch._C, "_host_emptyCache"):
            torch._C._host_emptyCache()


def build(model: str, device: torch.device, dry: bool):
    import fleetgen.workers.tiny as tiny
    from fleetgen.workers.tiny import dit, flux, qwen, sd, video

    architecture, family, dtype, tiny_builder, tiny_dtype = MODELS[model]
    if dry:
        builder = next(getattr(m, tiny_builder) for m in (sd, flux, qwen, dit, video) if hasattr(m, tiny_builder))
        pipe = builder(0, **({"guidance_embeds": True} if family == "flux" else {}))
        return pipe.to(tiny_dtype), tiny_dtype
    pipe = tiny.build_random_pipeline(architecture, device, dtype)
    pipe.to("cpu")  # where a loaded checkpoint starts: the worker's plan puts each part where it goes
    torch.cuda.empty_cache()
    return pipe, dtype


def frontier(device: torch.device, args, mem: dict, results) -> str | None:
    """The largest FRONTIER model whose weights fit both the device (they are built there) and the
    host budget (then moved there); recorded with the sizes that decided it."""
    from fleetgen.offload import profile_modules
    from fleetgen.offload.architectures import build_on_meta

    if args.dry:
        return FRONTIER[0]
    device_bytes = torch.cuda.mem_get_info(device)[1] * 0.9
    host_bytes = args.host_bytes or mem["MemTotal"] * HOST_SHARE
    sizes = {}
    for model in FRONTIER:
        architecture, _, dtype, *_ = MODELS[model]
        sizes[model] = profile_modules(architecture, build_on_meta(architecture), dtype).total_bytes
        if sizes[model] < min(device_bytes, host_bytes):
            results.data["frontier"] = {"chosen": model, "weights_bytes": sizes, "host_budget_bytes": host_bytes}
            return model
    results.data["frontier"] = {"chosen": None, "weights_bytes": sizes, "host_budget_bytes": host_bytes}
    return None


def write_prompts(path: Path, n: int) -> tuple[list, Columns]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    words = ["red", "fox", "owl", "city", "river", "tower", "garden", "robot"]
    pq.write_table(pa.table({"prompt": [f"a photo of a {words[i % 8]} at night {i}" for i in range(n)]}), path)
    files = [read_footer(str(path))]
    return plan_shards(files, n), resolve_columns(files, Columns())


def failure(err: BaseException) -> dict:
    return {
        "error": f"{type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}",
        "traceback": traceback.format_exc().strip().splitlines()[-12:],
    }


class Run:
    """One model's pipeline and the workers run on it."""

    def __init__(self, model: str, args, device: torch.device, tmp: Path, overhead: int):
        self.model, self.args, self.device, self.tmp, self.overhead = model, args, device, tmp, overhead
        self.cuda = device.type == "cuda"
        started = time.perf_counter()
        self.pipe, self.dtype = build(model, device, args.dry)
        self.build_seconds = round(time.perf_counter() - started, 1)
        self.family = MODELS[model][1]
        size = 32 if args.dry else args.size
        width = height = size
        video = {}
        if model in VIDEO:  # a clip per row: text-to-video at the check's frames and size
            frames, width, height = (5, 64, 64) if args.dry else VIDEO[model]
            video = {"task": "text-to-video", "num_frames": frames, "fps": FAMILIES[self.family].fps}
        self.video = bool(video)
        self.settings = GenerationSettings(
            **{"task": "text-to-image", "family": self.family, "width": width, "height": height, **video},
            steps=2 if args.dry else args.steps,
            guidance=FAMILIES[self.family].guidance,
        )
        self.total = torch.cuda.mem_get_info(device)[1] if self.cuda else None
        self.count = 0

    def rebuild(self) -> None:
        """A fresh pipeline (random weights again): a format applied to the last one stays on it."""
        self.pipe = None
        release_host_cache()
        started = time.perf_counter()
        self.pipe, self.dtype = build(self.model, self.device, self.args.dry)
        self.build_seconds = round(time.perf_counter() - started, 1)

    def worker(
        self,
        offload: str,
        budget: int | None,
        max_batch: int,
        images: int,
        quantize: str = "none",
        cache: str = "none",
        **speed,
    ) -> tuple[Worker, list]:
        """`speed`: the worker's own speed settings (`compile`, `attention`, `plan_trials`: off unless a
        sweep row asks, so that the other rows measure the model's own plan)."""
        speed = {"plan_trials": "off", **speed}
        self.count += 1
        shards, columns = write_prompts(self.tmp / f"{self.model}-{self.count}.parquet", images)
        spec = WorkerSpec.of(
            name=f"w{self.count}",
            model=self.model,
            output=str(self.tmp / f"out-{self.model}-{self.count}"),
            settings=dataclasses.replace(self.settings, quantize=parse_quantize(quantize), cache=parse_cache(cache)),
            columns=columns,
            max_batch=max_batch,
            device=str(self.device),
            dtype=str(self.dtype).removeprefix("torch."),
            offload=offload,
            gpu_memory=budget,
            host_memory=self.args.host_bytes,
            **{k: parse_attention(v) if k == "attention" else v for k, v in speed.items()},
        )
        return Worker(spec, pipe=self.pipe), shards

    def limit(self, budget: int | None) -> None:
        """Cap the allocator at what a card of `budget` bytes leaves PyTorch: the budget minus the
        memory this process holds outside the allocator."""
        if self.cuda:
            torch.cuda.empty_cache()
            cap = min(1.0, max(budget - self.overhead, 0) / self.total) if budget else 1.0
            torch.cuda.set_per_process_memory_fraction(cap)

    def measure(
        self, label: str, offload: str, budget: int | None, quantize: str = "none", cache: str = "none", **speed
    ) -> dict:
        """The planner's choice for `budget` (None: all resident) run on one shard, as a job runs it.
        `quantize` applies a format to the given pipeline in place (it stays: quantized rows run last);
        `cache` a step cache, `speed` compile / attention (taken off when the worker closes)."""
        row = {"model": self.model, "run": label, "budget_bytes": budget, "quantize": quantize, "cache": cache, **speed}
        self.limit(budget)
        worker = None
        try:
            images = min(self.args.images, 2) if self.video else self.args.images  # clips take minutes
            worker, shards = self.worker(offload, budget, self.args.max_batch, images, quantize, cache, **speed)
            if self.cuda:
                torch.cuda.reset_peak_memory_stats(self.device)
            result = worker.run_shard(shards[0])
            info = worker.describe()  # before close(): its peaks are this worker's
        except (FleetgenError, torch.OutOfMemoryError) as err:
            row.update(failure(err))
            return row
        finally:
            if worker is not None:
                worker.close()
            self.limit(None)
        stats, plan, compare = info["stats"], info["plan"], info["predicted_vs_measured"]
        offload_stats = info["offload"]
        moved = sum(c["bytes_onloaded"] for c in offload_stats["components"].values())
        predicted_peak = plan.get("peak_bytes") or None
        allocated = offload_stats.get("peak_device_bytes")
        row.update(
            modes=plan["modes"],
            batch=plan["batch_size"],
            streams=any("stream" in m for m in plan["modes"].values()),
            images=result.ok,
            errors=result.errors,
            images_per_second=stats["images_per_second"],
            seconds_per_image={
                "predicted_by_cost_model": compare["seconds_per_image"]["predicted"],
                "measured": compare["seconds_per_image"]["measured"],
            },
            peak_allocated_bytes={"predicted": predicted_peak, "measured": allocated},
            peak_reserved_bytes=offload_stats.get("peak_device_reserved_bytes"),
            outside_allocator_bytes=self.overhead if self.cuda else None,
            pinned_host_bytes={"planned": plan.get("pinned_bytes"), "measured": offload_stats.get("pinned_host_bytes")},
            average_h2d_gb_per_s=round(moved / stats["generate_seconds"] / 1e9, 2) if moved else 0.0,
            allocator=offload_stats.get("allocator"),  # retries, cudaMalloc and cudaFree calls in the shard
            # what the worker's probe measured, which the plan's predicted seconds are computed from
            probe={k: info["probe"].get(k) for k in ("bandwidth", "flops", "measured", "model")},
            step_downs=info["step_downs"],
            quantized=info["quantized"],
            weight_bytes=info["weight_bytes"],
            cache_counts=info["cache"],
            compiled=info["compile"],  # modes, compile seconds, graphs, breaks; why taken off if it was
            attention_kernel=info["attention"],  # the kernel and, under auto, each one measured
            phased=info["phases"],  # chunks, prompts encoded, the device's peak per phase (CUDA)
            chosen_by=plan.get("chosen_by"),  # model | measured | shared (workers/pipeline/trials.py)
            trials=plan.get("trials"),  # the candidates a sweep row's worker timed: modes, batch, measured
        )
        if predicted_peak and allocated:
            row["measured_over_predicted_peak"] = round(allocated / predicted_peak, 3)
        predicted, measured = row["seconds_per_image"]["predicted_by_cost_model"], row["seconds_per_image"]["measured"]
        if predicted and measured:
            row["measured_over_predicted_seconds"] = round(measured / predicted, 3)
        return row

    def forced_oom(self) -> dict:
        """All resident at batch 8, then held to its weights plus OOM_HEADROOM: step down, re-apply."""
        row = {"model": self.model, "run": "forced OOM"}
        budget = self.total if self.cuda else None
        worker, shards = self.worker("auto", budget, 8, 8)
        simulated = None
        try:
            if self.cuda:
                torch.cuda.empty_cache()
                held = torch.cuda.memory_allocated(self.device) + OOM_HEADROOM
                torch.cuda.set_per_process_memory_fraction(held / self.total)
                row["held_to_bytes"] = held
            else:  # CPU memory cannot be capped: raised while the plan is all resident, in SDXL's
                # VAE decode (the upcast one: a failure there once left the VAE float32), else the denoiser
                where = self.pipe.vae.decoder if self.family == "sdxl" else self.pipe.transformer

                def oom_while_resident(module, args):
                    if set(worker.plan.to_dict()["modes"].values()) == {"resident"}:
                        raise torch.OutOfMemoryError("simulated out of memory (CPU dry run)")

                simulated = where.register_forward_pre_hook(oom_while_resident)
            result = worker.run_shard(shards[0])
            info = worker.describe()
            row["first_errors"] = manifest_errors(worker, shards[0])
            row.update(
                images=result.ok,
                errors=result.errors,
                step_downs=info["step_downs"],
                final_modes=info["plan"]["modes"],
                final_batch=info["batch_size"],
                offload_hooks=offload_hooks(self.pipe),
                simulated=not self.cuda,
                final_streams=any("stream" in m for m in info["plan"]["modes"].values()),
                vae_dtype=str(self.pipe.vae.dtype).removeprefix("torch."),
            )
        finally:
            if simulated is not None:
                simulated.remove()
            worker.close()
            self.limit(None)
        row["hooks_after_close"] = offload_hooks(self.pipe)
        row["ok"] = (
            row["images"] == 8
            and not row["errors"]
            and any("batch" in str(s["to"]) for s in row["step_downs"])
            and any(isinstance(s["to"], dict) for s in row["step_downs"])
            and row["hooks_after_close"] == 0
            and row["vae_dtype"] == str(self.dtype).removeprefix("torch.")
        )
        return row


# The quantized rows, per model, at the budgets a quantized card is for: each format applied to the
# denoiser of the pipeline built for the check (formats stay on the pipeline they are applied to: the
# next after-load format gets a rebuilt one). At-load formats (bitsandbytes) need weights loading from
# files, which this check's in-memory random pipelines are not: their rows say so.
QUANTIZED_FORMATS = ("fp8", "int8", "nf4")
QUANTIZED_BUDGETS = ("16", "24")  # GiB


# The speed rows (#24), each at batch 1 beside a plain row at batch 1, all resident and at the 24 GiB
# budget (block offload under it): First Block Cache at ParaAttention's FLUX.1-dev threshold (1.4x at
# LPIPS ~0.08 published; a first-block cache makes one image per call, skipped blocks should move
# nothing), regional compilation under the plan (diffusers PR #11605: Wan 14B forward with group
# offloading 4.92 -> 4.11 s), and the attention kernel each worker measures (`auto`).
SPEEDS = {
    "cache": ("cache first-block:0.08", {"cache": "first-block:0.08"}),
    "compile": ("compile", {"compile": True}),
    "attention": ("attention auto", {"attention": "auto"}),
}


def phased_rows(run: Run, results, started: float) -> None:
    """Per batch, then phased, at the model's PHASED budget (scaled in a dry run)."""
    if run.model not in PHASED:
        return
    ((label, budget),) = budgets_for(run, [PHASED[run.model]])
    for phases, name in (("off", "per batch"), ("on", "phased")):
        if time.perf_counter() - started > run.args.time_limit:
            results.add({"model": run.model, "run": name, "skipped": f"--time-limit {run.args.time_limit:g} s reached"})
            continue
        try:
            row = run.measure(f"{name} {label}", "auto", budget, phases=phases)
        except Exception as err:  # noqa: BLE001 - recorded; the next row runs
            row = {"model": run.model, "run": f"{name} {label}", "budget_bytes": budget, **failure(err)}
            run.limit(None)
        results.add(row)


SWEEP_SHARD = 1000  # images a sweep worker counts its shard as: its trials' cap then times three candidates


def sweep_rows(run: Run, jobs: list, results, started: float) -> None:
    """The plan sweep: per budget, a worker with `--plan-trials on --phases off` times the model's three best
    per-batch plans on this device (each candidate's seconds per image in the row's `trials`), keeps the fastest, and
    makes the shard with it. Its rows feed bench/fit_speed.py. A dry run sweeps its first budget only."""
    budgets = [j for j in jobs if j[2] is not None]
    for label, offload, budget in budgets[:1] if run.args.dry else budgets:
        name = f"trials {label}"
        if time.perf_counter() - started > run.args.time_limit:
            results.add({"model": run.model, "run": name, "skipped": f"--time-limit {run.args.time_limit:g} s reached"})
            continue
        try:
            # per batch: phased plans are not timed (workers/pipeline/trials.py)
            row = run.measure(name, offload, budget, plan_trials="on", shard_images=SWEEP_SHARD, phases="off")
        except Exception as err:  # noqa: BLE001 - recorded; the next row runs
            row = {"model": run.model, "run": name, "budget_bytes": budget, **failure(err)}
            run.limit(None)
        results.add(row)


def speed_rows(run: Run, jobs: list, results, started: float) -> None:
    from fleetgen.workers.pipeline.caching import pipeline_refusal

    kinds = [k for k in run.args.speed.split(",") if k]
    why = {"cache": pipeline_refusal(type(run.pipe).__name__, False, "first-block")}
    for kind in [k for k in kinds if why.get(k)]:
        results.add({"model": run.model, "run": SPEEDS[kind][0], **SPEEDS[kind][1], "skipped": why[kind]})
    kinds = [k for k in kinds if not why.get(k)]
    targets = [jobs[0], *[j for j in jobs if j[0].split()[0] == "24"]] if kinds else []
    for label, offload, budget in targets:
        plain = None
        for name, settings in [("plain", {}), *(SPEEDS[k] for k in kinds)]:
            name = f"{name}, {label}, batch 1"
            if time.perf_counter() - started > run.args.time_limit:
                results.add(
                    {"model": run.model, "run": name, "skipped": f"--time-limit {run.args.time_limit:g} s reached"}
                )
                continue
            max_batch, run.args.max_batch = run.args.max_batch, 1
            try:
                row = run.measure(name, offload, budget, **settings)
            except Exception as err:  # noqa: BLE001 - recorded; the next row runs
                row = {"model": run.model, "run": name, "budget_bytes": budget, **failure(err)}
                run.limit(None)
            finally:
                run.args.max_batch = max_batch
            if not settings:
                plain = row
            elif (plain or {}).get("images_per_second") and row.get("images_per_second"):
                row["vs_plain"] = round(row["images_per_second"] / plain["images_per_second"], 3)
            results.add(row)


def quantized_rows(run: Run, jobs: list, denoiser: str, resident: dict, results, started: float) -> None:
    from fleetgen.offload.weight_formats import spec, unavailable

    targets = [j for j in jobs if j[0].split()[0] in QUANTIZED_BUDGETS] or jobs[-1:]
    applied = False
    for fmt in QUANTIZED_FORMATS:
        why = unavailable(fmt, run.cuda) or (
            f"{fmt} applies as the weights load (bitsandbytes); this check builds its pipelines in memory"
            if spec(fmt).at_load
            else None
        )
        if why:
            results.add({"model": run.model, "run": f"{denoiser} {fmt}", "quantize": fmt, "skipped": why})
            continue
        if applied:  # the previous format stays on its pipeline
            run.rebuild()
        applied = True
        for label, offload, budget in targets:
            name = f"{denoiser} {fmt}, {label}"
            if time.perf_counter() - started > run.args.time_limit:
                results.add(
                    {"model": run.model, "run": name, "skipped": f"--time-limit {run.args.time_limit:g} s reached"}
                )
                continue
            try:
                row = run.measure(name, offload, budget, f"{denoiser}={fmt}")
            except Exception as err:  # noqa: BLE001 - recorded; the next row runs
                row = {"model": run.model, "run": name, "budget_bytes": budget, **failure(err)}
                run.limit(None)
            if resident.get("images_per_second") and row.get("images_per_second"):
                row["vs_resident"] = round(row["images_per_second"] / resident["images_per_second"], 3)
            results.add(row)


def manifest_errors(worker: Worker, shard, limit: int = 3) -> list[str]:
    """The first error messages of a shard's committed manifest."""
    from fleetgen.workers.output.layout import manifest_key

    table = worker.output.read_parquet(manifest_key(shard.id), ["error"])
    return [e for e in table.column("error").to_pylist() if e][:limit]


def gpu_tests() -> dict:
    started = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", *GPU_TESTS],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=GPU_TESTS_TIMEOUT,
        )
    except subprocess.TimeoutExpired as err:
        return {
            "returncode": "timeout",
            "summary": f"over {GPU_TESTS_TIMEOUT} s",
            "output_tail": str(err.stdout or "")[-3000:],
            "seconds": round(time.perf_counter() - started, 1),
        }
    tail = (proc.stdout + proc.stderr).strip().splitlines()
    return {
        "returncode": proc.returncode,
        "summary": tail[-1] if tail else "",
        "seconds": round(time.perf_counter() - started, 1),
        "output_tail": "\n".join(tail[-30:]) if proc.returncode else "",
    }


def budgets_for(run: Run, gib: list[float]) -> list[tuple[str, int]]:
    """Budgets in bytes: as asked on CUDA. In a dry run a tiny model's activations dwarf its
    weights, so budgets are placed between the leanest plan's need (at 0 GiB) and all resident at
    batch 1 (at 48 GiB): the small ones must offload, as on a GPU."""
    if not run.args.dry:
        return [(f"{g:g} GiB", int(g * GiB)) for g in gib]
    from fleetgen.offload import DeviceSpec, Workload, plan, profile_pipeline

    s = run.settings
    profile = profile_pipeline(run.pipe, vae_upcast=run.family == "sdxl")

    def fits(budget: int, offload: str = "auto") -> bool:
        work = Workload(width=s.width, height=s.height, steps=s.steps, cfg=True, max_batch=1, offload=offload)
        try:
            plan(profile, DeviceSpec(budget=budget, host_budget=2**50, streams=False), work)
            return True
        except FleetgenError:
            return False

    def least(offload: str) -> int:
        low, high = 1, 2**40
        while high - low > max(1, high // 1000):
            low, high = (low, (low + high) // 2) if fits((low + high) // 2, offload) else ((low + high) // 2, high)
        return high

    leanest, resident = least("auto"), least("none")
    return [(f"{g:g} GiB (scaled)", int(leanest + (resident - leanest) * min(g, 48) / 48 * 1.01)) for g in gib]


def table(rows: list[dict]) -> str:
    lines = [
        "model        run              plan                                   batch  peak alloc / predicted  "
        "reserved   s/image meas/pred  avg H2D GB/s  vs resident"
    ]
    for r in rows:
        if "error" in r or "skipped" in r:
            lines.append(f"{r['model']:12s} {r['run']:16s} {(r.get('error') or r['skipped'])[:110]}")
            continue
        if r["run"] == "forced OOM":
            lines.append(
                f"{r['model']:12s} {r['run']:16s} {'ok' if r['ok'] else 'FAILED'}: {len(r['step_downs'])} step-downs "
                f"-> {r['final_modes']} batch {r['final_batch']}, {r['images']} images, VAE {r['vae_dtype']}"
                f"{' (simulated)' if r['simulated'] else ''}"
            )
            continue
        modes = ",".join(f"{k}:{v}" for k, v in r["modes"].items() if v != "resident") or "all resident"
        peak = r["peak_allocated_bytes"]
        peak_text = (format_size(peak["measured"]) if peak["measured"] is not None else "-") + (
            f" / {format_size(peak['predicted'])}" if peak["predicted"] else ""
        )
        reserved = format_size(r["peak_reserved_bytes"]) if r.get("peak_reserved_bytes") else "-"
        sp = r["seconds_per_image"]
        ratio = r.get("measured_over_predicted_seconds")
        lines.append(
            f"{r['model']:12s} {r['run']:16s} {modes[:38]:38s} {r['batch']:5d}  {peak_text:23s} {reserved:9s} "
            f"{(sp['measured'] or 0):7.3f} {ratio if ratio is not None else '-':>9}  "
            f"{r['average_h2d_gb_per_s']:12.1f}  {r.get('vs_resident', r.get('vs_plain', '-'))}"
            + (
                f"  skipped {r['cache_counts']['skipped_share']:.0%}"
                if (r.get("cache_counts") or {}).get("skipped_share") is not None
                else ""
            )
        )
    return "\n".join(lines)


class Results:
    """The JSON file, rewritten after every row: a crash or a timeout keeps what was measured."""

    def __init__(self, path: Path, header: dict):
        self.path, self.data = path, {**header, "rows": []}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.write()

    def write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=str))
        tmp.replace(self.path)

    def add(self, row: dict) -> dict:
        self.data["rows"].append(row)
        self.write()
        print(table([row]).splitlines()[1], flush=True)
        return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry", action="store_true", help="tiny models on CPU: checks the script, not the GPU")
    parser.add_argument(
        "--models",
        default=DEFAULT_MODELS,
        help="in this order (the headline model first); frontier: the largest of "
        f"{', '.join(FRONTIER)} that fits this machine's device and host RAM",
    )
    parser.add_argument("--budgets", default="8,16,24", help="GiB, emulated on one GPU")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--images", type=int, default=4, help="images per measured shard")
    parser.add_argument("--max-batch", type=int, default=4)
    parser.add_argument(
        "--host-memory",
        help=f"host RAM per worker for offloaded copies (default on CUDA: "
        f"{HOST_SHARE:.0%} of MemTotal; a VM's MemAvailable may read low)",
    )
    parser.add_argument("--time-limit", type=float, default=480, help="seconds; rows after it are skipped (recorded)")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument(
        "--speed", default="cache,compile,attention", help="speed rows to run beside a plain one (comma-separated)"
    )
    parser.add_argument(
        "--json",
        default=str(Path(os.environ.get("OUT", ".")) / "gpu-check.json"),
        help="written after every row (default $OUT/gpu-check.json, else ./gpu-check.json)",
    )
    args = parser.parse_args()
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.get_logger("diffusers").addFilter(_Once())
    for handler in logging.getLogger("diffusers").handlers:
        handler.addFilter(_Once())
    if args.dry:
        if args.models == DEFAULT_MODELS:  # the dry run checks the code paths: one phased model is enough
            args.models = DEFAULT_MODELS.replace("z-image-turbo,", "")
        args.images = min(args.images, 2)
        args.budgets = args.budgets if args.budgets != "8,16,24" else "8,16,24,48"  # 48: resident, scaled
    cuda = torch.cuda.is_available() and not args.dry
    if not cuda and not args.dry:
        sys.exit("No CUDA device here: `make gpu-check-dry` runs the same script at tiny size on CPU.")
    device = torch.device("cuda" if cuda else "cpu")
    mem = meminfo()
    args.host_bytes = (
        parse_size(args.host_memory, "--host-memory")
        if args.host_memory
        else (int(mem["MemTotal"] * HOST_SHARE) if cuda else None)
    )
    overhead = 0
    if cuda:
        torch.cuda.init()
        torch.empty(1, device=device)  # the context exists from here
        free, total = torch.cuda.mem_get_info(device)
        overhead = total - free - torch.cuda.memory_reserved(device)
    started = time.perf_counter()
    results = Results(
        Path(args.json),
        {
            "device": torch.cuda.get_device_name(device) if cuda else "cpu (dry run)",
            "dry": args.dry,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "settings": vars(args),
            "meminfo": mem,
            "outside_allocator_bytes": overhead,
        },
    )
    if not args.skip_tests:
        results.data["gpu_tests"] = tests = gpu_tests()
        results.write()
        print(f"gpu tests: {tests['summary']} ({tests['seconds']} s)", flush=True)
    models = [frontier(device, args, mem, results) if m == "frontier" else m for m in args.models.split(",")]
    with tempfile.TemporaryDirectory(prefix="fleetgen-gpu-check-") as tmp:
        for model in [m for m in models if m]:
            late = time.perf_counter() - started > args.time_limit
            if late:
                results.add({"model": model, "run": "all", "skipped": f"--time-limit {args.time_limit:g} s reached"})
                continue
            try:
                run = Run(model, args, device, Path(tmp), overhead)
                jobs = [
                    ("all resident", "none", None),
                    *[(label, "auto", b) for label, b in budgets_for(run, [float(b) for b in args.budgets.split(",")])],
                ]
            except Exception as err:  # noqa: BLE001 - recorded; the next model runs
                results.add({"model": model, "run": "build", **failure(err)})
                continue
            print(f"{model}: built in {run.build_seconds} s", flush=True)
            resident = {}
            denoiser = "unet" if "unet" in run.pipe.components else "transformer"
            # the forced OOM's 8 clips at batch 8 would outlast the session: images only
            for label, offload, budget in [*jobs, *([] if run.video else [("forced OOM", None, None)])]:
                if time.perf_counter() - started > args.time_limit:
                    results.add(
                        {"model": model, "run": label, "skipped": f"--time-limit {args.time_limit:g} s reached"}
                    )
                    continue
                try:
                    row = run.forced_oom() if label == "forced OOM" else run.measure(label, offload, budget)
                except Exception as err:  # noqa: BLE001 - recorded; the next row runs
                    row = {"model": model, "run": label, "budget_bytes": budget, **failure(err)}
                    run.limit(None)
                if label == "all resident":
                    resident = row
                elif resident.get("images_per_second") and row.get("images_per_second"):
                    row["vs_resident"] = round(row["images_per_second"] / resident["images_per_second"], 3)
                results.add(row)
            sweep_rows(run, jobs, results, started)
            phased_rows(run, results, started)
            speed_rows(run, jobs, results, started)
            quantized_rows(run, jobs, denoiser, resident, results, started)
            del run
            release_host_cache()
    results.data["seconds"] = round(time.perf_counter() - started, 1)
    results.write()
    print(table(results.data["rows"]))
    print(f"{results.data['device']}: {results.data['seconds']} s -> {args.json}")
    rows = results.data["rows"]
    failed = [r for r in rows if (r["run"] == "forced OOM" and not r.get("ok")) or "error" in r]
    if results.data.get("gpu_tests", {}).get("returncode") not in (None, 0, 5) or failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
