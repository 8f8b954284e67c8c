"""Every CUDA path of fleetgen, run once on a real GPU: `make gpu-check` (no Ray).

  1. the `gpu`-marked tests (streams give the same latents; offload re-applied with streams
     leaves no stale hook);
  2. SDXL and FLUX.1-dev at their real sizes with random weights, built directly on the GPU from
     the configs in offload/architectures (tokenizers: the small in-memory ones, whose ids fit any
     vocabulary). For each model: all resident, then for each budget (emulated with
     `torch.cuda.set_per_process_memory_fraction`) the planner's choice, through the same `Worker`
     a job uses (plan, apply, warm up, generate a shard, encode, write to a local output):
     measured peak vs budget, measured vs predicted seconds per image, achieved host→device
     GB/s, images/s relative to all resident, and any step-down;
  3. a real out-of-memory error: a worker planned all resident at batch 8, then held to what its
     weights take plus 512 MiB: it must step down (batch, then a leaner plan re-applied with
     streams) and still make every image.

Writes one JSON file and prints a table. `--dry` runs the same code at tiny size on CPU (budgets
scaled to the tiny models; the OOM is raised by a hook, as CPU memory cannot be capped): that is
`make gpu-check-dry`, part of the test suite, so the script cannot rot.

    python bench/gpu_check.py [--json gpu-check.json] [--budgets 8,12,16,24,48,80] [--steps 6]
    python bench/gpu_check.py --dry
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fleetgen.errors import FleetgenError  # noqa: E402
from fleetgen.units import format_size  # noqa: E402
from jobs.sharding import plan_shards, read_footer, resolve_columns  # noqa: E402
from offload.apply import offload_hooks  # noqa: E402
from workers.shard import Columns  # noqa: E402
from workers.worker import GenerationSettings, Worker, WorkerSpec  # noqa: E402

GiB = 2**30
GPU_TESTS = ["tests/test_bench.py", "tests/test_gpu.py"]  # the files holding `gpu`-marked tests (no Ray imports)
# model: (shipped architecture, family, dtype on CUDA, tiny builder for --dry)
MODELS = {"sdxl": ("sdxl", "sdxl", torch.float16, "build_tiny_sdxl"),
          "flux.1-dev": ("flux.1-dev", "flux", torch.bfloat16, "build_tiny_flux")}
OOM_HEADROOM = 512 * 2**20  # the forced OOM holds a worker to its weights plus this


def build(model: str, device: torch.device, dry: bool):
    import workers.tiny_model as tiny

    architecture, family, dtype, tiny_builder = MODELS[model]
    if dry:
        pipe = getattr(tiny, tiny_builder)(0, **({"guidance_embeds": True} if family == "flux" else {}))
        return pipe, torch.float32
    pipe = tiny.build_random_pipeline(architecture, device, dtype)
    pipe.to("cpu")  # where a loaded checkpoint starts: the worker's plan puts each part where it goes
    torch.cuda.empty_cache()
    return pipe, dtype


def write_prompts(path: Path, n: int) -> tuple[list, Columns]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    words = ["red", "fox", "owl", "city", "river", "tower", "garden", "robot"]
    pq.write_table(pa.table({"prompt": [f"a photo of a {words[i % 8]} at night {i}" for i in range(n)]}), path)
    files = [read_footer(str(path))]
    return plan_shards(files, n), resolve_columns(files, Columns())


class Run:
    """One model's pipeline and the workers run on it."""

    def __init__(self, model: str, args, device: torch.device, tmp: Path):
        self.model, self.args, self.device, self.tmp = model, args, device, tmp
        self.cuda = device.type == "cuda"
        started = time.perf_counter()
        self.pipe, self.dtype = build(model, device, args.dry)
        self.build_seconds = round(time.perf_counter() - started, 1)
        self.family = MODELS[model][1]
        size = 64 if args.dry else args.size
        self.settings = GenerationSettings(steps=2 if args.dry else args.steps, guidance=3.5 if self.family == "flux" else 5.0,
                                           width=size, height=size, family=self.family)
        self.total = torch.cuda.mem_get_info(device)[1] if self.cuda else None
        self.count = 0

    def worker(self, offload: str, budget: int | None, max_batch: int, images: int) -> tuple[Worker, list]:
        self.count += 1
        shards, columns = write_prompts(self.tmp / f"{self.model}-{self.count}.parquet", images)
        spec = WorkerSpec(name=f"w{self.count}", model=self.model, output=str(self.tmp / f"out-{self.model}-{self.count}"),
                          settings=self.settings, columns=columns, max_batch=max_batch, device=str(self.device),
                          dtype=str(self.dtype).removeprefix("torch."), offload=offload, gpu_memory=budget)
        return Worker(spec, pipe=self.pipe), shards

    def limit(self, budget: int | None) -> None:
        if self.cuda:
            torch.cuda.empty_cache()
            torch.cuda.set_per_process_memory_fraction(min(1.0, budget / self.total) if budget else 1.0)

    def measure(self, label: str, offload: str, budget: int | None) -> dict:
        """The planner's choice for `budget` (None: all resident) run on one shard, as a job runs it."""
        row = {"model": self.model, "run": label, "budget_bytes": budget}
        self.limit(budget)
        worker = None
        try:
            worker, shards = self.worker(offload, budget, self.args.max_batch, self.args.images)
            if self.cuda:
                torch.cuda.reset_peak_memory_stats(self.device)
            result = worker.run_shard(shards[0])
            info = worker.describe()
        except (FleetgenError, torch.OutOfMemoryError) as err:
            row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
            return row
        finally:
            if worker is not None:
                worker.close()
            self.limit(None)
        stats, plan, compare = info["stats"], info["plan"], info["predicted_vs_measured"]
        moved = sum(c["bytes_onloaded"] for c in info["offload"]["components"].values())
        peak = torch.cuda.max_memory_allocated(self.device) if self.cuda else None
        row.update(
            modes=plan["modes"], batch=plan["batch_size"], streams=any("stream" in m for m in plan["modes"].values()),
            images=result.ok, errors=result.errors, images_per_second=stats["images_per_second"],
            seconds_per_image={"predicted": compare["seconds_per_image"]["predicted"],
                               "measured": compare["seconds_per_image"]["measured"]},
            peak_bytes={"predicted": plan.get("peak_bytes"), "measured": peak},
            host_to_device_gb_per_s=round(moved / stats["generate_seconds"] / 1e9, 2) if moved else 0.0,
            step_downs=info["step_downs"],
        )
        if budget and peak is not None:
            row["peak_within_budget"] = peak <= budget
        predicted, measured = row["seconds_per_image"]["predicted"], row["seconds_per_image"]["measured"]
        if predicted and measured:
            row["measured_over_predicted"] = round(measured / predicted, 3)
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
            else:  # CPU memory cannot be capped: the denoiser raises while the plan is all resident
                denoiser = getattr(self.pipe, "transformer", None) or self.pipe.unet

                def oom_while_resident(module, args):
                    if set(worker.plan.to_dict()["modes"].values()) == {"resident"}:
                        raise torch.OutOfMemoryError("simulated out of memory (CPU dry run)")

                simulated = denoiser.register_forward_pre_hook(oom_while_resident)
            result = worker.run_shard(shards[0])
            info = worker.describe()
            row["first_errors"] = manifest_errors(worker, shards[0])
            row.update(images=result.ok, errors=result.errors, step_downs=info["step_downs"],
                       final_modes=info["plan"]["modes"], final_batch=info["batch_size"],
                       offload_hooks=offload_hooks(self.pipe), simulated=not self.cuda,
                       final_streams=any("stream" in m for m in info["plan"]["modes"].values()))
        finally:
            if simulated is not None:
                simulated.remove()
            worker.close()
            self.limit(None)
        row["hooks_after_close"] = offload_hooks(self.pipe)
        row["ok"] = (row["images"] == 8 and not row["errors"] and any("batch" in str(s["to"]) for s in row["step_downs"])
                     and any(isinstance(s["to"], dict) for s in row["step_downs"]) and row["hooks_after_close"] == 0)
        return row


def manifest_errors(worker: Worker, shard, limit: int = 3) -> list[str]:
    """The first error messages of a shard's committed manifest."""


    from workers.layout import manifest_key

    table = worker.output.read_parquet(manifest_key(shard.id), ["error"])
    return [e for e in table.column("error").to_pylist() if e][:limit]


def gpu_tests() -> dict:
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", *GPU_TESTS],
                          cwd=ROOT, capture_output=True, text=True)
    tail = (proc.stdout + proc.stderr).strip().splitlines()
    return {"returncode": proc.returncode, "summary": tail[-1] if tail else "", "seconds": round(time.perf_counter() - started, 1),
            "output_tail": "\n".join(tail[-30:]) if proc.returncode else ""}


def budgets_for(run: Run, gib: list[float]) -> list[tuple[str, int]]:
    """Budgets in bytes: as asked on CUDA; in a dry run, the same ratios to what all resident needs
    (the all-resident need of a tiny model standing for 32 GiB)."""
    if not run.args.dry:
        return [(f"{g:g} GiB", int(g * GiB)) for g in gib]
    from offload import DeviceSpec, Workload, plan, profile_pipeline

    unlimited = DeviceSpec(budget=2**50, host_budget=2**50, streams=False)
    s = run.settings
    need = plan(profile_pipeline(run.pipe), unlimited, Workload(width=s.width, height=s.height, steps=s.steps, cfg=True,
                                                                 max_batch=run.args.max_batch, offload="none")).peak_bytes
    return [(f"{g:g} GiB (scaled)", int(g / 32 * need)) for g in gib]


def table(rows: list[dict]) -> str:
    lines = ["model        run              plan                                   batch  peak / budget          "
             "s/image meas/pred  GB/s   vs resident"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['model']:12s} {r['run']:16s} {r['error'][:100]}")
            continue
        if r["run"] == "forced OOM":
            lines.append(f"{r['model']:12s} {r['run']:16s} {'ok' if r['ok'] else 'FAILED'}: {len(r['step_downs'])} step-downs "
                         f"-> {r['final_modes']} batch {r['final_batch']}, {r['images']} images"
                         f"{' (simulated)' if r['simulated'] else ''}")
            continue
        modes = ",".join(f"{k}:{v}" for k, v in r["modes"].items() if v != "resident") or "all resident"
        peak = r["peak_bytes"]["measured"]
        budget = r.get("budget_bytes")
        peak_text = (format_size(peak) if peak is not None else "-") + (f" / {format_size(budget)}" if budget else "")
        sp = r["seconds_per_image"]
        ratio = r.get("measured_over_predicted")
        lines.append(f"{r['model']:12s} {r['run']:16s} {modes[:38]:38s} {r['batch']:5d}  {peak_text:22s} "
                     f"{(sp['measured'] or 0):7.3f} {ratio if ratio is not None else '-':>9}  "
                     f"{r['host_to_device_gb_per_s']:5.1f}  {r.get('vs_resident', '-')}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry", action="store_true", help="tiny models on CPU: checks the script, not the GPU")
    parser.add_argument("--models", default="sdxl,flux.1-dev")
    parser.add_argument("--budgets", default="8,12,16,24,48,80", help="GiB, emulated on one GPU")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--images", type=int, default=4, help="images per measured shard")
    parser.add_argument("--max-batch", type=int, default=4)
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--json", default="gpu-check.json")
    args = parser.parse_args()
    if args.dry:
        args.images = min(args.images, 2)
    cuda = torch.cuda.is_available() and not args.dry
    if not cuda and not args.dry:
        sys.exit("No CUDA device here: `make gpu-check-dry` runs the same script at tiny size on CPU.")
    device = torch.device("cuda" if cuda else "cpu")
    started = time.perf_counter()
    result = {"device": torch.cuda.get_device_name(device) if cuda else "cpu (dry run)", "dry": args.dry,
              "torch": torch.__version__, "python": platform.python_version(), "settings": vars(args), "rows": []}
    if not args.skip_tests:
        result["gpu_tests"] = tests = gpu_tests()
        print(f"gpu tests: {tests['summary']} ({tests['seconds']} s)", flush=True)
    with tempfile.TemporaryDirectory(prefix="fleetgen-gpu-check-") as tmp:
        for model in args.models.split(","):
            run = Run(model, args, device, Path(tmp))
            print(f"{model}: built in {run.build_seconds} s", flush=True)
            resident = run.measure("all resident", "none", None)
            result["rows"].append(resident)
            for label, budget in budgets_for(run, [float(b) for b in args.budgets.split(",")]):
                row = run.measure(label, "auto", budget)
                if resident.get("images_per_second") and row.get("images_per_second"):
                    row["vs_resident"] = round(row["images_per_second"] / resident["images_per_second"], 3)
                result["rows"].append(row)
                print(table([row]).splitlines()[1], flush=True)
            result["rows"].append(run.forced_oom())
            print(table(result["rows"][-1:]).splitlines()[1], flush=True)
            del run
            if cuda:
                torch.cuda.empty_cache()
    result["seconds"] = round(time.perf_counter() - started, 1)
    print(table(result["rows"]))
    print(f"{result['device']}: {result['seconds']} s")
    Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    failed = [r for r in result["rows"] if r["run"] == "forced OOM" and not r["ok"]]
    if result.get("gpu_tests", {}).get("returncode") not in (None, 0, 5) or failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
